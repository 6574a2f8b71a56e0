"""Faults against the real S3 server: injected PUT/GET failures on one rank, throttling (503
SlowDown) retried with backoff, the server going away mid-save."""

from __future__ import annotations

import os

import pytest
import torch

from distckpt import CheckpointSaveError, StorageConfig
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import full_params, load_report, make_manager, train_steps
from tests.s3.faults import GETS, PUTS, Fault, uninstall_all
from tests.s3.test_s3_single import keys, manager_for

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _no_faults_left():
    yield
    uninstall_all()


def test_throttling_503_slowdown_is_retried_with_backoff(s3_server, s3_root):
    fault = Fault(PUTS, "/data/step-000000003-", 503, "SlowDown", times=3).install()
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    manager.save(3)  # three throttled PUTs, each retried: the save commits
    manager.close()
    assert fault.hits == 3 and fault.seen >= 3 + 2  # .metadata and one file of small items, plus the 3 retries
    assert "manifests/step-000000003.json" in keys(s3_server, s3_root)


def test_throttling_past_the_retries_fails_the_save_and_commits_nothing(s3_server, s3_root, monkeypatch):
    from distckpt._storage import s3_client

    monkeypatch.setattr(s3_client, "MAX_ATTEMPTS", 3)
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    manager.save(3)
    Fault(PUTS, "/data/step-000000006-", 503, "SlowDown").install()  # never lets up
    train_steps(*objs, 3)
    with pytest.raises(CheckpointSaveError, match=r"SlowDown.*Nothing was committed") as e:
        manager.save(6)
    assert "after 3 attempt(s)" in str(e.value)
    uninstall_all()
    manager.close()
    names = keys(s3_server, s3_root)
    assert not any("step-000000006" in n for n in names)  # the abort removed what was uploaded
    assert "manifests/step-000000003.json" in names


def save_with_put_failing_on_rank_1(rank: int, world_size: int, opts: dict) -> dict:
    from distckpt._storage import s3_client

    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 3)
    manager.save(3)
    if rank == 0:
        torch.save(full_params(model), opts["expected"])
    if rank == 1:
        s3_client.MAX_ATTEMPTS = 2
        Fault(PUTS, "/__1_", 500, "InternalError").install()  # rank 1's data objects only
    train_steps(model, optimizer, scheduler, scaler, loader, 3)
    try:
        manager.save(6)
        return {"error": None}
    except CheckpointSaveError as e:
        return {"error": str(e), "failures": e.failures}
    finally:
        manager.close()


def test_put_failing_on_one_rank_fails_the_save_on_every_rank(s3_server, s3_root, tmp_path):
    opts = {"root": s3_root, "wrapper": "ddp", "expected": str(tmp_path / "expected.pt")}
    out = values(run_ranks(save_with_put_failing_on_rank_1, 2, opts))
    for r in out:
        assert r["error"] and "InternalError" in r["error"] and "Nothing was committed" in r["error"]
        # DCP's write phase is collective: each rank reports rank 1's failed PUT of its own object
        assert all(m.startswith("DCP rank 1: StorageError: S3 PUT ") and "/__1_" in m for m in r["failures"].values())
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in out[0]["error"]
    names = keys(s3_server, s3_root)
    assert not any("step-000000006" in n for n in names)
    loaded = values(run_ranks(load_report, 2, {"root": s3_root, "wrapper": "ddp"}))
    assert loaded[0]["state"].step == 3
    for k, v in torch.load(tmp_path / "expected.pt").items():
        assert torch.equal(v, loaded[0]["params"][k]), k


def load_with_get_failing_on_rank_1(rank: int, world_size: int, opts: dict) -> dict:
    from distckpt import DistCkptError
    from distckpt._storage import s3_client

    if rank == 1:
        s3_client.MAX_ATTEMPTS = 2
        Fault(GETS, ".distcp", 500, "InternalError").install()
    try:
        return {"step": load_report(rank, world_size, opts)["state"].step}
    except DistCkptError as e:
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.slow
def test_get_failing_on_one_rank_fails_the_load_on_every_rank_without_falling_back(s3_server, s3_root):
    values(run_ranks(save_with_put_failing_on_rank_1, 2, {"root": s3_root, "wrapper": "ddp", "expected": os.devnull}))
    out = values(
        run_ranks(load_with_get_failing_on_rank_1, 2, {"root": s3_root, "wrapper": "ddp", "fallback_to_older": True})
    )
    assert out[1]["error"].startswith("StorageError: ") and "InternalError" in out[1]["error"]
    assert out[0]["error"].startswith("DistCkptError: ") and "not because of the checkpoint" in out[0]["error"]
    names = keys(s3_server, s3_root)
    assert "manifests/step-000000003.json" in names  # not set aside: a GET failure is no corruption


def test_server_gone_mid_save_fails_the_save_and_the_previous_checkpoint_loads(s3_server, tmp_path, monkeypatch):
    from distckpt._storage import s3_client
    from launch.s3_server import S3Server

    monkeypatch.setattr(s3_client, "MAX_ATTEMPTS", 2)
    with S3Server(str(tmp_path / "weed")) as server:
        server.create_bucket("gone-bucket")
        root = "s3://gone-bucket/run"

        def on_phase(phase: str, step: int, rank: int) -> None:
            if (phase, step) == ("write", 6):
                server.kill()

        manager, objs = manager_for(root, storage=StorageConfig(s3_endpoint_url=server.endpoint_url), on_phase=on_phase)
        train_steps(*objs, 3)
        manager.save(3)
        expected = {k: v.clone() for k, v in full_params(objs[0]).items()}
        train_steps(*objs, 3)
        with pytest.raises(
            CheckpointSaveError,
            match=r"save of step 6 failed on rank\(s\) \[0\].*Nothing was "
            "committed",
        ) as e:
            manager.save(6)
        assert "Could not connect to the endpoint URL" in str(e.value)
        manager.lock.held = False  # its lock object is on the dead server
        manager.close()
        server.start()  # the server comes back with its data
        fresh, (model, *_) = manager_for(root, storage=StorageConfig(s3_endpoint_url=server.endpoint_url))
        assert fresh.load().step == 3
        fresh.close()
        for k, v in full_params(model).items():
            assert torch.equal(v, expected[k]), k
        assert not [n for n in keys(server, root) if "step-000000006" in n]
