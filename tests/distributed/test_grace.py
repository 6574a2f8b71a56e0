"""The preemption grace window: a save predicted to outlast the grace is not started; an async
save in flight is finished instead of starting another when both do not fit."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from distckpt import (
    AsyncSaveConfig,
    CheckpointConfig,
    CheckpointManager,
    PreemptionConfig,
    RetentionConfig,
    ScheduleConfig,
)
from distckpt._save.grace import SaveDurations, plan_preemption
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import build, optimizer_step


def _job(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Train to ``until``; rank 1 gets SIGTERM at ``signal_at`` (every rank acts on it at the next
    step boundary: the step vote is read one step later); ``fake_s`` is injected as the measured
    duration of the previous saves (a slow disk) just before the signal."""
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, {"wrapper": "ddp"})
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=opts.get("interval", 3)),
        retention=RetentionConfig(keep_last=5),
        preemption=PreemptionConfig(exit=False, grace_s=opts.get("grace", 30.0)),
        async_save=AsyncSaveConfig(mode=opts.get("async_mode", "off")),
    )
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("distckpt._manager").addHandler(handler)
    state = manager.load()
    step = state.step if state else 0
    losses: dict[int, float] = {}
    saved = []
    while step < opts["until"] and not manager.preempted:
        for batch in loader:
            loss = optimizer_step(model, optimizer, scheduler, scaler, batch)
            step += 1
            losses[step] = loss.item()
            if step == opts.get("signal_at"):
                if opts.get("fake_s") is not None:
                    manager.save_durations.record(opts["fake_s"])
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
            if manager.maybe_save(step, last_step=step == opts["until"]):
                saved.append(step)
            if manager.preempted or step == opts["until"]:
                break
    manager.close()
    dist.barrier()
    return {
        "losses": losses,
        "resumed_from": state.step if state else None,
        "stopped_at": step,
        "messages": messages,
        "saved": saved,
        "committed": sorted(int(p.parent.name.split("-")[1]) for p in Path(manager.root).glob("step-*/distckpt.json")),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fake_s, expect_committed", [(None, [3, 5]), (1000.0, [3])], ids=["fits", "too_slow"])
def test_preemption_save_skipped_when_predicted_past_grace(tmp_path, fake_s, expect_committed) -> None:
    root = str(tmp_path / "ck")
    first = values(run_ranks(_job, 2, {"root": root, "until": 9, "signal_at": 4, "fake_s": fake_s}, timeout_s=120))
    for r in first:
        assert r["stopped_at"] == 5 and r["committed"] == expect_committed
    log = "\n".join(first[0]["messages"])
    if fake_s is None:
        assert "saving this step" in log and "saved step 5" in log
    else:
        assert "NOT saving: predicted save 1000.00 s" in log and "no save of step 5 (last saved: 3)" in log
    if fake_s is None:
        return  # resuming from the SIGTERM save is tested in test_reliability.py
    # The next run resumes from the last committed checkpoint and replays exactly.
    again = values(run_ranks(_job, 2, {"root": root, "until": 7}, timeout_s=120))
    resumed = expect_committed[-1]
    for before, after in zip(first, again):
        assert after["resumed_from"] == resumed
        for s in range(resumed + 1, 6):
            assert after["losses"][s] == before["losses"][s]  # bitwise


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fake_s, expect_committed", [(None, [4, 5]), (1000.0, [4])], ids=["fits", "too_slow"])
def test_preemption_finishes_inflight_async_save_instead_of_a_new_one(tmp_path, fake_s, expect_committed) -> None:
    root = str(tmp_path / "ck")
    out = values(
        run_ranks(
            _job,
            2,
            {"root": root, "until": 9, "signal_at": 4, "fake_s": fake_s, "interval": 4, "async_mode": "thread"},
            timeout_s=120,
        )
    )
    for r in out:
        assert r["stopped_at"] == 5 and r["committed"] == expect_committed
    log = "\n".join(out[0]["messages"])
    if fake_s is None:
        assert "finishing the in-flight save" in log and "then saving this step" in log
    else:
        assert "instead of a new one" in log and "no save of step 5 (last saved: 4)" in log


def test_plan_rules() -> None:
    d = SaveDurations(keep=2)
    assert d.predict() is None
    for x in (5.0, 1.0, 2.0):
        d.record(x)
    assert d.predict() == 2.0  # the max of the last 2

    def plan(**kw):
        given = {"grace_s": 30.0, "elapsed_s": 1.0, "predicted_s": 10.0, "inflight_left_s": None, "step_saved": False}
        return plan_preemption(**{**given, **kw}).action

    assert plan() == "save"
    assert plan(predicted_s=None) == "save"
    assert plan(elapsed_s=25.0) == "skip"  # 10 s do not fit in the 5 s left
    assert plan(inflight_left_s=15.0) == "save"  # 15 + 10 <= 29
    assert plan(inflight_left_s=25.0) == "finish_inflight"
    assert plan(inflight_left_s=40.0) == "finish_inflight"  # still the soonest checkpoint
    assert plan(step_saved=True, inflight_left_s=3.0) == "none"


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True])
def test_grace_must_be_positive_and_finite(value) -> None:
    from distckpt import ConfigError

    with pytest.raises(ConfigError, match="preemption.grace_s"):
        CheckpointConfig(root="/tmp/x", preemption=PreemptionConfig(grace_s=value))
