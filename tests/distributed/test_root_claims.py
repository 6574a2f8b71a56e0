"""A used root on 2 ranks: a fresh run is refused on every rank (no hang), a rollback commits."""

import os

import pytest

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import make_manager, train_steps

pytestmark = pytest.mark.timeout(240)


def root_job(rank: int, world_size: int, root: str) -> dict:
    from distckpt import ConfigError

    out: dict = {}
    manager, *objs = make_manager(rank, world_size, {"root": root, "config": {"retention": {"keep_last": None}}})
    for step in (3, 6, 9):
        train_steps(*objs, 1)
        manager.save(step)
    manager.close()
    try:
        make_manager(rank, world_size, {"root": root, "config": {"load": {"enabled": False}}})
        out["refused"] = None
    except ConfigError as e:
        out["refused"] = str(e)
    manager, *objs = make_manager(
        rank,
        world_size,
        {"root": root, "load_path": os.path.join(root, "step-000000003"), "config": {"retention": {"keep_last": 2}}},
    )
    out["loaded"] = manager.load().step
    train_steps(*objs, 1)
    manager.save(6)  # rank 0 sets the old 6 and 9 aside before the commit
    manager.close()
    out["names"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    out["latest"] = open(os.path.join(root, "latest")).read().strip()
    return out


def test_used_root_on_two_ranks(tmp_path):
    ranks = values(run_ranks(root_job, 2, str(tmp_path), timeout_s=200))
    for r in ranks:
        assert r["refused"] and "step-000000009" in r["refused"] and "on_existing: archive" in r["refused"]
        assert r["loaded"] == 3
    assert ranks[0]["names"] == [
        "latest",
        "rolledback-step-000000006-0",
        "rolledback-step-000000009-0",
        "step-000000003",
        "step-000000006",
    ]
    assert ranks[0]["latest"] == "step-000000006"


def fine_tune_restart_job(rank: int, world_size: int, opts: dict) -> dict:
    """Issue 24 item 6 on 2 ranks: a fine-tune (load_path in another root, load_only model)
    commits twice and is started again with the same config: every rank resumes step 2 in full."""
    import torch

    def flat(model, optimizer):  # DDP: every rank holds the whole optimizer state
        return {
            f"{pid}.{name}": v.clone()
            for pid, st in optimizer.state_dict()["state"].items()
            for name, v in st.items()
            if isinstance(v, torch.Tensor)
        }

    manager, *objs = make_manager(rank, world_size, {"root": opts["pre"], "wrapper": "ddp"})
    train_steps(*objs, 2)
    manager.save(3)
    manager.close()
    ft = {
        "root": opts["ft"],
        "load_path": os.path.join(opts["pre"], "step-000000003"),
        "wrapper": "ddp",
        "config": {"load": {"only": ["model"]}, "retention": {"keep_last": None}},
    }
    manager, *objs = make_manager(rank, world_size, ft)
    out = {"first": manager.load().step}
    for step in (1, 2):
        train_steps(*objs, 1)
        manager.save(step)
    out["saved"] = flat(objs[0], objs[1])
    manager.close()
    manager, *objs = make_manager(rank, world_size, ft)
    out["restart"] = manager.load().step
    out["loaded"] = flat(objs[0], objs[1])  # the optimizer too: the selection applied once
    manager.close()
    return out


def test_a_fine_tune_restarts_from_its_own_checkpoints_on_two_ranks(tmp_path):
    import torch

    ranks = values(
        run_ranks(fine_tune_restart_job, 2, {"pre": str(tmp_path / "pre"), "ft": str(tmp_path / "ft")}, timeout_s=200)
    )
    for r in ranks:
        assert (r["first"], r["restart"]) == (0, 2)
        assert r["saved"].keys() == r["loaded"].keys() and r["saved"]
        assert all(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"])
