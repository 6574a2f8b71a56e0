"""Async save: staged copies, background commit, errors on every rank, no leaks."""

import errno
import os
import signal

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import build, full_optim, full_params, load_report, train_steps

pytestmark = pytest.mark.timeout(300)


def async_manager(rank, world_size, opts):
    from distckpt import AsyncSaveConfig, CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig

    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=None),
        async_save=AsyncSaveConfig(mode=opts["mode"], background_staging=opts.get("background_staging", False)),
        retention=RetentionConfig(keep_last=opts.get("keep_last", 3)),
    )
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    return manager, model, optimizer, scheduler, scaler, loader


def save_async_keep_training(rank, world_size, opts):
    manager, model, optimizer, scheduler, scaler, loader = async_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 1)
    manager.save(1)  # stages through DCP's DefaultStager; the save at step 3 reuses its copy
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    import copy

    expected = copy.deepcopy({"params": full_params(model), "optim": full_optim(model, optimizer)})
    manager.save(3)
    # Keep mutating the parameters while the write runs in the background.
    manager.wait_staged()
    train_steps(model, optimizer, scheduler, scaler, loader, 4)
    manager.wait()
    expected["reused_saves"] = manager.async_writer.stager.reused_saves
    manager.close()
    return expected


@pytest.mark.parametrize("mode,background_staging", [("thread", False), ("thread", True), ("process", False)])
def test_async_checkpoint_equals_state_at_save_call(tmp_path, mode, background_staging):
    check_async_equals_state_at_save(
        tmp_path, 2, {"wrapper": "fsdp2", "mode": mode, "background_staging": background_staging}
    )


def check_async_equals_state_at_save(
    tmp_path, world_size: int, opts: dict, *, backend: str = "gloo", timeout_s: float = 120.0
) -> dict:
    """Async saves at steps 1 and 3 (the second reusing the first's staged copy) while training
    mutates the parameters (4 more steps before the write ends); the checkpoint loaded in fresh
    processes equals the state at the second ``save()`` call, bitwise. Returns rank 0's loaded
    report."""
    opts = {**opts, "root": str(tmp_path)}
    expected = values(run_ranks(save_async_keep_training, world_size, opts, backend=backend, timeout_s=timeout_s))[0]
    load_opts = {k: v for k, v in opts.items() if k not in ("mode", "background_staging")}
    loaded = values(run_ranks(load_report, world_size, load_opts, backend=backend, timeout_s=timeout_s))[0]
    assert loaded["state"].step == 3
    assert expected["reused_saves"] == 1  # step 3 was staged into step 1's buffers
    for k, v in expected["params"].items():
        assert torch.equal(v, loaded["params"][k]), k
    for fqn, entry in expected["optim"]["state"].items():
        for name, v in entry.items():
            assert torch.equal(v, loaded["optim"]["state"][fqn][name]), (fqn, name)
    return loaded


def async_io_fault(rank, world_size, opts):
    from torch.distributed.checkpoint import FileSystemWriter

    from distckpt import CheckpointSaveError

    manager, model, optimizer, scheduler, scaler, loader = async_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 1)
    manager.save(1)
    manager.wait()
    original = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if rank == opts["victim"]:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = failing
    train_steps(model, optimizer, scheduler, scaler, loader, 1)
    manager.save(2)  # returns: the failure happens in the background
    manager.async_writer.wait_staged()
    assert manager._inflight.done(timeout_s=120)  # let the background write fail before un-patching
    FileSystemWriter.write_data = original
    train_steps(model, optimizer, scheduler, scaler, loader, 1)
    error = None
    try:
        manager.save(3)  # the next manager call surfaces the background failure
    except CheckpointSaveError as e:
        error = str(e)
    import torch.distributed as dist

    dist.barrier()  # every rank has handled the failure ...
    listing = sorted(n for n in os.listdir(opts["root"]) if n != ".lock")
    dist.barrier()  # ... and listed, before any rank starts the next save
    manager.save(3)
    manager.close()
    return {"error": error, "listing": listing}


@pytest.mark.parametrize("victim", [0, 1])
def test_async_io_failure_raises_on_every_rank(tmp_path, victim):
    out = values(
        run_ranks(async_io_fault, 2, {"root": str(tmp_path), "wrapper": "ddp", "mode": "thread", "victim": victim})
    )
    for r in out:
        assert r["error"] is not None and "Input/output error" in r["error"] and f"rank {victim}" in r["error"]
        assert r["listing"] == ["latest", "step-000000001"]
    listing = sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock")
    assert listing == ["latest", "step-000000001", "step-000000003"]


def async_then_die(rank, world_size, opts):
    from torch.distributed.checkpoint import FileSystemWriter

    manager, model, optimizer, scheduler, scaler, loader = async_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    manager.save(2)
    manager.wait()
    if rank == 0:
        torch.save(full_params(model), opts["expected"])
    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        os.kill(os.getpid(), signal.SIGKILL)  # the whole rank dies during the background write
        return future

    FileSystemWriter.write_data = write_then_die
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    manager.save(4)
    train_steps(model, optimizer, scheduler, scaler, loader, 50)
    manager.wait()
    return "survived"


def test_sigkill_during_background_write(tmp_path):
    root = tmp_path / "ckpt"
    opts = {"root": str(root), "wrapper": "ddp", "mode": "thread", "expected": str(tmp_path / "e.pt")}
    results = run_ranks(async_then_die, 2, opts, expect_death=True)
    assert None in results
    assert (root / "latest").read_text().strip() == "step-000000002"
    assert not (root / "step-000000004").exists()
    loaded = values(run_ranks(load_report, 2, {"root": str(root), "wrapper": "ddp"}))[0]
    assert loaded["state"].step == 2
    for k, v in torch.load(tmp_path / "e.pt").items():
        assert torch.equal(v, loaded["params"][k]), k


def back_to_back(rank, world_size, opts):
    import psutil
    import torch.distributed as dist

    manager, model, optimizer, scheduler, scaler, loader = async_manager(rank, world_size, opts)
    import ctypes
    import gc

    def settled_rss():
        # Drain, then return freed heap to the OS, so RSS shows what is still referenced.
        manager.wait()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return psutil.Process().memory_info().rss

    rss = {}
    for step in range(1, 21):
        train_steps(model, optimizer, scheduler, scaler, loader, 1)
        dist.barrier()  # the loop's own collectives must not deadlock with the background commit
        manager.save(step)
        if step in (2, 10, 20):
            rss[step] = settled_rss()
    manager.close()
    # This rank's share of the state (parameters and AdamW's two moments): what each save stages.
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    rss["state_bytes"] = 3 * sum(t.numel() * t.element_size() for t in local)
    return rss


def test_twenty_back_to_back_async_saves(tmp_path):
    rss = values(
        run_ranks(
            back_to_back, 2, {"root": str(tmp_path), "wrapper": "fsdp2", "mode": "thread", "width": 2048}, timeout_s=240
        )
    )
    for per_rank in rss:
        # Staging is reused: the last ten saves add less than two stagings' worth (a copy kept per
        # save would add ten), whatever the allocator's noise around the first saves.
        assert per_rank[20] - per_rank[10] < 2 * per_rank["state_bytes"], per_rank
        assert per_rank[20] <= per_rank[2] * 1.25, per_rank
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert names == ["step-000000018", "step-000000019", "step-000000020"]
