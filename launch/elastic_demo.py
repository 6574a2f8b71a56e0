"""Elastic demo: a torchrun job grows from one node to two (2 -> 4 ranks) and loses one (4 -> 2).

``python -m launch.elastic_demo --out runs/elastic`` (``make demo-elastic``) drives real torchrun
agents of ``launch/train.py`` as two nodes on this machine (2 ranks each, c10d rendezvous over
loopback, ``--nnodes 1:2``, the same ``--rdzv-id``; every worker on the same checkpoint root),
global batch held constant:

a. ``baseline``  2 ranks (``--standalone``), uninterrupted, for the loss and sample comparison.
b. ``elastic``   node A's agent trains at world size 2. Node B's agent starts mid-run, between
                 two interval checkpoints: A's agent stops its workers with SIGTERM (they save
                 at the next step boundary and exit 0) and both agents start 4 workers that
                 resume from that checkpoint (``node_join``). Later, strictly between two
                 checkpoints written at world size 4, node B's agent and its workers are
                 SIGKILLed (``node_loss``): A's workers fail in their next collective, A's agent
                 (which hosts the rendezvous store) restarts them (one ``--max-restarts`` slot)
                 and they continue at world size 2 from the newest committed checkpoint, to
                 the end.

With ``--memory`` (``make demo-elastic-memory``) the memory tier is on (docs/memory.md: a
snapshot every step, a replica on the other node): each agent is a node with its own
``DISTCKPT_NODE_ID`` and memory directory (``<memory root>/node_a``, ``.../node_b``), and between
the join and the node loss one worker of node A is SIGKILLed (``worker_crash``: node A's agent,
its other worker and its memory intact; both agents restart their workers at world size 4).
The node loss also deletes node B's memory directory. Each event then also records ``tier``,
``bytes_read_from_root``, ``bytes_between_nodes`` and ``breakdown_s`` (``launch/recovery.py``);
the demo exits 1 when the crash or the node loss replays more than one step or reads the root.

Scale-up needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment with torch
2.13 (see :data:`ELASTIC_ENV`); :func:`agent_command` is the torchrun command line.

Records. All workers append to the same ``train.out`` (see ``launch/train.py``): the loss of a
step is compared with the baseline for every execution of it; the kept sample ids of step ``s``
are those of its last execution, at the world size ``w`` that execution ran at (rank 0's last
``metrics.jsonl`` record of ``s``): ranks ``0..w-1``'s last ``samples.rank<r>.jsonl`` records
of ``s``. Duplicated and skipped samples are counted as in ``launch/jobs.py``.

``<out>/summary.json``: ``{"events": [{"trigger", "world_size_before", "world_size_after",
"saved_on_sigterm", "resumed_from_step", "steps_replayed", "seconds_to_resume"}, ...],
"final_step", "max_abs_loss_diff", "duplicated_samples", "skipped_samples", ...}``;
``seconds_to_resume`` runs from the trigger (B's agent started / B killed) to the first step
completed at the new world size. With ``--memory`` each event also has ``"tier"``,
``"bytes_read_from_root"``, ``"bytes_between_nodes"`` and ``"breakdown_s": {"detect",
"rendezvous", "restore", "first_step"}`` (``launch/recovery.py``). Exit 1 when the loss differs
from the baseline by more than ``--tolerance``, a sample is duplicated or skipped, the join
replayed a step, or a transition did not happen (``--memory``: or the crash or the node loss
replayed more than one step or read the root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from distckpt import ConfigError  # noqa: E402
from launch import recovery  # noqa: E402
from launch.config import load_job_config  # noqa: E402
from launch.elastic_report import Timeline, analyze, check, print_table  # noqa: E402
from launch.jobs import Run, kill_job, launch, read_jsonl  # noqa: E402

__all__ = [
    "ELASTIC_ENV",
    "RDZV_CONF",
    "Agent",
    "agent_command",
    "free_port",
    "start_agent",
    "Timeline",
    "analyze",
    "check",
    "main",
]

# torch 2.13: with the agent's rendezvous TCP store shared with the workers (the default),
# MASTER_ADDR/PORT are published only in an agent's first rendezvous round, so a scale-up
# round waits for them until the store timeout and the job dies (DistStoreError ... role_info).
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# A round completes 2 s after the minimum of nodes joined (default 30 s); heartbeats every 1 s,
# a node is dropped after 3 missed ones (default 5 s x 3).
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(
    port: int,
    run_id: str,
    nproc: int,
    train_args: list[str],
    *,
    nnodes: str = "1:2",
    max_restarts: int = 3,
    rdzv_conf: str = RDZV_CONF,
) -> list[str]:
    """The torchrun command of one node of the elastic job (c10d rendezvous on 127.0.0.1:``port``)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--local-addr=127.0.0.1",
        f"--max-restarts={max_restarts}",
        f"--rdzv-conf={rdzv_conf}",
        "-m",
        "launch.train",
        *train_args,
    ]


@dataclass
class Agent:
    """One torchrun agent (a node) and its log."""

    name: str
    proc: subprocess.Popen
    log: Path
    started: float  # time.monotonic()


def start_agent(
    name: str,
    out: Path,
    port: int,
    run_id: str,
    train_args: list[str],
    *,
    nproc: int = 2,
    max_restarts: int = 3,
    env: dict[str, str] | None = None,
) -> Agent:
    """Start one node's torchrun agent in its own session (so :func:`launch.jobs.kill_job`
    reaches it and its workers); its output goes to ``out/<name>.log``. The environment gets
    :data:`ELASTIC_ENV` and ``OMP_NUM_THREADS=1``, then ``env``."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{name}.log"
    cmd = agent_command(port, run_id, nproc, train_args, max_restarts=max_restarts)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1", **ELASTIC_ENV, **(env or {})),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Agent(name, proc, log_path, time.monotonic())


def _between_checkpoints(
    out: Path, timeline: Timeline, last: dict[str, Any] | None, interval: int, world_size: int
) -> bool:
    """At ``world_size``, strictly between two checkpoints, after one committed by this worker round."""
    if last is None or last["world_size"] != world_size or last["step"] % interval != interval // 2:
        return False
    first = next(
        r["step"]
        for r in timeline.records
        if r["world_size"] == world_size and r.get("worker_start") == last.get("worker_start")
    )
    return any(
        e["event"] == "checkpoint" and e["step"] % interval == 0 and first <= e["step"] < last["step"]
        for e in read_jsonl(out / "events.jsonl")
    )


def run_elastic(
    out: Path,
    train_args: list[str],
    *,
    interval: int,
    steps: int,
    join_at: int,
    lose_node: bool,
    timeout_s: float,
    memory_root: Path | None = None,
    worker_crash: bool | None = None,
    nproc: int = 2,
) -> tuple[Timeline, list[tuple[str, float]], int | None, dict[str, float]]:
    """Node A alone, node B joins once A reached ``join_at``; with ``lose_node``, B is SIGKILLed
    strictly between two checkpoints after one was committed at world size 4. With
    ``memory_root`` (the memory tier on), each agent is a node of its own (``DISTCKPT_NODE_ID``,
    memory directory ``memory_root/<node>``), a worker of A is SIGKILLed first under the same
    condition (``worker_crash``; ``worker_crash=False`` skips it, ``True`` does it without the
    tier too) and the node loss deletes B's memory directory. ``nproc``: workers per node (the
    world sizes are then ``nproc``, ``2 * nproc``, ``nproc``). Returns the timeline, the triggers,
    node A's agent's exit code (``None``: did not finish) and each trigger's wall time.

    Raises:
        TimeoutError: past ``timeout_s`` (every agent and worker is killed first).
    """
    port, run_id = free_port(), f"distckpt-elastic-{uuid.uuid4().hex[:8]}"
    timeline = Timeline(out / "metrics.jsonl")
    triggers: list[tuple[str, float]] = []
    wall: dict[str, float] = {}
    crash = memory_root is not None if worker_crash is None else worker_crash
    lost = ["node_join"] + (["worker_crash"] if crash else [])  # done before the node loss
    t0 = time.monotonic()
    # A node id per agent; sample ids recorded before each save too (kept_samples(presave=True)).
    nodes = memory_root is not None or crash
    presave = {"LAUNCH_CHAOS_PRESAVE_SAMPLES": "1"}
    env = recovery.node_env("node_a") | presave if nodes else {}
    a = start_agent("node_a", out, port, run_id, train_args, nproc=nproc, env=env)
    b: Agent | None = None
    agents = [a]
    try:
        while a.proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"elastic run still running after {timeout_s:.0f} s; logs in {out}")
            timeline.poll()
            last = timeline.records[-1] if timeline.records else None
            if b is None and last is not None and last["step"] >= join_at:
                print(f"[elastic] step {last['step']}: starting node B's agent", flush=True)
                wall["node_join"] = time.time()
                b = start_agent(
                    "node_b",
                    out,
                    port,
                    run_id,
                    train_args,
                    nproc=nproc,
                    env=recovery.node_env("node_b") | presave if nodes else None,
                )
                agents.append(b)
                triggers.append(("node_join", b.started))
            elif (
                crash
                and b is not None
                and len(triggers) == 1
                and _between_checkpoints(out, timeline, last, interval, 2 * nproc)
            ):
                assert last is not None
                print(f"[elastic] step {last['step']}: SIGKILL one worker of node A", flush=True)
                triggers.append(("worker_crash", time.monotonic()))
                wall["worker_crash"] = recovery.crash_worker(a.proc, local_rank=nproc - 1)
            elif (
                lose_node
                and b is not None
                and len(triggers) == len(lost)
                and last is not None
                and (not crash or last.get("worker_start", 0) > wall["worker_crash"])
                and _between_checkpoints(out, timeline, last, interval, 2 * nproc)
            ):
                print(f"[elastic] step {last['step']}: SIGKILL node B (agent and workers)", flush=True)
                triggers.append(("node_loss", time.monotonic()))
                wall["node_loss"] = recovery.lose_node(b.proc, None if memory_root is None else memory_root / "node_b")
            time.sleep(0.02)
        if b is not None and b.proc.poll() is None:  # node B ends with A (exit barrier), or is killed
            try:
                b.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_job(b.proc)
    except BaseException:
        for agent in agents:
            if agent.proc.poll() is None:
                kill_job(agent.proc)
        raise
    timeline.poll()
    return timeline, triggers, a.proc.returncode, wall


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/elastic", help="output directory (default runs/elastic)")
    p.add_argument("--config", default="launch/configs/ddp.yaml", help="job YAML")
    p.add_argument("--steps", type=int, default=120, help="steps the job reaches (default 120)")
    p.add_argument("--interval", type=int, default=10, help="checkpoint every this many steps (default 10)")
    p.add_argument(
        "--join-at", type=int, default=15, help="start node B's agent once node A completed this step (default 15)"
    )
    p.add_argument("--no-node-loss", action="store_true", help="scale up only")
    p.add_argument(
        "--epoch-steps",
        type=int,
        default=50,
        help="cut the corpus to this many steps per epoch; 0 keeps the config's (default 50)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="section.key=value",
        help="extra override (repeatable), e.g. --set model.d_model=64",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="memory tier on (a snapshot every step, a replica on the other node), a worker crash "
        "before the node loss, a recovery breakdown per event",
    )
    p.add_argument(
        "--memory-root",
        default=None,
        help="the nodes' memory directories go under it (default /dev/shm/distckpt-elastic-<id>, removed at the end)",
    )
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |loss diff| vs the baseline")
    p.add_argument("--timeout-s", type=float, default=300.0, help="timeout of each phase (seconds)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every requirement holds, else 1."""
    args = _parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    n, interval = args.steps, args.interval
    overrides = [
        f"train.steps={n}",
        f"train.warmup_steps={max(1, n // 6)}",
        f"checkpoint.schedule.interval_steps={interval}",
        "train.log_every=10",
        *args.overrides,
    ]
    try:
        cfg = load_job_config(REPO / args.config, overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.epoch_steps:
        overrides.insert(0, f"data.max_bytes={args.epoch_steps * cfg.data.global_batch_size * (cfg.data.seq_len + 1)}")
    base_dir, el_dir = out / "baseline", out / "elastic"
    for path in (base_dir, el_dir):
        shutil.rmtree(path, ignore_errors=True)  # only what an earlier run in --out made
    (out / "summary.json").unlink(missing_ok=True)
    config = str(REPO / args.config)
    memory_root = None
    if args.memory:
        memory_root = Path(args.memory_root or recovery.default_memory_root(f"distckpt-elastic-{uuid.uuid4().hex[:8]}"))
    baseline = Run("baseline", 2, base_dir, base_dir / "checkpoints")
    try:
        print("[elastic] baseline: 2 ranks ...", flush=True)
        launch(baseline, config, overrides, args.timeout_s)
        print(f"[elastic] baseline: exit {baseline.returncode} ({baseline.wall_seconds:.1f} s)", flush=True)
        if baseline.returncode != 0:
            print((baseline.out / "torchrun.log").read_text()[-4000:], file=sys.stderr)
            return 1
        train_args = [
            "--config",
            config,
            *overrides,
            f"train.out={el_dir}",
            f"checkpoint.root={el_dir / 'checkpoints'}",
        ]
        if memory_root is not None:
            train_args += recovery.memory_overrides(memory_root)
        t_el = time.monotonic()
        timeline, triggers, rc, wall = run_elastic(
            el_dir,
            train_args,
            interval=interval,
            steps=n,
            join_at=args.join_at,
            lose_node=not args.no_node_loss,
            timeout_s=args.timeout_s,
            memory_root=memory_root,
        )
        el_seconds = time.monotonic() - t_el
    except (TimeoutError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if memory_root is not None and args.memory_root is None:
            shutil.rmtree(memory_root, ignore_errors=True)  # our own /dev/shm directory
    start = baseline.event("start") or {}
    info = {
        "global_batch_size": cfg.data.global_batch_size,
        "sampler_seed": cfg.data.seed,
        "dataset_len": start.get("dataset_len", 0),
        "steps_per_epoch": start.get("steps_per_epoch", 1),
    }
    summary = analyze(el_dir, timeline, triggers, baseline, info, n, wall=wall if args.memory else None)
    summary["returncode"] = rc
    expect = ["node_join"] + (["worker_crash"] if args.memory else []) + ([] if args.no_node_loss else ["node_loss"])
    reqs = check(summary, n, args.tolerance, expect, memory=args.memory)
    total = time.monotonic() - t_start
    summary.update(
        {
            "requirements": reqs,
            "steps": n,
            "interval_steps": interval,
            "global_batch_size": info["global_batch_size"],
            "steps_per_epoch": info["steps_per_epoch"],
            "baseline_seconds": round(baseline.wall_seconds, 1),
            "elastic_seconds": round(el_seconds, 1),
            "total_seconds": round(total, 1),
            "overrides": overrides,
            "elastic_env": ELASTIC_ENV,
            "rdzv_conf": RDZV_CONF,
        }
    )
    if args.memory:
        summary["memory"] = {"dir": f"{memory_root}/{{node}}", "interval_steps": 1, "replicas": 1}
        stalls = [r["snapshot_stall_s"] for r in timeline.records if "snapshot_stall_s" in r]
        steps_s = [r["step_seconds"] for r in timeline.records]
        summary["snapshot_stall_s_median"] = sorted(stalls)[len(stalls) // 2] if stalls else None
        summary["step_seconds_median"] = sorted(steps_s)[len(steps_s) // 2] if steps_s else None
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print_table(summary)
    print()
    for r in reqs:
        print(f"  [{'ok' if r['ok'] else 'FAIL'}] {r['what']}: {r['value']}")
    ok = all(r["ok"] for r in reqs)
    print(f"\n{'PASS' if ok else 'FAIL'}: total {total:.1f} s; summary in {out / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
