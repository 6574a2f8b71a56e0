"""Run a function on N ranks (CPU/gloo, or one GPU per rank on NCCL) in fresh spawned
processes, with a hard timeout.

Each rank's return value (or traceback) is written to a file before process-group teardown,
so a rank that aborts inside gloo teardown cannot hide a result; the parent asserts on values.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable

import torch


def _entry(fn: Callable, rank: int, world_size: int, init_file: str, out_dir: str, args: tuple,
           backend: str = "gloo") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        device_id = None
        if backend == "nccl":
            # Deterministic cuBLAS needs its workspace size fixed before the first cuBLAS call.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            device_id = torch.device("cuda", rank)  # one GPU per rank: NCCL refuses two on one GPU
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                device_id=device_id)
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "type": type(e).__name__,
                  "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              expect_death: bool = False, backend: str = "gloo") -> list[dict[str, Any] | None]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return per-rank results.

    ``backend="nccl"`` puts rank ``r`` on ``cuda:r`` (the caller checks there are enough GPUs).

    Each result is ``{"ok": True, "value": ...}`` or ``{"ok": False, "error", "type", "traceback"}``.
    With ``expect_death``, the first rank killed by a signal ends the run: the others are
    killed too (they would wait in a collective) and dead ranks' results are ``None``.
    Raises ``TimeoutError`` (after killing the ranks) if any rank runs past ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_file, tmp, args, backend),
                             daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout_s
        died = False
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise TimeoutError(f"ranks still running after {timeout_s} s")
            if expect_death and any(p.exitcode is not None and p.exitcode < 0 for p in procs):
                died = True
                for p in procs:
                    p.kill()
            procs[0].join(0.05)
        for p in procs:
            p.join()
        died = died or any(p.exitcode is not None and p.exitcode < 0 for p in procs)
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                if expect_death and died:
                    results.append(None)
                    continue
                raise RuntimeError(f"rank {r} exited with {procs[r].exitcode} before reporting")
            results.append(torch.load(path, weights_only=False))
        if expect_death and not died:
            raise AssertionError("expected a rank to be killed, but all exited normally")
        return results


def values(results: list[dict[str, Any]]) -> list[Any]:
    """Per-rank values; fails with every rank's traceback if any rank raised."""
    bad = [r for r in results if not r["ok"]]
    if bad:
        raise AssertionError("\n\n".join(r["traceback"] for r in bad))
    return [r["value"] for r in results]
