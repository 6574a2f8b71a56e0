"""Exact resume: K uninterrupted steps == j steps, save, fresh processes, load, K - j steps."""

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import train

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_exact_resume_world_size_2(tmp_path, wrapper):
    K, j = 16, 9  # 12 steps per epoch: j is mid-epoch, K in the next epoch
    base = values(run_ranks(train, 2, {"root": str(tmp_path / "a"), "until": K, "wrapper": wrapper}))
    first = values(run_ranks(train, 2, {"root": str(tmp_path / "b"), "until": K, "wrapper": wrapper,
                                         "crash_at": j + 1, "interval_steps": j}))
    resumed = values(run_ranks(train, 2, {"root": str(tmp_path / "b"), "until": K, "wrapper": wrapper,
                                           "interval_steps": j}))
    assert resumed[0]["resumed_from"] == j
    for rank in range(2):
        expected = {s: loss for s, loss in base[rank]["losses"].items() if s > j}
        assert resumed[rank]["losses"] == expected  # bitwise: float equality of every step
        assert {s: i for s, i in base[rank]["ids"].items() if s > j} == resumed[rank]["ids"]
    for k, v in base[0]["params"].items():
        assert torch.equal(v, resumed[0]["params"][k]), k
    assert base[0]["scale"] == resumed[0]["scale"]
    assert base[0]["lr"] == resumed[0]["lr"]
    # the first run also stepped past j before dying: the resume replays step j+1 identically
    assert first[0]["losses"][j + 1] == base[0]["losses"][j + 1]
