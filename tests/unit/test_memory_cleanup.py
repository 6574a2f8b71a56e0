"""Memory left behind and memory settings that are surely wrong (issue 35, items 5 and 7):
``distckpt memory ls|clean`` on a node's memory directory, and the config checks of ``memory.dir``
and ``save.thread_count``."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from distckpt import CheckpointConfig, CheckpointManager, ConfigError
from distckpt._cli.main import main
from distckpt._memory.cleanup import job_dirs
from distckpt._memory.placement import job_key, node_id
from distckpt._memory.snapfile import snapshot_name
from tests.distributed.trainer import build, optimizer_step, release_workers

OTHER = "job-0123456789abcdef"


def _snapshots(tmp_path, mem, until: int):
    """A manager that snapshotted steps 1..until (the durable interval is 100: memory only)."""
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(
        root=str(tmp_path / "root"), schedule={"interval_steps": 100}, memory={"enabled": True, "dir": str(mem)}
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer, lr_scheduler=scheduler, dataloader=loader)
    it = iter(loader)
    for step in range(1, until + 1):
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
        manager.maybe_save(step)
    manager.memory.wait()
    return manager, loader


def _cli(capsys, *argv: str):
    code = main(["memory", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _age(path, seconds: float) -> None:
    """Make ``path`` and everything in it ``seconds`` old."""
    then = time.time() - seconds
    for name in os.listdir(path):
        os.utime(os.path.join(path, name), (then, then))
    os.utime(path, (then, then))


def test_ls_and_clean_keep_a_live_or_recent_job_and_remove_only_distckpts_files(tmp_path, capsys) -> None:
    mem = tmp_path / "mem"
    manager, loader = _snapshots(tmp_path, mem, until=2)
    job = os.path.basename(manager.memory.dir)
    other, not_a_job = mem / OTHER, mem / "not-a-job"
    other.mkdir()
    (other / snapshot_name(3, 0, 1, "feed")).write_bytes(b"x" * 10)
    (other / "notes.txt").write_text("the operator's")
    not_a_job.mkdir()
    (not_a_job / snapshot_name(3, 0, 1, "feed")).write_bytes(b"not in a job directory")

    code, out, _ = _cli(capsys, "ls", str(mem), "--json")
    listed = {os.path.basename(j["path"]): j for j in json.loads(out)}
    assert code == 0 and sorted(listed) == sorted([OTHER, job])  # the job id is random: either order
    mine = listed[job]
    assert mine["steps"] == [1, 2] and mine["ranks"] == [0] and mine["files"] == 2 and mine["foreign"] == 0
    assert mine["bytes"] >= sum(os.path.getsize(os.path.join(manager.memory.dir, n)) for n in os.listdir(mine["path"]))
    assert mine["pids"] == [os.getpid()]  # the live job holds its slot files open
    assert listed[OTHER]["steps"] == [3] and listed[OTHER]["foreign"] == 1 and listed[OTHER]["pids"] == []
    code, out, _ = _cli(capsys, "ls", str(mem))
    assert code == 0 and out.splitlines()[0].split() == ["JOB", "NODE", "STEPS", "RANKS", "FILES", "SIZE", "STATE"]
    assert f"{job}  {node_id()}" in out and "1..2" in out and f"in use (pid {os.getpid()})" in out

    # a live job is kept whatever its age; then, once dead, while it changed within --older-than
    _age(manager.memory.dir, 7200)
    code, out, _ = _cli(capsys, "clean", str(mem), "--job", job)
    assert code == 0 and f"kept {manager.memory.dir}: in use by process(es) [{os.getpid()}]" in out
    manager.memory.close(free=False)  # the process "dies": its files stay
    code, out, _ = _cli(capsys, "clean", str(mem), "--job", job, "--older-than", "1e9")
    kept = re.search(
        rf"kept {re.escape(manager.memory.dir)}: changed (\d+) s ago, less than --older-than 1e\+09 s", out
    )
    assert code == 0 and kept and 7200 <= int(kept[1]) < 7260, out
    code, out, _ = _cli(capsys, "clean", str(mem), "--dry-run")
    assert f"would remove {manager.memory.dir}: 2 files" in out and len(os.listdir(manager.memory.dir)) == 2
    assert f"kept {other}: changed" in out  # just written

    _age(other, 7200)
    code, out, _ = _cli(capsys, "clean", str(mem))
    assert code == 0 and f"removed {manager.memory.dir}: 2 files" in out
    assert f"kept {other}: distckpt's files removed; the directory kept: 1 file(s) in it not distckpt's" in out
    assert sorted(os.listdir(mem)) == [OTHER, "not-a-job"]
    assert os.listdir(other) == ["notes.txt"] and len(os.listdir(not_a_job)) == 1
    code, out, _ = _cli(capsys, "clean", str(mem), "--job", job)
    assert code == 0 and out.strip() == f"no memory-tier snapshots in {mem} of {job}"
    code, _, err = _cli(capsys, "ls", str(tmp_path / "absent"))
    assert code == 2 and "not found: memory directory" in err
    release_workers(loader)


def test_clean_force_and_every_node_through_the_node_placeholder(tmp_path, capsys) -> None:
    root = str(tmp_path / "root")
    key = job_key(root)
    for node in ("a", "b"):
        (tmp_path / "m[1]" / node / key).mkdir(parents=True)
        (tmp_path / "m[1]" / node / key / snapshot_name(1, 0, 2, "abc")).write_bytes(b"x")
    (tmp_path / "m1" / "a" / key).mkdir(parents=True)  # what a glob of "m[1]" would match: not ours
    template = str(tmp_path / "m[1]" / "{node}")
    assert job_dirs(template, root) == [str(tmp_path / "m[1]" / n / key) for n in ("a", "b")]
    code, out, _ = _cli(capsys, "ls", template, "--json")
    assert code == 0 and [(j["node"], j["steps"]) for j in json.loads(out)] == [("a", [1]), ("b", [1])]
    code, out, _ = _cli(capsys, "clean", template)  # just written: kept
    assert code == 0 and out.count("kept ") == 2
    code, out, _ = _cli(capsys, "clean", template, "--force")
    assert code == 0 and out.count("removed ") == 2
    assert os.listdir(tmp_path / "m[1]" / "a") == os.listdir(tmp_path / "m[1]" / "b") == []
    assert os.listdir(tmp_path / "m1" / "a") == [key]


@pytest.mark.parametrize(
    "memory, save, message",
    [
        ({"dir": "/dev/shm/{nod}"}, {}, "memory.dir='/dev/shm/{nod}': unknown placeholder(s) {nod}; the only one"),
        ({"dir": "/dev/shm/{node}-{rank}"}, {}, "unknown placeholder(s) {rank}"),
        ({"enabled": True, "dir": "{root}/mem"}, {}, "is inside the checkpoint root"),
        ({"enabled": True, "dir": "{root}"}, {}, "is inside the checkpoint root"),
        ({}, {"thread_count": 1000}, "CheckpointConfig.save.thread_count=1000: at most 64"),
    ],
)
def test_surely_wrong_memory_and_thread_settings_are_refused(tmp_path, memory, save, message) -> None:
    root = str(tmp_path / "root")
    if "dir" in memory:
        memory = {**memory, "dir": memory["dir"].replace("{root}", root)}
    with pytest.raises(ConfigError) as e:
        CheckpointConfig(root=root, memory=memory, save=save)
    assert message in str(e.value)


def test_sane_memory_and_thread_settings_are_accepted(tmp_path) -> None:
    root = str(tmp_path / "root")
    config = CheckpointConfig(root=root, memory={"enabled": True, "dir": str(tmp_path / "mem" / "{node}")})
    assert config.memory.dir.endswith("/mem/{node}")
    assert CheckpointConfig(root=root, save={"thread_count": 64}).save.thread_count == 64
    # a disabled tier's directory is never used: only its spelling is checked
    assert CheckpointConfig(root=root, memory={"dir": f"{root}/mem"}).memory.dir == f"{root}/mem"
