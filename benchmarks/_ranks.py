"""Run a benchmark function on a fresh set of gloo ranks, with a hard timeout.

Shared by ``bench_save`` and ``bench_load``. Each rank is a process from a forkserver that has
torch (and the named modules) imported, so a rank set starts in well under a second; ranks meet
through a ``file://`` rendezvous in a private temporary directory (no ports to collide), write
their result as JSON, and the parent kills the whole tree past the deadline.
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from typing import Any

__all__ = ["BenchError", "run_ranks"]


class BenchError(RuntimeError):
    """A rank set failed or timed out; the message has each failing rank's error or log tail."""


_CONTEXTS: dict[tuple[str, ...], Any] = {}


def _mp_context(preload: tuple[str, ...]):
    if preload not in _CONTEXTS:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _CONTEXTS[preload] = ctx
    return _CONTEXTS[preload]


def _rank_entry(fn_ref: str, rank: int, world_size: int, init_file: str, out_dir: str, spec: dict[str, Any]) -> None:
    # This rank's (and DCP's checkpoint daemon's) stdout/stderr go to a log the parent reads
    # on failure: DCP's daemon logs every request at INFO.
    log_fd = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        module, name = fn_ref.split(":")
        fn = getattr(importlib.import_module(module), name)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=spec["timeout_s"]),
        )
        result = {"ok": True, "value": fn(rank, world_size, spec)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    try:
        dist.barrier()  # gloo teardown has aborted a rank here: the result is already written
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass


def _kill_tree(pid: int) -> None:
    try:
        import psutil

        proc = psutil.Process(pid)
        for p in proc.children(recursive=True) + [proc]:
            try:
                p.kill()
            except psutil.Error:
                pass
    except ImportError:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    except Exception:  # noqa: BLE001 - already gone
        pass


def _tail(path: str, n_bytes: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def run_ranks(
    fn_ref: str,
    world_size: int,
    spec: dict[str, Any],
    *,
    timeout_s: float,
    preload: tuple[str, ...] = ("torch", "torch.distributed"),
    label: str = "",
) -> list[Any]:
    """Run ``fn(rank, world_size, spec)`` on ``world_size`` fresh gloo ranks.

    Args:
        fn_ref: ``"module:function"``, importable in a fresh process; returns JSON-able values.
        spec: passed to every rank, with ``timeout_s`` added (the process group's timeout).
        timeout_s: wall-clock limit for the whole rank set (seconds); past it every rank's
            process tree is killed.
        preload: modules the forkserver imports once, before forking ranks.
        label: names the run in errors.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        BenchError: a rank raised, died before reporting, or the deadline passed.
    """
    ctx = _mp_context(tuple(preload))
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        spec = dict(spec, timeout_s=timeout_s)
        procs = [
            ctx.Process(target=_rank_entry, args=(fn_ref, r, world_size, init_file, tmp, spec))
            for r in range(world_size)
        ]
        deadline = time.monotonic() + timeout_s
        timed_out = False
        reported_at = None
        try:
            for p in procs:  # inside the try: an interrupt while starting still kills those started
                p.start()
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    break
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(2.0)  # let the others report, then stop waiting
                    break
                if all(os.path.exists(os.path.join(tmp, f"rank{r}.json")) for r in range(world_size)):
                    reported_at = reported_at or now
                    if now - reported_at > 30.0:  # every rank reported; teardown hangs
                        break
                procs[0].join(0.05)
        finally:
            started = [p for p in procs if p.pid is not None]
            for p in started:
                if p.is_alive():
                    _kill_tree(p.pid)
            for p in started:
                p.join(10)
        values, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                errors.append(
                    f"rank {r} exited with {p.exitcode} before reporting; log tail:\n"
                    + _tail(os.path.join(tmp, f"rank{r}.log"))
                )
                continue
            with open(path) as f:
                result = json.load(f)
            if result["ok"]:
                values.append(result["value"])
            else:
                errors.append(result["error"] + "\n" + result["traceback"])
        if timed_out:
            errors.insert(0, f"ranks still running after {timeout_s:.0f} s (killed)")
        if errors:
            raise BenchError(f"{label or fn_ref} world_size={world_size}: " + "\n".join(errors))
        return values
