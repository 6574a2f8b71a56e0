"""Run a function on N ranks (CPU/gloo, or one GPU per rank on NCCL) in fresh processes, with a
hard timeout.

Each rank's return value (or traceback) is written to a file before process-group teardown,
so a rank that aborts inside gloo teardown cannot hide a result; the parent asserts on values.

gloo ranks are forked from a warm zygote (multiprocessing's ``forkserver``, started once per
session with torch, torch.distributed, distckpt and the test trainer imported): a rank is still
a new process per call (nothing a test patches, seeds or registers outlives it; a SIGKILL kills
one rank), but it starts in milliseconds instead of the seconds a spawned interpreter spends
importing torch. Each rank gets the caller's current ``os.environ``, working directory and
stdout/stderr (pytest's capture) at the call, as a spawned one would. ``backend="nccl"`` and
``fresh=True`` spawn a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable

import torch

# Imported once by the zygote; every forked rank starts with them loaded. A module missing here
# is imported by each rank as it unpickles its function (as under spawn), only slower.
PRELOAD = [
    "__main__",  # the parent's main script, as spawn would import it in each child
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "torch.nn.parallel",
    "torch._dynamo",
    "torchdata.stateful_dataloader",
    "distckpt",
    "distckpt._storage.s3",
    "boto3",
    "tests.distributed.harness",
    "tests.distributed.trainer",
    "launch.train",
]


def _zygote() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server (re)starts; the same list each time
    return ctx


class _Stdio:
    """Pickles as the caller's fds 1 and 2 (passed to the child over the start pipe or socket)."""

    def __reduce__(self):
        return (_Stdio._received, (reduction.DupFd(1), reduction.DupFd(2)))

    @staticmethod
    def _received(out, err) -> tuple[int, int]:
        return out.detach(), err.detach()


def _entry(
    fn: Callable,
    rank: int,
    world_size: int,
    init_file: str,
    out_dir: str,
    args: tuple,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stdio: tuple[int, int] | None = None,
) -> None:
    if stdio is not None:  # the caller's stdout/stderr now, not the zygote's from its start
        for fd, target in zip(stdio, (1, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
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
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, device_id=device_id
        )
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "type": type(e).__name__,
            "traceback": traceback.format_exc(),
        }
    # Written whole or not at all: a rank killed mid-write (expect_death) leaves no half file.
    final = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(result, final + ".tmp")
    os.replace(final + ".tmp", final)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    expect_death: bool = False,
    backend: str = "gloo",
    fresh: bool = False,
    keep_survivors: bool = False,
) -> list[dict[str, Any] | None]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return per-rank results.

    ``backend="nccl"`` puts rank ``r`` on ``cuda:r`` (the caller checks there are enough GPUs).
    gloo ranks are forked from the session's zygote; ``fresh=True`` spawns new interpreters
    instead (for a test about process start-up itself).

    Each result is ``{"ok": True, "value": ...}`` or ``{"ok": False, "error", "type", "traceback"}``.
    With ``expect_death``, the first rank killed by a signal ends the run: the others are
    killed too (they would wait in a collective) and dead ranks' results are ``None``; with
    ``keep_survivors`` as well, the others run on to their own end (a test of what they do).
    Raises ``TimeoutError`` (after killing the ranks) if any rank runs past ``timeout_s``.
    """
    spawn = fresh or backend == "nccl"
    ctx = mp.get_context("spawn") if spawn else _zygote()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        extra = {} if spawn else {"env": dict(os.environ), "cwd": os.getcwd(), "stdio": _Stdio()}
        procs = [
            ctx.Process(
                target=_entry, args=(fn, r, world_size, init_file, tmp, args, backend), kwargs=extra, daemon=False
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            died = False
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout_s} s")
                if (
                    expect_death
                    and any(p.exitcode is not None and p.exitcode < 0 for p in procs)
                    and not keep_survivors
                ):
                    died = True
                    for p in procs:
                        p.kill()
                procs[0].join(0.05)
        finally:  # a timeout, a failed start or ^C: no rank outlives the call
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
                    p.join(10)
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
