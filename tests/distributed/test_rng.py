"""Per-rank RNG: each rank resumes its own streams; a rank new to the job gets derived ones."""

import random
import shutil

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def draws():
    """Next draws of every source: python, numpy, torch CPU and each CUDA device (if any)."""
    cuda = [torch.rand(4, device=f"cuda:{d}").tolist() for d in range(torch.cuda.device_count())]
    return (torch.rand(4).tolist(), random.random(), float(np.random.rand()), cuda)


def rng_job(rank, world_size, opts):
    import logging

    from distckpt import CheckpointConfig, CheckpointManager, ElasticConfig
    from tests.distributed.trainer import Net

    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["root"], elastic=ElasticConfig(seed=5)), model=Net(), optimizer=None
    )
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
    assert "rank 2 did not exist at save (saved world size 2): RNG derived from (seed=5, rank=2, step=7)" in " ".join(
        grown[2]["log"]
    )
    again = values(run_ranks(rng_job, 3, {"root": str(tmp_path), "load": True}))
    assert again[2]["draws"] == grown[2]["draws"]  # deterministic derivation


def test_resume_at_epoch_end_keeps_dropout_rng_on_two_ranks_and_positions_a_new_world_size(tmp_path):
    """Checkpoint at step 12, the last step of an epoch (96 samples, G=8): the next epoch's
    loader iterator draws its base seed from the global torch RNG after the restore, as in
    the uninterrupted run, so dropout masks and losses stay bitwise equal (issue 12, item 4)."""
    from tests.distributed.trainer import train

    until, cut = 16, 12
    opts = {"until": until, "interval_steps": 6, "wrapper": "ddp"}
    base = values(run_ranks(train, 2, dict(opts, root=str(tmp_path / "a"))))
    values(run_ranks(train, 2, dict(opts, root=str(tmp_path / "b"), crash_at=cut)))
    shutil.copytree(tmp_path / "b", tmp_path / "c", ignore=shutil.ignore_patterns(".lock"))
    resumed = values(run_ranks(train, 2, dict(opts, root=str(tmp_path / "b"), interval_steps=100)))
    assert resumed[0]["resumed_from"] == cut
    for rank in range(2):
        assert resumed[rank]["losses"] == {s: v for s, v in base[rank]["losses"].items() if s > cut}
        assert resumed[rank]["ids"] == {s: v for s, v in base[rank]["ids"].items() if s > cut}
    for k, v in base[0]["params"].items():
        assert torch.equal(v, resumed[0]["params"][k]), k
    # World size 2 -> 1 at the epoch end: rebuilt from the global position, each step of the
    # next epoch takes the concatenation of the two ranks' batches.
    one = values(run_ranks(train, 1, dict(opts, root=str(tmp_path / "c"), interval_steps=100)))
    assert one[0]["resumed_from"] == cut
    assert one[0]["ids"] == {s: base[0]["ids"][s] + base[1]["ids"][s] for s in range(cut + 1, until + 1)}
