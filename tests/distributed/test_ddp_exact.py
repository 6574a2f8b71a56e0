"""Same-world DDP resume is bitwise at 3 and 4 ranks (issue 19).

DDP rebuilds its gradient buckets after a process's first iteration; a resumed process would
reduce its first step with the initial layout while the uninterrupted run uses the rebuilt one,
and with 3+ ranks the summation order of an element depends on its offset in the bucket. The
model is wide enough (a 1.6 MB layer) that the rebuilt layout splits into several buckets.
``ddp_fixed_buckets`` builds DDP with ``find_unused_parameters=True``, which keeps one layout.
"""

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import train

pytestmark = pytest.mark.timeout(300)

K = 16
RESUME_AT = (3, 13)  # after the first few steps; after many (mid-epoch at both world sizes)


# 3 ranks in `make test-slow`: the default suite keeps 4 (the bug needs >= 3 ranks either way).
@pytest.mark.parametrize("world_size", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_ddp_same_world_resume_is_bitwise(tmp_path, world_size):
    opts = {
        "until": K,
        "wrapper": "ddp",
        "ddp_fixed_buckets": True,
        "width": 640,
        "global_batch_size": 12 if world_size == 3 else 8,
    }
    base = values(
        run_ranks(
            train,
            world_size,
            {**opts, "root": str(tmp_path / "base"), "interval_steps": 1, "keep_last": None},
            timeout_s=240,
        )
    )
    for j in RESUME_AT:
        resumed = values(
            run_ranks(
                train,
                world_size,
                {
                    **opts,
                    "root": str(tmp_path / f"from{j}"),
                    "interval_steps": 100,
                    "load_path": str(tmp_path / "base" / f"step-{j:09d}"),
                },
                timeout_s=240,
            )
        )
        assert resumed[0]["resumed_from"] == j
        for rank in range(world_size):
            expected = {s: loss for s, loss in base[rank]["losses"].items() if s > j}
            assert resumed[rank]["losses"] == expected, (j, rank)  # float equality, every step
            assert resumed[rank]["ids"] == {s: i for s, i in base[rank]["ids"].items() if s > j}
        for k, v in base[0]["params"].items():
            assert torch.equal(v, resumed[0]["params"][k]), (j, k)
