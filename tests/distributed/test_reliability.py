"""Preemption through torchrun, one writer per root, bad configuration."""

import json
import os
import socket
import subprocess
import sys

import pytest

from distckpt import CheckpointConfig, CheckpointLockedError, CheckpointManager, ConfigError, CoordinationConfig
from distckpt._storage.lock import LOCK_NAME
from tests.distributed.trainer import Net

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "distributed", "preempt_job.py")


def torchrun(*args, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def losses(prefix, rank=0):
    with open(f"{prefix}.rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(300)
def test_sigterm_on_one_rank_saves_and_exits_0_then_resumes_exactly(tmp_path):
    base = torchrun("--root", str(tmp_path / "base"), "--out", str(tmp_path / "base"), "--until", "12")
    assert base.returncode == 0, base.stderr[-3000:]
    run = torchrun(
        "--root",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path / "run"),
        "--until",
        "12",
        "--signal-at",
        "4",  # every rank acts on it at the next step boundary (the step vote is read one step later)
        "--victim",
        "1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "preempted (SIGTERM): saved step 5" in run.stderr
    assert [r["step"] for r in losses(tmp_path / "run")] == [1, 2, 3, 4, 5]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000000005"
    resumed = torchrun("--root", str(tmp_path / "ck"), "--out", str(tmp_path / "res"), "--until", "12")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        expected = [r for r in losses(tmp_path / "base", rank) if r["step"] > 5]
        assert losses(tmp_path / "res", rank) == expected  # bitwise equal losses after resume


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_sigterm_to_the_process_group_with_a_plain_stateful_dataloader_saves(tmp_path, num_workers):
    """The manager protects the workers of the plain StatefulDataLoader it is given (issue 24,
    item 7): SIGTERM to rank 1's process group, workers included, still commits the save."""
    run = torchrun(
        "--root",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path / "run"),
        "--until",
        "12",
        "--signal-at",
        "3",
        "--victim",
        "1",
        "--num-workers",
        str(num_workers),
        "--signal-group",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "killed by signal" not in run.stderr and "exited unexpectedly" not in run.stderr, run.stderr[-3000:]
    # signalled at step 3: every rank saves at the next boundary (the step vote is read one step later)
    assert "preempted (SIGTERM): saved step 4" in run.stderr
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000000004"
    assert [r["step"] for r in losses(tmp_path / "run", 1)] == [1, 2, 3, 4]


def write_lock(root, host, pid):
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "job_id": "SLURM_JOB_ID=7"}))


def test_second_writer_gets_locked_error_naming_the_holder(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, socket.gethostname(), other.pid)
        with pytest.raises(CheckpointLockedError) as err:
            CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=Net(), optimizer=None)
        assert f"pid={other.pid}" in str(err.value) and "SLURM_JOB_ID=7" in str(err.value)
    finally:
        other.kill()
        other.wait()
    # the holder is dead now: a stale lock on this host is taken over with a warning
    manager = CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=Net(), optimizer=None)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    manager.close()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_another_host_is_respected(tmp_path):
    write_lock(tmp_path, "some-other-host", 1)
    with pytest.raises(CheckpointLockedError, match="host=some-other-host"):
        CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=Net(), optimizer=None)
    assert CheckpointManager(
        CheckpointConfig(root=str(tmp_path), coordination=CoordinationConfig(lock=False)), model=Net(), optimizer=None
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"schedule": {"interval_steps": -5}}, "schedule.interval_steps"),
        ({"schedule": {"interval_s": -1.0}}, "schedule.interval_s"),
        ({"async_save": {"mode": "thread"}, "retention": {"keep_last": 1}}, "retention.keep_last"),
        ({"async_save": {"mode": "fork"}}, "async_save.mode"),
        ({"async_save": {"background_staging": True}}, "async_save.background_staging"),
    ],
)
def test_bad_configuration_fails_before_training(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(root="/tmp/x", **kwargs)
