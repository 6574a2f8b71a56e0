"""The root lock across restarts and hosts: same scheduler job takes over on any host, another
job's lock expires by lease, a live lease is refused. Another host is simulated by the host name
recorded in the lock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from distckpt import CheckpointConfig, CheckpointLockedError, CheckpointManager, CoordinationConfig
from distckpt._errors import CheckpointSaveError, StorageError
from distckpt._storage.lock import LOCK_NAME, RootLock, job_id
from tests.distributed.trainer import Net


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch):
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID"):
        monkeypatch.delenv(var, raising=False)


def _write(root, host="node-b", pid=4242, job="TORCHELASTIC_RUN_ID=job-1", renewed_ago=1.0, lease_s=60.0):
    root.mkdir(parents=True, exist_ok=True)
    record = {"host": host, "pid": pid, "job_id": job, "since": time.time() - 3600}
    if renewed_ago is not None:
        record.update(renewed=time.time() - renewed_ago, lease_s=lease_s)
    (root / LOCK_NAME).write_text(json.dumps(record))


def _holder(root) -> dict:
    return json.loads((root / LOCK_NAME).read_text())


def test_same_job_takes_over_its_lock_from_another_host(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    _write(tmp_path, host="node-b", renewed_ago=1.0)  # a live lease: only the job id lets us in
    lock = RootLock(tmp_path)
    lock.acquire()
    assert _holder(tmp_path)["host"] == socket.gethostname() and _holder(tmp_path)["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_same_job_respects_a_live_process_on_this_host(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write(tmp_path, host=socket.gethostname(), pid=other.pid, job="SLURM_JOB_ID=77")
        with pytest.raises(CheckpointLockedError, match=f"pid={other.pid}"):
            RootLock(tmp_path).acquire()
    finally:
        other.kill()
        other.wait()


def test_torchrun_default_run_id_is_no_job(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert job_id() == ""
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    assert job_id() == "SLURM_JOB_ID=5"


def test_another_jobs_expired_lease_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    _write(tmp_path, job="TORCHELASTIC_RUN_ID=job-1", renewed_ago=120.0, lease_s=60.0)
    lock = RootLock(tmp_path, lease_s=60.0)
    lock.acquire()
    assert _holder(tmp_path)["job_id"] == "TORCHELASTIC_RUN_ID=job-2"
    lock.release()


@pytest.mark.parametrize(
    "renewed_ago, holder_lease",
    [(10.0, 60.0), (120.0, 600.0), (None, None)],
    ids=["live", "holder_lease_longer", "never_renews"],
)
def test_another_jobs_live_lease_is_refused(tmp_path, monkeypatch, renewed_ago, holder_lease):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    _write(tmp_path, job="TORCHELASTIC_RUN_ID=job-1", renewed_ago=renewed_ago, lease_s=holder_lease)
    with pytest.raises(CheckpointLockedError, match="host=node-b pid=4242 job=TORCHELASTIC_RUN_ID=job-1"):
        RootLock(tmp_path, lease_s=60.0).acquire()
    assert _holder(tmp_path)["host"] == "node-b"  # untouched


def test_rank0_renews_the_lease_while_held(tmp_path):
    manager = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), coordination=CoordinationConfig(lock_lease_s=0.3)),
        model=Net(),
        optimizer=None,
    )
    try:
        first = _holder(tmp_path)["renewed"]
        deadline = time.monotonic() + 10
        while _holder(tmp_path)["renewed"] == first:
            assert time.monotonic() < deadline, "lease not renewed"
            time.sleep(0.05)
        assert _holder(tmp_path)["lease_s"] == 0.3 and _holder(tmp_path)["pid"] == os.getpid()
    finally:
        manager.close()
    assert not (tmp_path / LOCK_NAME).exists()
    assert not list(tmp_path.glob(".lock*"))  # no renewal temp file left


def test_manager_takes_over_an_expired_lease_of_another_host(tmp_path):
    _write(tmp_path, job="SLURM_JOB_ID=9", renewed_ago=1000.0, lease_s=60.0)
    with pytest.raises(CheckpointLockedError, match="lease renewed"):
        CheckpointManager(
            CheckpointConfig(root=str(tmp_path), coordination=CoordinationConfig(lock_lease_s=2000.0)),
            model=Net(),
            optimizer=None,
        )
    manager = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), coordination=CoordinationConfig(lock_lease_s=60.0)),
        model=Net(),
        optimizer=None,
    )
    assert _holder(tmp_path)["pid"] == os.getpid()
    manager.close()


def test_failed_lock_release_does_not_mask_the_error_leaving_the_with_block(tmp_path, caplog):
    def unreachable(*_):
        raise StorageError("S3 GET s3://b/r/.lock failed (server gone)")

    cfg = CheckpointConfig(root=str(tmp_path))
    with pytest.raises(CheckpointSaveError, match="save of step-5 failed"):
        with CheckpointManager(cfg, model=Net(), optimizer=None) as manager:
            manager.lock.file.read = unreachable  # the storage died mid-run
            raise CheckpointSaveError("save of step-5 failed")
    assert any(
        f"checkpoint lock of root {tmp_path}" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records
    )
    manager = CheckpointManager(cfg, model=Net(), optimizer=None)  # this process's stale lock: taken over
    manager.lock.file.read = unreachable
    with pytest.raises(StorageError, match="server gone"):  # a plain close still reports it
        manager.close()


def test_a_second_manager_on_a_root_this_process_holds_open_is_refused(tmp_path):
    cfg = CheckpointConfig(root=str(tmp_path))
    first = CheckpointManager(cfg, model=Net(), optimizer=None)
    try:
        with pytest.raises(CheckpointLockedError, match="still open") as err:
            CheckpointManager(cfg, model=Net(), optimizer=None)
        assert str(tmp_path) in str(err.value) and "close" in str(err.value) and "one manager" in str(err.value)
        assert first.lock is not None and first.lock.held and _holder(tmp_path)["pid"] == os.getpid()
        first.save(1)  # still the only writer, still locked
        assert (tmp_path / LOCK_NAME).exists()
    finally:
        first.close()
    assert not (tmp_path / LOCK_NAME).exists()
    CheckpointManager(cfg, model=Net(), optimizer=None).close()  # closed: the root is free again


def test_the_lock_of_an_unclosed_manager_that_was_collected_is_taken_over(tmp_path, caplog):
    cfg = CheckpointConfig(root=str(tmp_path))
    CheckpointManager(cfg, model=Net(), optimizer=None)  # never closed, dropped at once
    assert (tmp_path / LOCK_NAME).exists()
    manager = CheckpointManager(cfg, model=Net(), optimizer=None)  # its garbage is collected first
    assert any("no longer open" in r.getMessage() for r in caplog.records)
    assert manager.lock is not None and manager.lock.held and _holder(tmp_path)["pid"] == os.getpid()
    manager.close()
    assert not (tmp_path / LOCK_NAME).exists()
