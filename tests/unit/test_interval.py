"""The interval policy (``schedule.interval_steps: auto``): the formulas against Daly's closed form,
the inputs it follows (C, M), the floor and ceiling, the schedule's decisions and the statistics
a resume takes over from the root."""

import json
import math

import pytest

from distckpt import CheckpointConfig, CheckpointManager, ConfigError, ScheduleConfig
from distckpt._coord.collective import Collective
from distckpt._save.interval import (
    COST_WINDOW,
    IntervalStats,
    choose_interval,
    daly_interval,
    expected_loss_s,
    posterior_mtbf,
    robust_cost,
    young_interval,
)
from distckpt._save.schedule import JOURNAL, SaveSchedule
from tests.distributed.trainer import build, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def exact_daly_optimum(cost_s, mtbf_s):
    """The exact minimiser of Daly's expected wall time ``M e^(R/M) (e^((tau + C)/M) - 1) / tau``
    (2006, eq. 13): ``d/dtau = 0`` gives ``(x - 1) e^(x - 1) = -e^(-1 - C/M)`` with ``x = tau/M``,
    so ``tau = M (1 + W0(-e^(-1 - C/M)))`` (Lambert W, principal branch, by Newton's method)."""
    z = -math.exp(-1.0 - cost_s / mtbf_s)
    w = -1.0 + math.sqrt(2.0 * (1.0 + math.e * z))  # series start near the branch point
    for _ in range(100):
        w -= (w * math.exp(w) - z) / (math.exp(w) * (w + 1.0))
    return mtbf_s * (1.0 + w)


def test_daly_on_a_case_with_a_known_answer():
    # C = 300 s, M = 1 day: sqrt(2CM) = 7200 s and sqrt(C/2M) = 1/24 exactly, so Daly's eq. 37 gives
    # 7200 (1 + 1/72 + 1/5184) - 300 = 7001.3889 s.
    assert young_interval(300.0, 86400.0) == pytest.approx(7200.0, rel=1e-12)
    assert daly_interval(300.0, 86400.0) == pytest.approx(7200.0 * (1 + 1 / 72 + 1 / 5184) - 300.0, rel=1e-12)
    assert daly_interval(300.0, 86400.0) == pytest.approx(7001.3889, abs=1e-4)
    # ... and the higher-order estimate sits on the exact optimum of Daly's model.
    assert exact_daly_optimum(300.0, 86400.0) == pytest.approx(7001.3889, rel=2e-4)
    for c, m in [(10.0, 3600.0), (60.0, 28440.0), (600.0, 28440.0), (5.0, 86400.0 * 30)]:
        assert daly_interval(c, m) == pytest.approx(exact_daly_optimum(c, m), rel=3e-3), (c, m)
    assert daly_interval(100.0, 40.0) == 40.0  # C >= 2M: tau = M (Daly)


def test_interval_follows_the_save_cost():
    chosen = [choose_interval(c, 28440.0, min_interval_s=1.0, max_overhead=None) for c in (1.0, 10.0, 100.0)]
    assert [d.formula for d in chosen] == ["daly"] * 3
    assert chosen[0].interval_s < chosen[1].interval_s < chosen[2].interval_s
    assert chosen[1].interval_s == pytest.approx(daly_interval(10.0, 28440.0))


def test_interval_follows_the_failures():
    stats, intervals = IntervalStats(), []
    for _ in range(4):  # each start after a periodic save: the previous run crashed
        previous = stats.to_dict(ending="periodic", exposure_s=stats.exposure_s + 3600.0)
        stats = IntervalStats()
        assert stats.start_after(previous, now=0.0) == "crashed"
        intervals.append(choose_interval(30.0, stats.mtbf_s(28440.0), min_interval_s=1.0, max_overhead=None))
    assert stats.failures == 4 and stats.exposure_s == pytest.approx(4 * 3600.0)
    assert [d.mtbf_s for d in intervals] == pytest.approx([(28440 + 3600 * k) / (1 + k) for k in range(1, 5)])
    assert all(a.interval_s > b.interval_s for a, b in zip(intervals, intervals[1:]))
    # a preemption or a finish is not a failure
    for ending, count in [("preempted", "preemptions"), ("final", "finishes")]:
        s = IntervalStats()
        s.start_after({"ending": ending, "exposure_s": 100.0}, now=0.0)
        assert s.failures == 0 and getattr(s, count) == 1 and s.mtbf_s(1000.0) == 1100.0


def test_floor_and_ceiling():
    floor = choose_interval(0.01, 1000.0, min_interval_s=60.0, max_overhead=None)
    assert floor.formula == "min_interval_s" and floor.interval_s == 60.0
    # Young ~ sqrt(2 * 120 * 28440) = 2613 s; 2% overhead needs 120 * 0.98 / 0.02 = 5880 s
    ceiling = choose_interval(120.0, 28440.0, min_interval_s=60.0, max_overhead=0.02)
    assert ceiling.formula == "max_overhead"
    assert ceiling.interval_s == pytest.approx(5880.0) and ceiling.overhead == pytest.approx(0.02)
    # the schedule bounds the overhead with the largest recent cost, not the median
    slow = choose_interval(120.0, 28440.0, min_interval_s=60.0, max_overhead=0.02, ceiling_cost_s=240.0)
    assert slow.interval_s == pytest.approx(11760.0) and slow.overhead < 0.02
    free = choose_interval(120.0, 28440.0, min_interval_s=60.0, max_overhead=0.2)
    assert free.formula == "daly" and free.overhead < 0.2
    first = choose_interval(None, 28440.0, min_interval_s=60.0, max_overhead=0.02)
    assert first.formula == "first save" and first.interval_s == 60.0


def test_robust_cost_and_loss():
    assert robust_cost([]) is None
    assert robust_cost([1.0, 1.2, 50.0, 1.1, 0.9]) == 1.1  # one slow save does not move C
    assert robust_cost([100.0] * 3 + [1.0] * COST_WINDOW) == 1.0  # only the recent window counts
    assert posterior_mtbf(1000.0, 0.0, 0) == 1000.0
    assert expected_loss_s(100.0, 10.0, 1e9) == pytest.approx(55.0, rel=1e-6)  # half a segment
    assert expected_loss_s(100.0, 10.0, 200.0) < 55.0  # failures come early in a long segment


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"interval_steps": "auto", "interval_s": 5.0}, "interval_s"),
        ({"interval_steps": "every"}, "interval_steps"),
        ({"max_overhead": 1.5}, "max_overhead"),
        ({"min_interval_s": 0}, "min_interval_s"),
        ({"mtbf_s": -1.0}, "mtbf_s"),
    ],
)
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        ScheduleConfig(**kw)


class _Inflight:
    def __init__(self):
        self.alive = True

    def running(self):
        return self.alive


def _schedule(**kw):
    clock = {"t": 0.0}
    cfg = ScheduleConfig(interval_steps="auto", **{"mtbf_s": 1000.0, "min_interval_s": 1.0, **kw})
    schedule = SaveSchedule(
        cfg, collective=Collective(None, timeout_s=10.0), clock=lambda: clock["t"], wall=lambda: 0.0
    )
    return schedule, clock


def test_schedule_saves_at_the_chosen_interval_and_waits_for_the_inflight_save():
    schedule, clock = _schedule(max_overhead=None)
    due, taus = [], []
    for step in range(1, 300):
        clock["t"] += 1.0
        if schedule.is_due(step):
            due.append(step)
            schedule.snapshot("periodic")
            clock["t"] += 2.0  # a 2 s save
            schedule.saved(2.0)
            # Daly with C = 2 s and M = prior + this run's time (no failure yet)
            taus.append(daly_interval(2.0, 1000.0 + clock["t"]))
            assert schedule.auto.decision.interval_s == pytest.approx(taus[-1])
    assert due[0] == 1 and schedule.auto.decision.formula == "daly"  # the first save after min_interval_s
    assert [b - a for a, b in zip(due, due[1:])] == [math.ceil(t) for t in taus[: len(due) - 1]]
    assert 60 < taus[0] < taus[-1] < 75
    assert schedule.auto.stats.costs_s == [2.0] * min(len(due), COST_WINDOW)
    assert schedule.auto.stats.step_s == pytest.approx(1.0)
    # a save that fails (no saved()) is retried an interval later, not at the next step
    clock["t"] += schedule.auto.decision.interval_s
    assert schedule.is_due(499)
    schedule.snapshot("periodic")
    clock["t"] += 1.0
    assert not schedule.is_due(500)
    clock["t"] += schedule.auto.decision.interval_s
    assert schedule.is_due(501)
    # an async save still writing postpones the next one
    inflight = _Inflight()
    schedule.saved(0.1, inflight)
    clock["t"] += 10 * schedule.auto.decision.interval_s
    assert not schedule.is_due(1000)
    inflight.alive = False
    assert schedule.is_due(1001)


def test_slower_saves_lengthen_the_schedule():
    gaps = {}
    for cost in (0.5, 8.0):
        schedule, clock = _schedule(max_overhead=None)
        due = []
        for step in range(1, 2000):
            clock["t"] += 1.0
            if schedule.is_due(step):
                due.append(step)
                clock["t"] += cost
                schedule.saved(cost)
        gaps[cost] = due[-1] - due[-2]
    assert gaps[8.0] > 3 * gaps[0.5]  # sqrt(16) = 4x in Young's limit


def _auto_manager(root, clock, **schedule):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    cfg = CheckpointConfig(
        root=str(root),
        schedule=ScheduleConfig(interval_steps="auto", mtbf_s=1000.0, min_interval_s=5.0, **schedule),
    )
    manager = CheckpointManager(
        cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    auto = manager.schedule.auto
    auto.clock = lambda: clock["t"]
    auto.run_start = auto.last_end = clock["t"]
    return manager, (model, optimizer, scheduler, scaler, loader)


def _run(manager, objs, clock, steps, *, last_step=None):
    saved = []
    for step in steps:
        train_steps(*objs, 1)
        clock["t"] += 1.0
        if manager.maybe_save(step, loss=0.0, last_step=step == last_step):
            saved.append(step)
    return saved


def test_auto_statistics_survive_resume(tmp_path):
    clock = {"t": 0.0}
    manager, objs = _auto_manager(tmp_path, clock)
    saved = _run(manager, objs, clock, range(1, 31))
    assert saved and saved[0] == 5  # the first save after min_interval_s
    costs = list(manager.schedule.auto.stats.costs_s)
    manager.close()  # no final save: the next start sees a run that stopped after a periodic save
    newest = max(tmp_path.glob("step-*"))
    recorded = json.loads((newest / "distckpt.json").read_text())
    assert recorded["schema_version"] == 6 and recorded["interval"]["ending"] == "periodic"
    assert recorded["interval"]["costs_s"] == costs[: len(recorded["interval"]["costs_s"])]
    assert recorded["interval"]["exposure_s"] == pytest.approx(int(newest.name[5:]))  # 1 s per step

    clock2 = {"t": 1000.0}
    resumed, objs2 = _auto_manager(tmp_path, clock2)
    state = resumed.load()
    auto = resumed.schedule.auto
    assert state.step == int(newest.name[5:])
    assert auto.stats.costs_s == recorded["interval"]["costs_s"] and auto.stats.costs_s  # not from zero
    assert auto.stats.failures == 1 and auto.stats.exposure_s == recorded["interval"]["exposure_s"]
    assert [r["previous_end"] for r in auto.stats.runs] == ["none", "crashed"]
    assert auto.decision.cost_s is not None and auto.decision.formula != "first save"
    assert auto.decision.mtbf_s == pytest.approx((1000.0 + auto.stats.exposure_s) / 2)
    final = state.step + 3
    assert _run(resumed, objs2, clock2, range(state.step + 1, final + 1), last_step=final)[-1] == final
    resumed.close()

    again, _ = _auto_manager(tmp_path, {"t": 0.0})
    again.load()
    assert again.schedule.auto.stats.failures == 1 and again.schedule.auto.stats.finishes == 1
    again.close()


def test_a_crash_before_the_first_save_counts(tmp_path):
    clock = {"t": 0.0}
    first, objs = _auto_manager(tmp_path, clock)
    assert _run(first, objs, clock, range(1, 12))  # saves, then "crashes" (no final save)
    first.close()
    second, objs = _auto_manager(tmp_path, clock)
    step = second.load().step
    assert _run(second, objs, clock, range(step + 1, step + 3)) == []  # crashes again before any save
    second.close()
    third, _ = _auto_manager(tmp_path, clock)
    third.load()  # the same checkpoint the second run loaded
    third.maybe_save(step + 1)  # the first maybe_save reads the journal
    stats = third.schedule.auto.stats
    assert stats.failures == 2 and [r["previous_end"] for r in stats.runs] == ["none", "crashed", "crashed"]
    third.close()


def test_cli_interval_report(tmp_path, capsys):
    from distckpt._cli.main import main

    clock = {"t": 0.0}
    manager, objs = _auto_manager(tmp_path, clock)
    _run(manager, objs, clock, range(1, 41))
    manager.close()
    journal = json.loads((tmp_path / JOURNAL).read_text())
    assert main(["interval", str(tmp_path), "--json"]) == 0  # a root: its journal
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "journal" and report["ending"] == "running" and len(report["costs_s"]) >= 2
    assert report["costs_s"] == manager.schedule.auto.stats.costs_s
    assert report["cost_s"] == pytest.approx(robust_cost(report["costs_s"]))
    assert report["mtbf_s"] == pytest.approx(1000.0 + journal["exposure_s"])  # no failure yet
    assert report["decision"]["interval_s"] == journal["decision_interval_s"]
    assert report["decision"]["expected_loss_s"] > 0 and report["step_s"] == pytest.approx(1.0)
    newest = max(tmp_path.glob("step-*"))
    assert main(["interval", str(newest), "--json"]) == 0  # a checkpoint: its manifest
    recorded = json.loads((newest / "distckpt.json").read_text())["interval"]
    assert json.loads(capsys.readouterr().out)["costs_s"] == recorded["costs_s"]
    assert main(["interval", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "C  save cost" in text and "expected work lost per failure" in text and "journal" in text
    plain = tmp_path / "plain"
    trained = CheckpointManager(CheckpointConfig(root=str(plain)), model=objs[0], optimizer=objs[1])
    trained.save(1)
    trained.close()
    assert main(["interval", str(plain)]) == 2
    assert "no interval statistics" in capsys.readouterr().err


def test_async_saves_measure_the_stall_and_wait_for_the_inflight_save(tmp_path):
    from distckpt import AsyncSaveConfig

    clock = {"t": 0.0}
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    cfg = CheckpointConfig(
        root=str(tmp_path),
        schedule=ScheduleConfig(interval_steps="auto", mtbf_s=1.0, min_interval_s=2.0, max_overhead=None),
        async_save=AsyncSaveConfig(mode="thread"),
    )
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, dataloader=loader)
    auto = manager.schedule.auto
    auto.clock = lambda: clock["t"]
    auto.run_start = auto.last_end = 0.0
    saved = _run(manager, (model, optimizer, scheduler, scaler, loader), clock, range(1, 4))
    assert saved == [2]  # the first save after min_interval_s
    assert auto.inflight is manager._inflight is not None  # the background write the next decision waits for
    assert auto.stats.costs_s == [manager.last_save_seconds]  # the stall, measured on return
    manager.wait()
    assert not auto.inflight.running()
    clock["t"] += 100.0
    assert manager.maybe_save(4)
    manager.close()
    assert json.loads((tmp_path / "step-000000004" / "distckpt.json").read_text())["interval"]["costs_s"] == [
        auto.stats.costs_s[0]
    ]


def test_demo_job_accepts_interval_steps_auto():
    from launch.config import load_job_config

    job = load_job_config(
        "launch/configs/ddp.yaml", ["checkpoint.schedule.interval_steps=auto", "checkpoint.schedule.max_overhead=null"]
    )
    assert job.checkpoint.schedule.interval_steps == "auto" and job.checkpoint.schedule.max_overhead is None
    with pytest.raises(ConfigError, match="interval_steps"):
        load_job_config("launch/configs/ddp.yaml", ["checkpoint.schedule.interval_steps=often"])


@pytest.mark.parametrize(
    "bad",
    [
        {"failures": "x"},
        {"costs_s": "abc"},
        {"failures": -5},
        {"exposure_s": -1e9},
        {"costs_s": [-1.0, 1.0]},
        {"costs_s": [float("inf")]},
        {"failures": True},
    ],
)
def test_statistics_of_the_wrong_type_or_range_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="invalid fields"):
        IntervalStats.from_dict(bad)
    assert IntervalStats.from_dict({"failures": 2, "costs_s": [1.5]}).failures == 2
