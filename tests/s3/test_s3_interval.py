"""``interval_steps: auto`` on an S3 root: the journal is an object next to the lock, and a
restart takes the statistics back from it."""

from __future__ import annotations

import json

import pytest

from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
from tests.distributed.trainer import build, train_steps
from tests.s3.test_s3_single import get

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]


def _manager(root: str, clock: dict):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    schedule = ScheduleConfig(interval_steps="auto", mtbf_s=1000.0, min_interval_s=3.0)
    manager = CheckpointManager(
        CheckpointConfig(root=root, schedule=schedule),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dataloader=loader,
    )
    manager.schedule.auto.clock = lambda: clock["t"]
    manager.schedule.auto.run_start = manager.schedule.auto.last_end = clock["t"]
    return manager, (model, optimizer, scheduler, scaler, loader)


def test_journal_on_s3(s3_server, s3_root):
    clock = {"t": 0.0}
    manager, objs = _manager(s3_root, clock)
    saved = []
    for step in range(1, 8):
        train_steps(*objs, 1)
        clock["t"] += 1.0
        saved += [step] if manager.maybe_save(step) else []
    manager.close()  # without a final save: the next start counts a failure
    assert saved and saved[0] == 3
    journal = json.loads(get(s3_server, s3_root, ".interval.json"))
    assert journal["ending"] == "running" and len(journal["costs_s"]) == len(saved)
    again, _ = _manager(s3_root, clock)
    again.load()
    again.maybe_save(saved[-1] + 1)
    assert again.schedule.auto.stats.failures == 1 and again.schedule.auto.stats.costs_s == journal["costs_s"]
    again.close()
