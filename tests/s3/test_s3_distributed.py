"""Acceptance on a real S3 server (SeaweedFS) with spawned gloo ranks: exact resume, a 2 -> 4
reshard, and SIGKILL at each commit phase (data written, manifest PUT, retention)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import full_params, load_report, save_after, train, train_steps

pytestmark = pytest.mark.timeout(240)
slow = pytest.mark.slow  # ~30-70 s each on 2 shared cores: the default suite keeps two kill phases


@slow
def test_exact_resume_world_size_2_from_s3(s3_root, tmp_path):
    K, j = 14, 9  # j mid-epoch (12 steps per epoch), K in the next epoch
    base = values(run_ranks(train, 2, {"root": str(tmp_path / "posix"), "until": K, "wrapper": "ddp"}))
    values(run_ranks(train, 2, {"root": s3_root, "until": K, "wrapper": "ddp", "crash_at": j + 1, "interval_steps": j}))
    resumed = values(run_ranks(train, 2, {"root": s3_root, "until": K, "wrapper": "ddp", "interval_steps": j}))
    assert resumed[0]["resumed_from"] == j
    for rank in range(2):
        assert resumed[rank]["losses"] == {s: v for s, v in base[rank]["losses"].items() if s > j}  # bitwise
        assert resumed[rank]["ids"] == {s: i for s, i in base[rank]["ids"].items() if s > j}
    for k, v in base[0]["params"].items():
        assert torch.equal(v, resumed[0]["params"][k]), k
    assert base[0]["scale"] == resumed[0]["scale"] and base[0]["lr"] == resumed[0]["lr"]


@slow
def test_reshard_2_to_4_from_s3(s3_root):
    saved = values(run_ranks(save_after, 2, {"root": s3_root, "wrapper": "fsdp2", "steps": 3}))
    loaded = values(run_ranks(load_report, 4, {"root": s3_root, "wrapper": "fsdp2"}, timeout_s=180))
    assert [r["state"].step for r in loaded] == [3] * 4 and loaded[3]["state"].saved_world_size == 2
    # full state dicts (gathered to rank 0 with CPU offload) of the 2-rank save and the 4-rank load
    for k, v in saved[0]["params"].items():
        assert torch.equal(v, loaded[0]["params"][k]), k
    assert saved[0]["optim"]["state"].keys() == loaded[0]["optim"]["state"].keys()
    for k, v in saved[0]["optim"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, loaded[0]["optim"]["state"][k][name]), (k, name)


def save_twice_and_die(rank: int, world_size: int, opts: dict) -> str:
    """Save step 3, then step 6 (keep_last=1: retention deletes step 3); SIGKILL at opts['kill']."""
    from distckpt import CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig
    from distckpt._storage.s3_client import S3Objects
    from distckpt._storage.s3_dcp import S3Writer
    from tests.distributed.trainer import build

    kill, victim = opts["kill"], opts.get("victim", 0)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def on_phase(phase: str, step: int, r: int) -> None:
        if (phase, step) == kill and r == victim:
            die()
        if (phase, step) == ("retention", 3) and kill == ("mid-delete", 3) and r == victim:
            original_delete = S3Objects.delete

            def delete_then_die(self, keys):  # retention's first DELETE request, then the process dies
                original_delete(self, keys)
                die()

            S3Objects.delete = delete_then_die  # type: ignore[method-assign]

    model, optimizer, scheduler, scaler, loader = build(rank, world_size, {"wrapper": "ddp"})
    manager = CheckpointManager(
        CheckpointConfig(
            root=opts["root"], schedule=ScheduleConfig(interval_steps=None), retention=RetentionConfig(keep_last=1)
        ),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
        on_phase=on_phase,
    )
    for step in (3, 6):
        train_steps(model, optimizer, scheduler, scaler, loader, 3)
        if rank == 0:
            torch.save(full_params(model), f"{opts['out']}/params-{step}.pt")
        if step == 6 and rank == victim and kill == ("written", 6):  # after this rank's objects are uploaded
            original = S3Writer.write_data

            def write_then_die(self, plan, planner, original=original):
                future = original(self, plan, planner)
                die()
                return future

            S3Writer.write_data = write_then_die  # type: ignore[method-assign]
        manager.save(step)
    manager.close()
    return "survived"


@pytest.mark.parametrize(
    "kill,victim,loads",
    [
        pytest.param(("written", 6), 1, 3, marks=slow),  # rank 1's objects uploaded, no manifest: the previous
        (("manifest", 6), 0, 3),  # all data written, manifest not PUT: the previous
        (("latest", 6), 0, 6),  # manifest PUT: the new one (latest still names step 3)
        pytest.param(("retention", 3), 0, 6, marks=slow),  # before retention deletes step 3
        pytest.param(("mid-delete", 3), 0, 6, marks=slow),  # retention's first DELETE done (the manifest)
    ],
    ids=["data-written", "before-manifest-put", "after-manifest-put", "before-retention", "mid-retention"],
)
def test_sigkill_at_each_commit_phase_loads_previous_or_new_never_partial(
    s3_server, s3_root, tmp_path, kill, victim, loads
):
    from distckpt._storage import find_committed, open_store

    opts = {"root": s3_root, "kill": kill, "victim": victim, "out": str(tmp_path)}
    results = run_ranks(save_twice_and_die, 2, opts, expect_death=True)
    assert results[victim] is None
    loaded = values(run_ranks(load_report, 2, {"root": s3_root, "wrapper": "ddp"}))
    assert loaded[0]["state"].step == loaded[1]["state"].step == loads
    expected = torch.load(tmp_path / f"params-{loads}.pt")
    for k, v in expected.items():
        assert torch.equal(v, loaded[0]["params"][k]), k
    # the start removed every unreferenced object; what is left is committed and verifies
    store = open_store(s3_root)
    committed = find_committed(store)
    bucket, _, prefix = s3_root[len("s3://") :].partition("/")
    data = {k.split("/")[-2] for k in store.objects.list_objects(f"{prefix}/data/")}
    assert data == {loc.rsplit("/", 1)[-1] for _, loc, _ in committed}
    assert all(store.verify(loc) == [] for _, loc, _ in committed)
