"""Failures and their timing, for the memory tier's demo and benchmark (docs/memory.md, "Measured").

Shared by ``launch/elastic_demo.py --memory``, ``benchmarks/bench_recovery.py`` and the chaos
harness's ``--memory`` mode. Linux only (processes are read from ``/proc``).

Simulated nodes: each torchrun agent (a node) gets its own ``DISTCKPT_NODE_ID`` (:func:`node_env`)
and, through ``memory.dir``'s ``{node}``, its own memory directory under one memory root
(:func:`memory_overrides`). The failures:

* a worker crash (:func:`crash_worker`): one worker process of a node SIGKILLed; the node's agent,
  the other workers and the node's memory directory are untouched.
* a node loss (:func:`lose_node`): the node's agent and every worker SIGKILLed as a whole
  (:func:`launch.jobs.kill_job`) and its memory directory deleted (its RAM is gone).

Recovery breakdown (:func:`breakdown`), from the trigger's wall time and rank 0's records of the
first worker round after it (``launch/train.py``'s ``resumed`` event and first metrics record):

* ``detect``: trigger -> the new worker process starts (torchrun notices the failure, stops the
  other workers and completes the agents' rendezvous round).
* ``rendezvous``: worker start -> ``load()`` begins (``init_process_group``, where the ranks of the
  round meet, then building the model, loader and ``CheckpointManager``).
* ``restore``: ``manager.load()``.
* ``first_step``: ``load()`` returned -> the first step completed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from launch.jobs import kill_job, process_tree

__all__ = [
    "PHASES",
    "breakdown",
    "crash_worker",
    "default_memory_root",
    "lose_node",
    "memory_overrides",
    "node_env",
    "worker_pids",
]

PHASES = ("detect", "rendezvous", "restore", "first_step")


def default_memory_root(tag: str) -> Path:
    """``/dev/shm/<tag>`` (a tmpfs: memory), or ``/tmp/<tag>`` where there is no ``/dev/shm``."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path("/tmp")) / tag


def memory_overrides(memory_root: Path, *, interval_steps: int = 1, replicas: int = 1) -> list[str]:
    """``launch.train`` overrides turning the memory tier on, one directory per node under ``memory_root``."""
    return [
        "checkpoint.memory.enabled=true",
        f"checkpoint.memory.interval_steps={interval_steps}",
        f"checkpoint.memory.replicas={replicas}",
        f"checkpoint.memory.dir={memory_root}/{{node}}",
    ]


def node_env(node: str) -> dict[str, str]:
    """The environment of a simulated node's agent (its workers inherit it)."""
    return {"DISTCKPT_NODE_ID": node}


def worker_pids(agent: subprocess.Popen) -> dict[int, int]:
    """``{local rank: pid}`` of the ``launch.train`` workers of a torchrun agent (its process tree)."""
    out: dict[int, int] = {}
    for pid in process_tree(agent.pid)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launch.train" not in cmd:
            continue
        for var in env:
            if var.startswith(b"LOCAL_RANK="):
                out.setdefault(int(var.split(b"=", 1)[1]), pid)
    return out


def crash_worker(agent: subprocess.Popen, local_rank: int = 1) -> float:
    """SIGKILL the worker of local rank ``local_rank`` of ``agent``; returns the wall time of the kill.

    Raises:
        RuntimeError: the agent has no such worker (not started yet, or already gone).
    """
    pid = worker_pids(agent).get(local_rank)
    if pid is None:
        raise RuntimeError(f"torchrun agent {agent.pid} has no worker of local rank {local_rank}")
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def lose_node(agent: subprocess.Popen, memory_dir: Path | None) -> float:
    """SIGKILL the node's agent and workers (:func:`launch.jobs.kill_job`) and delete its memory
    directory; returns the wall time of the kill."""
    t = time.time()
    kill_job(agent)
    if memory_dir is not None:
        shutil.rmtree(memory_dir, ignore_errors=True)
    return t


def breakdown(t_trigger: float, resumed: dict[str, Any], first: dict[str, Any]) -> dict[str, float | None]:
    """The recovery phases in seconds (module doc).

    Args:
        t_trigger: wall time of the kill (or of the new node's start).
        resumed: rank 0's ``resumed`` event of the new worker round.
        first: rank 0's first metrics record of that round (``time``: wall time of the step's end).
    """
    start, load_start, load_end = resumed.get("worker_start"), resumed.get("load_start"), resumed.get("load_end")

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    return {
        "detect": span(t_trigger, start),
        "rendezvous": span(start, load_start),
        "restore": span(load_start, load_end),
        "first_step": span(load_end, first.get("time")),
    }
