"""When to save: every N steps, every T seconds, or at the interval chosen from measurements
(``interval_steps: auto``, :mod:`distckpt._save.interval`), agreed by all ranks."""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from typing import Any, Callable, Protocol

from .._config import ScheduleConfig
from .._coord.collective import Collective
from .._errors import DistCkptError
from .._storage.base import CheckpointStore, LockFile
from .interval import COST_WINDOW, Decision, IntervalStats, choose_interval, robust_cost

__all__ = ["SaveSchedule", "AutoInterval", "ENDINGS", "JOURNAL", "JOURNAL_EVERY_S", "check_step"]


logger = logging.getLogger(__name__)

ENDINGS = ("periodic", "preempted", "final")
"""Kinds of save, recorded with the statistics: the kind of a run's newest save tells the next
start how that run ended (a ``periodic`` one: it crashed after it)."""

JOURNAL = ".interval.json"
"""The root's interval journal (rank 0 of an ``auto`` run writes it): the statistics as of now and
``ending: running`` while the run trains, so the next start counts a crash even before the
crashed run's first save, and its run time up to the last write."""
JOURNAL_EVERY_S = 60.0
"""Seconds between journal writes while training (also at the start and at every save)."""

STEP_WINDOW = 32  # step times kept for the step-time median
CHANGE = 0.05  # a relative change of the interval worth a log line


class _InFlight(Protocol):
    def running(self) -> bool: ...


class AutoInterval:
    """``interval_steps: auto``: the state of the choice on one rank (rank 0's decides).

    Call order: :meth:`resumed` after a load (or nothing on a fresh start); :meth:`due` at each
    step (the first call reads the journal: its statistics win over the loaded manifest's);
    :meth:`snapshot` when a save starts (the manifest records it); :meth:`saved` when the training
    loop gets control back (the save's cost).

    Args:
        schedule: ``mtbf_s``, ``min_interval_s``, ``max_overhead``.
        rank: logs on rank 0 only.
        clock: monotonic seconds (the interval, the costs, the step time).
        wall: unix seconds (run starts in the statistics).
        journal: the root's :data:`JOURNAL` (rank 0; ``None``: none, the manifests alone carry the
            statistics). Unreadable or unwritable: a warning, never an error.
    """

    def __init__(
        self,
        schedule: ScheduleConfig,
        *,
        rank: int,
        clock: Callable[[], float],
        wall: Callable[[], float],
        journal: LockFile | None = None,
    ) -> None:
        self.config, self.rank, self.clock, self.wall = schedule, rank, clock, wall
        self.journal = journal
        self.journal_written: float | None = None  # clock of the last write; None: not begun
        self._ending = "running"  # the kind of the save in progress, for the journal
        self.stats = IntervalStats()
        self.stats.start_after(None, now=wall())
        self.run_start = clock()
        self.last_end = clock()  # the interval counts training time from the end of the last save
        self.inflight: _InFlight | None = None
        self.step_times: list[float] = []
        self._last_step: tuple[int, float] | None = None
        self.decision: Decision | None = None
        self._logged: Decision | None = None
        self.decide()

    def resumed(self, saved: dict[str, Any] | None, *, source: str = "checkpoint") -> None:
        """A load restored a checkpoint whose manifest recorded ``saved`` (``Manifest.interval``), or
        :meth:`begin` read the journal (``source="journal"``): take over the statistics (costs, run
        time, failures) and count how the previous run ended."""
        self.stats = IntervalStats()
        ending = self.stats.start_after(saved, now=self.wall())
        if self.rank == 0 and ending != "none" and (self.journal is None or source == "journal"):
            logger.info(
                "interval statistics from the %s: previous run %s; %d failure(s), %d preemption(s) in %.0f s",
                source,
                ending,
                self.stats.failures,
                self.stats.preemptions,
                self.stats.exposure_s,
            )
        self.run_start = self.last_end = self.clock()
        self.decide()

    def decide(self) -> Decision:
        """Recompute the interval from the statistics; log it (rank 0) when it changed."""
        mtbf = self.stats.mtbf_s(self.config.mtbf_s, self.clock() - self.run_start)
        recent = self.stats.costs_s[-COST_WINDOW:]
        self.decision = choose_interval(
            robust_cost(recent),
            mtbf,
            min_interval_s=self.config.min_interval_s,
            max_overhead=self.config.max_overhead,
            ceiling_cost_s=max(recent, default=None),
        )
        if self.journal_written is not None or self.journal is None:  # rank 0 with a journal: once it is read
            self.log_change()
        return self.decision

    def log_change(self) -> None:
        """Rank 0: log the decision, the formula and its inputs when the interval changed by more than
        :data:`CHANGE` (or another bound decides) since the last logged one."""
        old, new = self._logged, self.decision
        if self.rank != 0 or new is None:
            return
        if old is None or old.formula != new.formula or abs(new.interval_s - old.interval_s) > CHANGE * old.interval_s:
            steps = f" (~{new.interval_s / self.stats.step_s:.0f} steps)" if self.stats.step_s else ""
            logger.info("checkpoint interval (interval_steps: auto): %s%s", new.describe(), steps)
            self._logged = new

    def begin(self) -> None:
        """Rank 0 with a journal, once (the first :meth:`due`): take the statistics over from the
        journal when it has them, and record this run as running."""
        saved = None
        try:
            text = self.journal.read() if self.journal is not None else None
            saved = json.loads(text) if text else None
        except (OSError, DistCkptError, ValueError) as e:
            logger.warning("interval journal %s unreadable (%s): statistics from the checkpoint", self._where, e)
        if isinstance(saved, dict):
            try:
                self.resumed(saved, source="journal")
            except ValueError as e:  # wrong types or ranges: as an unreadable journal
                logger.warning("interval journal %s invalid (%s): statistics from the checkpoint", self._where, e)
                self.stats = IntervalStats()
        self.write_journal("running")
        self.log_change()

    def write_journal(self, ending: str) -> None:
        """Rank 0: write the statistics as of now to the journal (``ending``: ``running`` while training)."""
        if self.journal is None:
            return
        self.journal_written = self.clock()
        try:
            self.journal.replace(json.dumps(self._record(ending)))
        except (OSError, DistCkptError) as e:
            logger.warning(
                "interval journal %s not written (%s); the next start reads the checkpoint's", self._where, e
            )

    @property
    def _where(self) -> str:
        return getattr(self.journal, "where", JOURNAL)

    def due(self, step: int) -> bool:
        """Rank 0's answer for ``step``: the interval has passed since the last save ended and no
        save is still in flight (an async save must be durable before the next one starts)."""
        if self.journal is not None and self.journal_written is None:
            self.begin()
        now = self.clock()
        if self.journal_written is not None and now - self.journal_written >= JOURNAL_EVERY_S:
            self.write_journal("running")
        if self._last_step is not None and step > self._last_step[0]:
            self.step_times = [*self.step_times, (now - self._last_step[1]) / (step - self._last_step[0])]
            self.step_times = self.step_times[-STEP_WINDOW:]
        self._last_step = (step, now)
        assert self.decision is not None  # set at construction
        busy = self.inflight is not None and self.inflight.running()
        return not busy and now - self.last_end >= self.decision.interval_s

    def snapshot(self, ending: str) -> dict[str, Any]:
        """The statistics for the manifest of a save of kind ``ending`` (:data:`ENDINGS`) starting now:
        this run's time so far added to the run time, and the decision with its inputs. The journal
        gets ``ending`` once the save returns (:meth:`saved`; a ``periodic`` save as ``running``).
        The interval restarts here too, so a save that fails is retried an interval later, not at
        every step."""
        self._ending = "running" if ending == "periodic" else ending
        self.last_end = self.clock()
        return self._record(ending)

    def _record(self, ending: str) -> dict[str, Any]:
        if self.step_times:
            self.stats.step_s = statistics.median(self.step_times)
        d = self.decision
        assert d is not None
        run_s = self.clock() - self.run_start
        stats = dataclasses.replace(self.stats, exposure_s=self.stats.exposure_s + run_s)
        return stats.to_dict(
            ending=ending,
            mtbf_prior_s=self.config.mtbf_s,
            min_interval_s=self.config.min_interval_s,
            max_overhead=self.config.max_overhead,
            **{f"decision_{k}": v for k, v in dataclasses.asdict(d).items()},
        )

    def saved(self, seconds: float, inflight: _InFlight | None) -> None:
        """A save returned to the training loop after ``seconds`` (the whole save when blocking,
        the stall when async; ``inflight``: the async save still writing, else ``None``)."""
        self.stats.record_cost(seconds)
        self.inflight = inflight
        self.last_end = self.clock()
        self._last_step = None  # the save's time is not a step time
        self.decide()
        if self.journal_written is not None:
            self.write_journal(self._ending)


class SaveSchedule:
    """Decides whether step ``step`` is a save step.

    ``interval_steps`` is a pure function of the step, so every rank computes the same answer.
    ``interval_s`` and ``interval_steps: auto`` depend on a clock: rank 0's answer
    (:meth:`propose`) travels in the step's vote and applies at the next step, so ranks whose
    clocks disagree still save together without a collective of their own.

    Args:
        schedule: ``CheckpointConfig.schedule``: its ``interval_steps`` (save when ``step %
            interval_steps == 0``; ``None`` disables; ``"auto"``: :class:`AutoInterval`) and
            ``interval_s`` (save when this many seconds passed since the last save, rank
            0's clock; ``None`` disables).
        collective: agreement helper of the training ranks.
        clock: monotonic seconds; injectable for tests.
        wall: unix seconds; injectable for tests.
        store: the root (``auto``: rank 0 keeps the :data:`JOURNAL` there); ``None``: no journal.
    """

    def __init__(
        self,
        schedule: ScheduleConfig,
        *,
        collective: Collective,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        store: CheckpointStore | None = None,
    ) -> None:
        auto = schedule.interval_steps == "auto"
        journal = store.root_file(JOURNAL) if auto and store is not None and collective.rank == 0 else None
        self.interval_steps: int | None = None if schedule.interval_steps == "auto" else schedule.interval_steps
        self.interval_s = schedule.interval_s
        self.collective = collective
        self.clock = clock
        self.last_save_time = clock()
        self.auto = (
            AutoInterval(schedule, rank=collective.rank, clock=clock, wall=wall, journal=journal) if auto else None
        )

    def mark_saved(self) -> None:
        """Restart the ``interval_s`` clock (a save was just made)."""
        self.last_save_time = self.clock()

    def resumed(self, saved_stats: dict[str, Any] | None) -> None:
        """A load restored a checkpoint (``saved_stats``: its manifest's ``interval``): restart the
        clocks; ``auto`` takes over the statistics."""
        self.mark_saved()
        if self.auto is not None:
            try:
                self.auto.resumed(saved_stats)
            except ValueError as e:  # a manifest's statistics of the wrong shape: start them over
                logger.warning("interval statistics of the loaded checkpoint ignored: %s", e)
                self.auto.resumed(None)

    def snapshot(self, ending: str) -> dict[str, Any] | None:
        """``auto``: the statistics a save of kind ``ending`` records in its manifest; else ``None``."""
        return self.auto.snapshot(ending) if self.auto is not None else None

    def saved(self, seconds: float, inflight: _InFlight | None = None) -> None:
        """A save gave the training loop back control after ``seconds`` (``auto`` measures ``C``)."""
        if self.auto is not None:
            self.auto.saved(seconds, inflight)

    @property
    def clock_based(self) -> bool:
        """Whether saves depend on rank 0's clock (``interval_s``, ``interval_steps: auto``):
        then the ranks must vote on them (:class:`~distckpt._save.preemption.StepVote`)."""
        return self.auto is not None or self.interval_s is not None

    def propose(self, step: int) -> bool:
        """This rank's clock-based answer after ``step`` (rank 0's is the one the ranks take):
        ``interval_s`` passed since the last save, or ``auto``'s interval (which also
        records the step time). ``False`` when saves do not depend on a clock."""
        if self.auto is not None:
            return self.auto.due(step)
        return self.interval_s is not None and self.clock() - self.last_save_time >= self.interval_s

    def is_due(self, step: int, voted: bool | None = None) -> bool:
        """Whether ``step`` is a save step: ``interval_steps`` divides it, or the clock says so.

        Args:
            step: optimizer steps completed; the same on every rank.
            voted: the clock's answer the ranks agreed on (rank 0's :meth:`propose` at the previous
                step boundary); ``None``: one process, which asks its own clock now.
        """
        due = bool(self.interval_steps and step % self.interval_steps == 0)
        if self.clock_based:
            due = due or (self.propose(step) if voted is None else voted)
        return due


def check_step(step: object, call: str) -> None:
    """``TypeError`` unless ``step``, the argument of ``CheckpointManager.<call>``, is an ``int``
    (a ``bool`` is not a step), before anything of the call runs."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(
            f"CheckpointManager.{call}(step={step!r}): step must be an int (the optimizer steps completed), "
            f"got {type(step).__name__}; pass int(step) for a tensor or a NumPy value"
        )
