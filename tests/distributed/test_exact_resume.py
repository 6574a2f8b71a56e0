"""Exact resume: K uninterrupted steps == j steps, save, fresh processes, load, K - j steps."""

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import train

pytestmark = pytest.mark.timeout(240)


def check_exact_resume(
    tmp_path,
    world_size: int,
    opts: dict[str, Any],
    *,
    backend: str = "gloo",
    K: int = 16,
    j: int = 9,
    timeout_s: float = 120.0,
) -> tuple[list, list]:
    """Run K steps uninterrupted, and j + 1 steps (checkpoint at j) then a resume to K in fresh
    processes; assert every loss, sample id, parameter, loss scale and LR bitwise equal.
    Returns ``(base, resumed)`` per-rank results of :func:`~tests.distributed.trainer.train`."""

    def run(root: str, **extra: Any) -> list:
        return values(
            run_ranks(
                train,
                world_size,
                {**opts, "root": str(tmp_path / root), "until": K, **extra},
                timeout_s=timeout_s,
                backend=backend,
            )
        )

    base = run("a")
    first = run("b", crash_at=j + 1, interval_steps=j)
    resumed = run("b", interval_steps=j)
    assert resumed[0]["resumed_from"] == j
    for rank in range(world_size):
        expected = {s: loss for s, loss in base[rank]["losses"].items() if s > j}
        assert resumed[rank]["losses"] == expected  # bitwise: float equality of every step
        assert {s: i for s, i in base[rank]["ids"].items() if s > j} == resumed[rank]["ids"]
        assert {s: v for s, v in base[rank]["scales"].items() if s > j} == resumed[rank]["scales"]
    for k, v in base[0]["params"].items():
        assert torch.equal(v, resumed[0]["params"][k]), k
    assert base[0]["scale"] == resumed[0]["scale"]
    assert base[0]["lr"] == resumed[0]["lr"]
    # the first run also stepped past j before dying: the resume replays step j+1 identically
    assert first[0]["losses"][j + 1] == base[0]["losses"][j + 1]
    return base, resumed


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_exact_resume_world_size_2(tmp_path, wrapper):
    # 12 steps per epoch: j = 9 is mid-epoch, K = 16 in the next epoch
    check_exact_resume(tmp_path, 2, {"wrapper": wrapper})
