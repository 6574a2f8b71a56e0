"""One rank of ``bench_scale``: every phase at one world size W in one rank set (public API only,
plus ``manager.loader.tier`` and ``manager.memory.last_stall_s``, the supported memory-tier
read-outs, and ``manager.memory.wait()`` so the "crash" comes after the last snapshot's
replication round, as the memory tier's tests do).

Phases, in order (each preceded by a barrier; "max" is the slowest rank):

1. ``plain``: ``--reps`` timed calls each of ``dist.barrier``, ``dist.all_reduce`` of two int32
   (the step vote's size) and ``dist.all_gather_object`` of a small dict, on the default gloo
   group; per rank the median.
2. ``step_<variant>``: a manager whose schedule has nothing due in the run; ``--steps`` steps, each
   a ``time.sleep(step_s)`` standing for the GPU's compute (the CPU is idle while a GPU step
   runs), then ``maybe_save(step)`` timed alone; per rank the median over steps after the first
   3. Variants: ``default`` (``interval_steps: 1000``, preemption on, the default),
   ``auto`` (``interval_steps: auto``), ``no_vote`` (preemption off: nothing to agree).
3. ``save``: ``--saves`` blocking ``manager.save()`` of the tiny state (max over ranks, median);
   ``io``: the same W ranks each write and fsync one file of its share of the bytes at once
   (max over ranks, median), the I/O a save cannot avoid; coordination = save - io.
4. ``load``: a new manager's ``load()`` of the newest checkpoint (max over ranks).
5. memory tier (``DISTCKPT_NODE_ID`` = ``node<rank // 4>``, one directory per node, one replica):
   ``construct``: ``--constructs`` managers with memory on and as many off, alternating (median of
   each; tier start-up = the difference), ``stall`` =
   ``manager.memory.last_stall_s`` per step (median), then the job "crashes" (the ``with`` block
   left by an exception keeps the snapshots) and a new manager's ``load()`` is the restore
   (``manager.loader.tier`` must say ``memory``).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from typing import Any

__all__ = ["rank_main"]

RANKS_PER_NODE = 4
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"schedule": {"interval_steps": 1000}},
    "auto": {"schedule": {"interval_steps": "auto"}},
    "no_vote": {"schedule": {"interval_steps": 1000}, "preemption": {"enabled": False}},
}


class _Crash(Exception):
    """Raised to leave a manager's ``with`` block as a crashed job would (snapshots kept)."""


def _build() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _config(root: str, **sections: Any) -> Any:
    from distckpt import CheckpointConfig

    sections.setdefault("retention", {"keep_last": None})
    return CheckpointConfig(root=root, **sections)


def _median_calls(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _plain(reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    flags = torch.zeros(2, dtype=torch.int32)
    out: list[Any] = [None] * dist.get_world_size()
    obj = {"rank": dist.get_rank(), "error": None, "step": 1000}
    dist.barrier()
    return {
        "barrier_s": _median_calls(dist.barrier, reps),
        "all_reduce_s": _median_calls(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX), reps),
        "all_gather_object_s": _median_calls(lambda: dist.all_gather_object(out, obj), reps),
    }


def _steps(manager: Any, spec: dict[str, Any], first: int) -> float:
    import torch.distributed as dist

    times = []
    dist.barrier()
    for step in range(first, first + spec["steps"]):
        time.sleep(spec["step_s"])  # the GPU computing the step
        t0 = time.perf_counter()
        manager.maybe_save(step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def _timed_barrier(fn: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def _io(path: str, nbytes: int) -> float:
    def write() -> None:
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
            f.flush()
            os.fsync(f.fileno())

    seconds, _ = _timed_barrier(write)
    os.remove(path)
    return seconds


def rank_main(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """All phases at this world size; returns this rank's seconds per measurement."""
    from distckpt import CheckpointManager

    warnings.filterwarnings("ignore")
    logging.getLogger("distckpt").setLevel(logging.ERROR)
    os.environ["DISTCKPT_NODE_ID"] = f"node{rank // RANKS_PER_NODE}"
    base = spec["dir"]
    out: dict[str, Any] = {"plain": _plain(spec["reps"])}
    model, opt = _build()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3

    # step with nothing due, per variant; the default manager then saves and a new one loads
    root = f"{base}/durable"
    for i, (name, sections) in enumerate(VARIANTS.items()):
        with CheckpointManager(_config(root, **sections), model=model, optimizer=opt) as manager:
            out[f"step_{name}_s"] = _steps(manager, spec, first=1 + i * 100)
            if name == "default":
                saves, ios = [], []
                for k in range(spec["saves"]):
                    saves.append(_timed_barrier(lambda k=k: manager.save(5000 + k))[0])
                    ios.append(_io(f"{base}/io-{rank}.bin", state_bytes // world_size + 1))
                out["save_s"], out["io_s"] = statistics.median(saves), statistics.median(ios)
    with CheckpointManager(_config(root), model=model, optimizer=opt) as manager:
        out["load_s"], state = _timed_barrier(manager.load)
        assert state is not None and state.step == 5000 + spec["saves"] - 1, state

    # memory tier: start-up, snapshot stall, crash, restore
    mem_root = f"{base}/memroot"
    memory = {"enabled": True, "dir": f"{base}/mem/{{node}}", "replicas": 1}
    off = _config(mem_root, schedule={"interval_steps": None})
    on = _config(mem_root, schedule={"interval_steps": None}, memory=memory)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for k in range(2 * spec["constructs"]):  # alternating, so drift of the load hits both alike
        kind = ("off", "on")[k % 2]
        seconds, manager = _timed_barrier(
            lambda kind=kind: CheckpointManager(off if kind == "off" else on, model=model, optimizer=opt)
        )
        times[kind].append(seconds)
        if k < 2 * spec["constructs"] - 1:
            manager.close()
    out["construct_off_s"], out["construct_on_s"] = (statistics.median(times[k]) for k in ("off", "on"))
    try:
        with manager:
            tier = manager.memory
            assert tier is not None, "memory.enabled: the manager has a memory tier"
            stalls = []
            for step in range(1, spec["memory_steps"] + 1):
                time.sleep(spec["step_s"])
                manager.maybe_save(step)
                stalls.append(tier.last_stall_s)
            out["stall_s"] = statistics.median(stalls[1:])
            tier.wait()
            _timed_barrier(lambda: None)
            raise _Crash
    except _Crash:
        pass
    out["construct_restart_s"], manager = _timed_barrier(lambda: CheckpointManager(on, model=model, optimizer=opt))
    with manager:
        out["restore_s"], state = _timed_barrier(manager.load)
        out["restore_tier"] = manager.loader.tier
        assert state is not None and state.step == spec["memory_steps"], state
    return out
