"""Preemption: SIGTERM on any rank -> every rank saves at the same step boundary.

The signal handler only sets a flag. The ranks agree on it with :class:`StepVote`, the one
collective of a step: a MAX all-reduce on distckpt's gloo group, started at the end of one step
boundary and read at the next, so a signal that reached one rank (as torchrun or SLURM may
deliver it) stops all ranks at the same step, no rank is left waiting in a collective, and a step
never waits for a round trip through every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PreemptionWatcher", "StepVote", "Vote"]

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """Installs a SIGTERM handler (main thread only) and agrees on preemption across ranks.

    Args:
        group: the gloo group of the training ranks, or ``None`` without a process group.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.requested = False
        self.signal_time: float | None = None  # time.monotonic() of the first SIGTERM here
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self.installed = True
        else:
            self.installed = False
            logger.warning("not in the main thread: SIGTERM preemption handling is disabled")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self.signal_time is None:
            self.signal_time = time.monotonic()

    def seconds_since_signal(self) -> float:
        """Seconds since this rank's first SIGTERM (0 when it got none)."""
        return 0.0 if self.signal_time is None else time.monotonic() - self.signal_time

    def uninstall(self) -> None:
        """Put back the SIGTERM handler found at construction (no-op when it installed none, or when called again)."""
        if self.installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False


@dataclasses.dataclass(frozen=True)
class Vote:
    """What the ranks agreed at a step boundary.

    Attributes:
        preempt: some rank had received SIGTERM.
        due: rank 0's clock said a save is due (``interval_seconds``, ``interval_steps: auto``).
    """

    preempt: bool = False
    due: bool = False


class StepVote:
    """The ranks' one agreement per step, paid for without a round trip on the step's path.

    :meth:`start_next` launches a MAX all-reduce of two int32 flags (SIGTERM seen here, rank 0's
    "a save is due") with ``async_op=True`` at the end of step ``s``'s boundary; :meth:`decide`
    reads it at step ``s + 1``'s. The reduce runs in gloo's threads while step ``s + 1`` computes,
    so a boundary pays for starting one collective and for a wait that finds it done unless the
    step is shorter than the reduce (then it waits the difference, never more than the blocking
    all-reduce it replaces). Every rank starts and reads the same votes in the same order, which
    is what the collective needs; the price is that what a vote decides happens one step later
    (a SIGTERM's save, a clock-based save), which the preemption grace window covers. Nothing is
    started when nothing needs agreeing (preemption off and a step-count schedule): then
    :meth:`decide` is the pure ``interval_steps`` rule.

    Without a process group (one process) there is nothing to hide: :meth:`decide` reads this
    process's own flags at once.

    Args:
        group: distckpt's gloo group of the training ranks, or ``None`` (one process).
        watcher: the SIGTERM watcher, or ``None`` when preemption is off.
        schedule: the save schedule (``SaveSchedule``: ``is_due``, ``propose``, ``clock_based``).
        rank: this rank in ``group`` (rank 0's clock decides).
    """

    def __init__(self, group: Any, *, watcher: PreemptionWatcher | None, schedule: Any, rank: int) -> None:
        self.group, self.watcher, self.schedule, self.rank = group, watcher, schedule, rank
        self.voting = group is not None and (watcher is not None or schedule.clock_based)
        # One reused int32 buffer (at most one vote is in flight) and the four flag pairs to copy
        # into it: cheaper per step than building a tensor. device="cpu" explicitly: under
        # torch.set_default_device("cuda") gloo would otherwise get CUDA tensors.
        self._flags = torch.zeros(2, dtype=torch.int32, device="cpu")
        self._pairs = [torch.tensor([p, d], dtype=torch.int32, device="cpu") for p in (0, 1) for d in (0, 1)]
        self._work: Any = None

    @property
    def _requested(self) -> bool:
        return self.watcher is not None and self.watcher.requested

    def decide(self, step: int) -> Vote:
        """What every rank does at ``step``'s boundary: preempt, else whether ``step`` is a save
        step (``interval_steps``, or the clock's answer voted at the previous boundary). Waits
        only while the previous boundary's vote is still running."""
        if not self.voting:
            return Vote(preempt=self._requested, due=self.schedule.is_due(step))
        voted = Vote()
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
            preempt, due = self._flags.tolist()
            voted = Vote(preempt=bool(preempt), due=bool(due))
        return Vote(preempt=voted.preempt, due=self.schedule.is_due(step, voted.due))

    def start_next(self, step: int) -> None:
        """Start the vote the next boundary reads (every rank, after :meth:`decide` and any save
        of ``step``: rank 0's clock then proposes from the state after that save)."""
        if not self.voting:
            return
        assert self._work is None, "StepVote.decide() must read the previous vote first"
        due = self.rank == 0 and self.schedule.propose(step)
        self._flags.copy_(self._pairs[2 * self._requested + due])
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def uninstall(self) -> None:
        """Put back the SIGTERM handler the watcher replaced (``close``)."""
        if self.watcher is not None:
            self.watcher.uninstall()

    def drain(self) -> None:
        """Wait for a vote still in flight and drop it (``close``: the group is destroyed next)."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
