"""Save policy across ranks (intervals, skewed clocks, retention) and I/O faults on one rank."""

import errno
import os

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import full_params, make_manager, train_steps

pytestmark = pytest.mark.timeout(240)


def run_with_skewed_clock(rank, world_size, opts):
    from distckpt import CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig
    from tests.distributed.trainer import build

    model, optimizer, *_ = build(rank, world_size, {"wrapper": "ddp"})
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=None, interval_s=7.0),
        retention=RetentionConfig(keep_last=2, keep_every_steps=4),
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    # Fake clocks: rank 1 runs 3x faster and 100 s ahead; only rank 0's clock may decide.
    ticks = {"t": 0.0}
    manager.schedule.clock = lambda: ticks["t"] * (3.0 if rank == 1 else 1.0) + (100.0 if rank == 1 else 0.0)
    manager.schedule.mark_saved()
    saved = []
    for step in range(1, 13):
        # 4 s per step on rank 0: 7 s have passed 2 steps after a save, and the vote carrying rank
        # 0's answer applies at the next step -> a save every 3 steps
        ticks["t"] += 4.0
        if manager.maybe_save(step):
            saved.append(step)
    manager.close()
    return saved


def test_interval_s_decided_by_rank0_despite_skewed_clocks(tmp_path):
    saved = values(run_ranks(run_with_skewed_clock, 2, {"root": str(tmp_path)}))
    assert saved[0] == saved[1] == [3, 6, 9, 12]
    # keep_last=2 keeps 9 and 12; keep_every_steps=4 keeps none of them except... 12 (multiple of 4)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-000000009",
        "step-000000012",
    ]


def interval_steps_and_retention(rank, world_size, opts):
    from distckpt import CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig
    from tests.distributed.trainer import build

    model, optimizer, *_ = build(rank, world_size, {"wrapper": "ddp"})
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=2),
        retention=RetentionConfig(keep_last=2, keep_every_steps=3),
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    saved = [s for s in range(1, 11) if manager.maybe_save(s, last_step=s == 10)]
    assert not manager.maybe_save(10, last_step=True)  # already saved at this step
    manager.close()
    return saved


def test_interval_steps_and_retention(tmp_path):
    saved = values(run_ranks(interval_steps_and_retention, 2, {"root": str(tmp_path)}))
    assert saved[0] == saved[1] == [2, 4, 6, 8, 10]
    # keep_last=2 -> 8, 10; keep_every_steps=3 -> 6 forever; 2 and 4 deleted
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-000000006",
        "step-000000008",
        "step-000000010",
    ]
    assert (tmp_path / "latest").read_text().strip() == "step-000000010"


def io_fault_on_one_rank(rank, world_size, opts):
    from torch.distributed.checkpoint import FileSystemWriter

    from distckpt import CheckpointSaveError

    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    manager.save(2)
    expected = full_params(model)
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    original = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if rank == opts["victim"]:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = failing
    error = None
    try:
        manager.save(4)
    except CheckpointSaveError as e:  # must be catchable as Exception on every rank
        error = (str(e), sorted(e.failures))
    FileSystemWriter.write_data = original
    import torch.distributed as dist

    root = opts["root"]
    dist.barrier()  # list only after every rank handled the failure, before the next save
    after_failure = sorted(n for n in os.listdir(root) if n != ".lock")
    dist.barrier()
    train_steps(model, optimizer, scheduler, scaler, loader, 1)
    manager.save(5)  # training continues and the next save works
    manager.close()
    return {"error": error, "after_failure": after_failure, "expected": expected}


@pytest.mark.parametrize("victim", [0, 1])
def test_io_error_on_one_rank_raises_everywhere(tmp_path, victim):
    out = values(run_ranks(io_fault_on_one_rank, 2, {"root": str(tmp_path), "wrapper": "fsdp2", "victim": victim}))
    for r in out:
        assert r["error"] is not None, "every rank must raise CheckpointSaveError"
        assert "No space left on device" in r["error"][0] and "Nothing was committed" in r["error"][0]
        assert r["after_failure"] == ["latest", "step-000000002"]  # staging removed, previous intact
    listing = sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock")
    assert listing == ["latest", "step-000000002", "step-000000005"]


def slow_disk_on_one_rank(rank, world_size, opts):
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    original = FileSystemWriter.write_data
    release = threading.Event()

    def slow(self, plan, planner):
        if rank == 1:
            # The commit must wait for this rank: nothing may appear before its data is written.
            release.wait(timeout=2.0)
            assert not os.path.exists(os.path.join(opts["root"], "step-000000002"))
        return original(self, plan, planner)

    FileSystemWriter.write_data = slow
    manager.save(2)
    FileSystemWriter.write_data = original
    expected = full_params(model)
    manager.close()
    return expected


def test_slow_disk_on_one_rank_delays_the_commit_without_corruption(tmp_path):
    expected = values(run_ranks(slow_disk_on_one_rank, 2, {"root": str(tmp_path), "wrapper": "ddp"}))[0]
    from tests.distributed.trainer import load_report

    loaded = values(run_ranks(load_report, 2, {"root": str(tmp_path), "wrapper": "ddp"}))[0]
    assert loaded["state"].step == 2
    for k, v in expected.items():
        assert torch.equal(v, loaded["params"][k]), k


def storage_fault(rank, world_size, opts):
    """Save 2, then save 4 through a faulty storage layer on ``opts["victim"]``, then save 5."""
    import contextlib
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystem

    from distckpt import CheckpointSaveError

    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    manager.save(2)
    manager.wait()  # async: step 2 is committed before the storage turns faulty
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    original = FileSystem.create_stream

    class SlowStream:  # a disk taking 2 s per write call (distckpt gathers small records: few calls)
        def __init__(self, raw):
            self.raw = raw

        def write(self, data):
            time.sleep(2.0)
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    @contextlib.contextmanager
    def faulty(self, path, mode):
        if rank == opts["victim"] and "w" in mode:
            if opts["fault"] == "enospc_writing_data" and os.fspath(path).endswith(".distcp"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if opts["fault"] == "slow_disk":
                with original(self, path, mode) as raw:
                    yield SlowStream(raw)
                return
        with original(self, path, mode) as raw:
            yield raw

    FileSystem.create_stream = faulty
    error, t0 = None, time.monotonic()
    try:
        manager.save(4)
        manager.wait()  # async: the background failure surfaces here
    except CheckpointSaveError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    FileSystem.create_stream = original
    dist.barrier()  # list only after every rank handled the failure, before the next save
    after_failure = sorted(n for n in os.listdir(opts["root"]) if n != ".lock")
    dist.barrier()
    train_steps(model, optimizer, scheduler, scaler, loader, 1)
    manager.save(5)  # the process group still works and the next save commits
    manager.close()
    return {"error": error, "after_failure": after_failure, "seconds": seconds}


@pytest.mark.parametrize(
    "fault,async_mode", [("enospc_writing_data", "off"), ("slow_disk", "off"), ("slow_disk", "thread")]
)
def test_storage_fault_on_one_rank_fails_the_save_everywhere(tmp_path, fault, async_mode):
    # write_timeout_s well below timeout_s: the slow rank gives up before the others' wait expires.
    config = {
        "save": {"thread_count": 4},
        "coordination": {"timeout_s": 20.0, "write_timeout_s": 1.5},
        "async_save": {"mode": async_mode},
    }
    out = values(
        run_ranks(
            storage_fault, 2, {"root": str(tmp_path), "wrapper": "ddp", "victim": 1, "fault": fault, "config": config}
        )
    )
    expected_text = "No space left on device" if fault.startswith("enospc") else "write_timeout_s=1.5"
    for r in out:
        assert r["error"] is not None, "every rank must raise CheckpointSaveError"
        assert expected_text in r["error"] and "DCP rank 1: " in r["error"], r["error"]
        assert r["after_failure"] == ["latest", "step-000000002"]  # staging removed, previous intact
        assert r["seconds"] < 15.0  # failed by the write deadline, not by the 20 s group timeout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == [
        "latest",
        "step-000000002",
        "step-000000005",
    ]
