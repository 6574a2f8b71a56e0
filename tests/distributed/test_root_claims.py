"""A used root on 2 ranks: a fresh run is refused on every rank (no hang), a rollback commits."""

import os

import pytest

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import make_manager, train_steps

pytestmark = pytest.mark.timeout(240)


def root_job(rank: int, world_size: int, root: str) -> dict:
    from distckpt import ConfigError

    out: dict = {}
    manager, *objs = make_manager(rank, world_size, {"root": root, "config": {"keep_last": None}})
    for step in (3, 6, 9):
        train_steps(*objs, 1)
        manager.save(step)
    manager.close()
    try:
        make_manager(rank, world_size, {"root": root, "config": {"load": False}})
        out["refused"] = None
    except ConfigError as e:
        out["refused"] = str(e)
    manager, *objs = make_manager(rank, world_size, {"root": root, "load_path": os.path.join(root, "step-000000003"),
                                                     "config": {"keep_last": 2}})
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
    assert ranks[0]["names"] == ["latest", "rolledback-step-000000006-0", "rolledback-step-000000009-0",
                                 "step-000000003", "step-000000006"]
    assert ranks[0]["latest"] == "step-000000006"
