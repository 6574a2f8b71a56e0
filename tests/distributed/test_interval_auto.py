"""``schedule.interval_steps: auto`` across ranks: rank 0's clock and statistics decide, every
rank saves at the same steps, and the manifest records rank 0's decision."""

import json

import pytest

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(240)


def auto_with_skewed_clocks(rank, world_size, opts):
    from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
    from tests.distributed.trainer import build

    model, optimizer, *_ = build(rank, world_size, {"wrapper": "ddp"})
    # M = 1 s makes Daly's optimum tiny: the 10 s floor decides, whatever a save costs here.
    schedule = ScheduleConfig(interval_steps="auto", mtbf_s=1.0, min_interval_s=10.0, max_overhead=None)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["root"], schedule=schedule), model=model, optimizer=optimizer
    )
    # Fake clocks: rank 1 runs 3x faster and 100 s ahead; only rank 0's may decide.
    ticks = {"t": 0.0}
    auto = manager.schedule.auto
    auto.clock = lambda: ticks["t"] * (3.0 if rank == 1 else 1.0) + (100.0 if rank == 1 else 0.0)
    auto.run_start = auto.last_end = auto.clock()
    saved = []
    for step in range(1, 13):
        # 4 s per step on rank 0: the 10 s have passed after 3 steps, and the vote carrying rank 0's
        # answer applies at the next step -> a save every 4 steps.
        ticks["t"] += 4.0
        if manager.maybe_save(step):
            saved.append(step)
    decision = auto.decision.formula
    manager.close()
    return saved, decision


def test_auto_interval_decided_by_rank0_despite_skewed_clocks(tmp_path):
    (saved0, decision0), (saved1, _) = values(run_ranks(auto_with_skewed_clocks, 2, {"root": str(tmp_path)}))
    assert saved0 == saved1 == [4, 8, 12]
    assert decision0 == "min_interval_s"
    recorded = json.loads((tmp_path / "step-000000012" / "distckpt.json").read_text())["interval"]
    assert recorded["decision_formula"] == "min_interval_s" and recorded["decision_interval_s"] == 10.0
    assert recorded["exposure_s"] == pytest.approx(48.0)  # rank 0's clock at step 12: 12 steps of 4 s
    assert len(recorded["costs_s"]) == 2  # the saves of steps 4 and 8 and recorded["step_s"] == pytest.approx(4.0)
