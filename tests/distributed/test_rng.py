"""Per-rank RNG: each rank resumes its own streams; a rank new to the job gets derived ones."""

import random

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def draws():
    return (torch.rand(4).tolist(), random.random(), float(np.random.rand()))


def rng_job(rank, world_size, opts):
    import logging

    from distckpt import CheckpointConfig, CheckpointManager
    from tests.distributed.trainer import Net

    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    manager = CheckpointManager(CheckpointConfig(root=opts["root"], seed=5), model=Net(), optimizer=None)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("distckpt").addHandler(handler)
    if opts["load"]:
        manager.load()
    else:
        draws()  # advance the streams before saving
        manager.save(7)
    after = draws()
    manager.close()
    return {"draws": after, "log": records}


def test_each_rank_resumes_its_own_rng_and_new_ranks_derive(tmp_path):
    saved = values(run_ranks(rng_job, 2, {"root": str(tmp_path), "load": False}))
    resumed = values(run_ranks(rng_job, 2, {"root": str(tmp_path), "load": True}))
    assert saved[0]["draws"] != saved[1]["draws"]
    for rank in range(2):
        assert resumed[rank]["draws"] == saved[rank]["draws"]
    grown = values(run_ranks(rng_job, 3, {"root": str(tmp_path), "load": True}))
    assert [g["draws"] for g in grown[:2]] == [s["draws"] for s in saved]
    assert "rank 2 did not exist at save (saved world size 2): RNG derived from (seed=5, rank=2, step=7)" \
        in " ".join(grown[2]["log"])
    again = values(run_ranks(rng_job, 3, {"root": str(tmp_path), "load": True}))
    assert again[2]["draws"] == grown[2]["draws"]  # deterministic derivation
