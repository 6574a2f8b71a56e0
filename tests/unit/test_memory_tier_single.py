"""The memory tier in one process: the snapshot file format, placement, a real tmpfs too small
(refused at construction) or full later (a snapshot skipped, training goes on), cleanup after a
crash and at close, and another job's files never touched."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from distckpt import CheckpointConfig, CheckpointManager, ConfigError, IncompatibleCheckpointError
from distckpt._errors import CheckpointCorruptError
from distckpt._memory.placement import NodeLayout, assign_replicated, file_system_type, job_key
from distckpt._memory.snapfile import SlotFile, SnapshotHeader, parse_name, read_header, snapshot_name
from tests.distributed.trainer import build, crash, full_params, optimizer_step, release_workers


@pytest.fixture
def tmpfs(tmp_path, request):
    """A real tmpfs (``request.param`` MiB, default 2) at ``tmp_path/shm`` (root only: skipped elsewhere)."""
    where = tmp_path / "shm"
    where.mkdir()
    size = f"size={getattr(request, 'param', 2)}m"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def _manager(tmp_path, mem_dir: Path, **memory):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(
        root=str(tmp_path / "root"),
        schedule={"interval_steps": 3},
        memory={"enabled": True, "dir": str(mem_dir), **memory},
    )
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    return manager, model, optimizer, scheduler, scaler, loader


def _train(manager, model, optimizer, scheduler, scaler, loader, start: int, until: int) -> None:
    it = iter(loader)
    for step in range(start + 1, until + 1):
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
        manager.maybe_save(step)
    manager.memory.wait()


def test_snapshot_file_round_trip_and_corruption(tmp_path) -> None:
    slot = SlotFile(str(tmp_path / "x.partial"))
    slot.reserve(64 + 8)
    slot.tensor(64, 8).view(torch.float32).copy_(torch.tensor([1.5, -2.0]))
    view = slot.view(64, 8)
    from distckpt._memory.snapfile import data_hash

    header = SnapshotHeader(
        "job-1", "abc", 7, 0, 1, "plain", 8, data_hash(view), [["w", "tensor", [0], [2], [2], "torch.float32", 64, 8]]
    )
    view.release()
    final = str(tmp_path / snapshot_name(7, 0, 1, "abc"))
    slot.seal(header, final)
    slot.close(delete=False)
    assert parse_name(os.path.basename(final)) == (7, 0, 1, "abc")
    assert read_header(final, verify=True) == header
    with open(final, "r+b") as f:
        f.seek(66)
        f.write(b"\x00")
    with pytest.raises(CheckpointCorruptError, match="data hash"):
        read_header(final, verify=True)
    assert parse_name("step-1.rank-0-of-1.abc.partial") is None


def test_ring_placement_and_replicated_assignment() -> None:
    layout = NodeLayout(("a", "a", "b", "b", "c"))
    assert [layout.targets(r, 1) for r in range(5)] == [[2], [3], [4], [4], [0]]
    assert layout.sources(4, 1) == [2, 3] and layout.sources(0, 1) == [4]
    assert layout.targets(0, 2) == [2, 4] and NodeLayout(("a", "a")).targets(0, 1) == []
    owners = assign_replicated({"w": 100, "b": 10, "v": 100, "s": 1}, 2)
    assert owners == {"v": 0, "w": 1, "b": 0, "s": 1}  # largest first, to the least loaded rank
    assert job_key("/x/root/") == job_key("/x/root") != job_key("/x/other")


def test_too_small_a_tmpfs_is_refused_at_construction(tmp_path, tmpfs) -> None:
    model, optimizer, *_ = build(0, 1, {"width": 512})  # ~1 MiB of fp32 parameters: 2 x 3 x that needed
    config = CheckpointConfig(root=str(tmp_path / "root"), memory={"enabled": True, "dir": str(tmpfs)})
    with pytest.raises(ConfigError) as e:
        CheckpointManager(config, model=model, optimizer=optimizer)
    assert "needs" in str(e.value) and "MiB free" in str(e.value) and str(tmpfs) in str(e.value)
    assert "memory.dir" in str(e.value)


@pytest.mark.parametrize("tmpfs", [8], indirect=True)
def test_a_full_tmpfs_skips_the_snapshot_and_training_goes_on(tmp_path, tmpfs, caplog) -> None:
    parts = _manager(tmp_path, tmpfs)
    manager = parts[0]
    filler = tmpfs / "filler"  # another process fills the tmpfs after the check
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free)
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        _train(*parts, start=0, until=3)
    assert "memory tier: snapshot of step 1 skipped on rank 0" in caplog.text and "No space left" in caplog.text
    assert "step-000000003" in os.listdir(tmp_path / "root")  # the durable tier went on
    filler.unlink()
    _train(*parts, start=3, until=4)
    names = os.listdir(manager.memory.dir)
    assert [parse_name(n)[0] for n in names if parse_name(n)] == [4]
    manager.close()
    release_workers(parts[5])


def test_a_crashed_runs_snapshots_are_reclaimed_and_another_jobs_kept(tmp_path) -> None:
    mem = tmp_path / "mem"
    parts = _manager(tmp_path, mem)
    _train(*parts, start=0, until=5)
    crashed = parts[0]
    ref = {k: v.clone() for k, v in full_params(parts[1]).items()}
    dead_gen = crashed.memory.gen
    other_job = mem / "job-0123456789abcdef"
    other_job.mkdir()
    (other_job / snapshot_name(9, 0, 1, "feed")).write_bytes(b"another job's")
    foreign = Path(crashed.memory.dir) / "notes.txt"
    foreign.write_text("not distckpt's")
    crashed.memory.wait()
    crash(crashed)  # the process "dies" here: no close(), its files stay
    release_workers(parts[5])

    parts = _manager(tmp_path, mem)
    manager = parts[0]
    state = manager.load()
    assert state.step == 5 and manager.loader.tier == "memory"
    assert all(torch.equal(v, ref[k]) for k, v in full_params(parts[1]).items())
    assert any(dead_gen in n for n in os.listdir(manager.memory.dir))  # kept until a new snapshot completes
    _train(*parts, start=5, until=6)
    gens = {parse_name(n)[3] for n in os.listdir(manager.memory.dir) if parse_name(n)}
    assert gens == {manager.memory.gen}
    manager.close()
    assert sorted(os.listdir(manager.memory.dir)) == ["notes.txt"]  # close freed ours, not the foreign file
    assert os.listdir(other_job) == [snapshot_name(9, 0, 1, "feed")]
    release_workers(parts[5])


def test_another_launchs_snapshots_are_not_restored(tmp_path, monkeypatch) -> None:
    """A new launch on the same root (another torchrun run id) resumes from the durable tier: memory
    left by an earlier launch may belong to a run the user meant to replace."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    parts = _manager(tmp_path, tmp_path / "mem")
    _train(*parts, start=0, until=5)  # durable step 3, memory 5
    parts[0].memory.wait()
    crash(parts[0])  # dies without close()
    release_workers(parts[5])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-2")
    parts = _manager(tmp_path, tmp_path / "mem")
    assert parts[0].load().step == 3 and parts[0].loader.tier == "durable"
    parts[0].close()
    release_workers(parts[5])


def test_the_job_key_is_the_resolved_root(tmp_path, monkeypatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    in_a = job_key("ckpt")
    monkeypatch.chdir(tmp_path / "b")
    assert job_key("ckpt") != in_a  # two jobs with the same relative root never share snapshots
    assert job_key(str(tmp_path / "a" / "ckpt")) == in_a == job_key(f"{tmp_path}/a/./ckpt/")


def test_a_memory_dir_with_glob_characters_keeps_to_itself(tmp_path) -> None:
    mem = tmp_path / "run[1]"
    sibling = tmp_path / "run1" / job_key(str(tmp_path / "root"))  # what the glob run[1] would match
    sibling.mkdir(parents=True)
    foreign = [snapshot_name(1, 0, 1, "abc"), "slot-own-0-0.abc.partial", "my.data.partial"]
    for name in foreign:
        (sibling / name).write_bytes(b"not this job's")
    parts = _manager(tmp_path, mem)
    _train(*parts, start=0, until=4)
    ref = {k: v.clone() for k, v in full_params(parts[1]).items()}
    (Path(parts[0].memory.dir) / "my.data.partial").write_bytes(b"the user's")
    parts[0].memory.wait()
    crash(parts[0])  # the process "dies"
    release_workers(parts[5])
    parts = _manager(tmp_path, mem)
    assert parts[0].load().step == 4 and parts[0].loader.tier == "memory"
    assert all(torch.equal(v, ref[k]) for k, v in full_params(parts[1]).items())
    _train(*parts, start=4, until=5)
    parts[0].close()
    assert sorted(os.listdir(sibling)) == sorted(foreign)
    assert os.listdir(parts[0].memory.dir) == ["my.data.partial"]
    release_workers(parts[5])


def test_a_snapshot_that_does_not_fit_the_live_model_is_refused_not_cast(tmp_path) -> None:
    parts = _manager(tmp_path, tmp_path / "mem")
    _train(*parts, start=0, until=2)  # memory only: the durable interval is 3
    parts[0].memory.wait()
    crash(parts[0])
    release_workers(parts[5])
    model, optimizer, scheduler, scaler, loader = build(0, 1, {"dtype": torch.float64})
    config = CheckpointConfig(
        root=str(tmp_path / "root"),
        memory={"enabled": True, "dir": str(tmp_path / "mem")},
        schedule={"interval_steps": 3},
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer, lr_scheduler=scheduler, dataloader=loader)
    with pytest.raises(IncompatibleCheckpointError) as e:
        manager.load()
    assert "memory://job-" in str(e.value) and "dtype" in str(e.value) and "torch.float32" in str(e.value)
    manager.close()
    release_workers(loader)


def test_a_memory_dir_removed_under_the_job_is_recreated(tmp_path, caplog) -> None:
    import shutil

    parts = _manager(tmp_path, tmp_path / "mem")
    _train(*parts, start=0, until=2)
    shutil.rmtree(parts[0].memory.dir)  # an operator's cleanup script, a tmpfs remount
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        _train(*parts, start=2, until=4)
    assert "was removed while the job ran; recreated" in caplog.text
    assert [parse_name(n)[0] for n in sorted(os.listdir(parts[0].memory.dir)) if parse_name(n)] == [3, 4]
    parts[0].close()
    release_workers(parts[5])


def test_every_snapshot_corrupt_is_said_and_the_durable_tier_serves(tmp_path, caplog) -> None:
    parts = _manager(tmp_path, tmp_path / "mem")
    _train(*parts, start=0, until=5)  # durable step 3, memory 4 and 5
    mem_dir = Path(parts[0].memory.dir)
    crash(parts[0])
    release_workers(parts[5])
    for f in mem_dir.glob("*.snap"):
        with open(f, "r+b") as fh:
            fh.seek(100)
            fh.write(b"\xff\xfe")
    parts = _manager(tmp_path, tmp_path / "mem")
    with caplog.at_level(logging.INFO, logger="distckpt"):
        assert parts[0].load().step == 3 and parts[0].loader.tier == "durable"
    assert "2 corrupt snapshot file(s) left out" in caplog.text
    parts[0].close()
    release_workers(parts[5])


def test_a_crash_looping_job_leaves_one_set_of_slots_and_its_last_snapshots(tmp_path) -> None:
    """Issue 35 item 5 (c): each run that dies before its first snapshot left its (empty) slot
    files; the next run deletes the dead runs' slots at start-up, never their complete snapshots."""
    parts = _manager(tmp_path, tmp_path / "mem")
    _train(*parts, start=0, until=2)  # memory only: the durable interval is 3
    crash(parts[0])  # dies without close()
    release_workers(parts[5])
    for k in range(3):  # three runs that die before their first snapshot
        parts = _manager(tmp_path, tmp_path / "mem")
        if k < 2:
            crash(parts[0])
        release_workers(parts[5])
    mem_dir = parts[0].memory.dir
    gen = parts[0].memory.gen
    slots = sorted(n for n in os.listdir(mem_dir) if n.endswith(".partial"))
    assert slots == [f"slot-own-0-{k}.{gen}.partial" for k in range(2)]  # only the newest run's
    assert [parse_name(n)[0] for n in sorted(os.listdir(mem_dir)) if parse_name(n)] == [1, 2]
    assert parts[0].load().step == 2 and parts[0].loader.tier == "memory"
    parts[0].close()
    assert not os.path.exists(mem_dir)  # close() removes the emptied job directory (item 5 b)
    release_workers(parts[5])


def test_a_memory_dir_not_on_a_tmpfs_is_warned_about(tmp_path, caplog) -> None:
    """Issue 35 item 7: a memory.dir on a disk makes every snapshot a disk write: said at start-up."""
    shm = "/dev/shm"
    if file_system_type(str(tmp_path)) in ("tmpfs", "ramfs") or file_system_type(shm) != "tmpfs":
        pytest.skip("needs tmp_path on a disk and /dev/shm on a tmpfs")
    for where, warned in ((tmp_path / "mem", True), (Path(shm) / f"distckpt-test-{os.getpid()}", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="distckpt"):
            parts = _manager(tmp_path, where)
        said = [r.getMessage() for r in caplog.records if "not a tmpfs or ramfs" in r.getMessage()]
        assert len(said) == int(warned), said
        if warned:
            fs = file_system_type(str(tmp_path))
            assert said[0].startswith(f"memory tier: memory.dir {parts[0].memory.dir} is on a {fs} file system")
        parts[0].close()
        release_workers(parts[5])
        os.rmdir(where)
