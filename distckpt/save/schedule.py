"""When to save: every N steps and/or every T seconds, agreed by all ranks."""

from __future__ import annotations

import time
from typing import Callable

from ..config import ScheduleConfig
from ..coord.collective import Collective

__all__ = ["SaveSchedule"]


class SaveSchedule:
    """Decides whether step ``step`` is a save step.

    ``interval_steps`` is a pure function of the step, so every rank computes the same answer.
    ``interval_seconds`` depends on a clock: rank 0 decides and broadcasts, so ranks whose clocks
    disagree still save together (one small collective per call when enabled).

    Args:
        schedule: ``CheckpointConfig.schedule``: its ``interval_steps`` (save when ``step %
            interval_steps == 0``; ``None`` disables) and ``interval_seconds`` (save when this many
            seconds passed since the last save, rank 0's clock; ``None`` disables).
        collective: agreement helper of the training ranks.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self, schedule: ScheduleConfig, *, collective: Collective, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_steps = schedule.interval_steps
        self.interval_seconds = schedule.interval_seconds
        self.collective = collective
        self.clock = clock
        self.last_save_time = clock()

    def mark_saved(self) -> None:
        """Restart the ``interval_seconds`` clock (a save was just made)."""
        self.last_save_time = self.clock()

    def is_due(self, step: int) -> bool:
        """All ranks must call this with the same ``step``."""
        due = bool(self.interval_steps and step % self.interval_steps == 0)
        if self.interval_seconds is not None:
            by_time = self.clock() - self.last_save_time >= self.interval_seconds
            # Collective on every call so that all ranks always issue the same sequence.
            due = self.collective.broadcast(due or by_time)
        return due
