"""Preemption: SIGTERM on any rank -> every rank saves at the same step boundary.

The signal handler only sets a flag. The ranks agree on it with :class:`StepVote`, the one
collective of a step: a MAX all-reduce on distckpt's gloo group, started at the end of one step
boundary and read at the next, so a signal that reached one rank (as torchrun or SLURM may
deliver it) stops all ranks at the same step, no rank is left waiting in a collective, and a step
never waits for a round trip through every rank.
"""

from __future__ import annotations

import datetime
import logging
import queue
import signal
import threading
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._errors import DistCkptError

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


class Vote(NamedTuple):
    """What the ranks agreed at a step boundary (a tuple: built at every boundary, after the
    step's compute has evicted the interpreter's caches, where a frozen dataclass costs more).

    Attributes:
        preempt: some rank had received SIGTERM.
        due: rank 0's clock said a save is due (``interval_s``, ``interval_steps: auto``).
    """

    preempt: bool = False
    due: bool = False


_NOTHING = Vote()


class StepVote:
    """The ranks' one agreement per step, kept off the training thread.

    :meth:`start_next` hands two flags (SIGTERM seen here, rank 0's "a save is due") to a thread of
    the vote's own, which runs a MAX all-reduce of them on a gloo group of its own while the next
    step computes; :meth:`decide` reads the result at the next step boundary. So a boundary costs
    a hand-over and a wait that finds the vote done unless the step is shorter than the
    all-reduce (then it waits the difference, never more than the blocking all-reduce it
    replaces). Every rank starts and reads the same votes in the same order, and the group
    carries nothing else, so votes never interleave with the manager's other collectives; the
    price is that what a vote decides happens one step later (a SIGTERM's save, a clock-based
    save), which the preemption grace window covers. Nothing runs when nothing needs agreeing
    (preemption off and a step-count schedule): :meth:`decide` is then the pure
    ``interval_steps`` rule, as it is on one process, which reads its own flags at once.

    Args:
        collective: the training ranks' :class:`~distckpt._coord.collective.Collective` (its rank,
            and its ranks for the vote's group; collective at construction when voting).
        watcher: the SIGTERM watcher, or ``None`` when preemption is off.
        schedule: the save schedule (``SaveSchedule``: ``is_due``, ``propose``, ``clock_based``).
        timeout_s: the vote group's collective timeout (seconds).
    """

    def __init__(self, collective: Any, watcher: PreemptionWatcher | None, schedule: Any, *, timeout_s: float) -> None:
        self.watcher, self.schedule, self.rank = watcher, schedule, collective.rank
        self.voting = collective.group is not None and (watcher is not None or schedule.clock_based)
        self.group: Any = None
        self._requests: queue.SimpleQueue | None = None
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # a Vote or the exception of each request
        if self.voting:  # the same on every rank (the config is rank 0's): new_group is collective
            ranks = dist.get_process_group_ranks(collective.group)
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            self._requests = queue.SimpleQueue()
            # A daemon thread: one blocked on a dead peer never holds up the process's exit.
            threading.Thread(
                target=self._serve, args=(self._requests, self._results, self.group), name="distckpt-vote", daemon=True
            ).start()
        # One vote in flight at most. SimpleQueues, not Futures: the boundary runs after the step's
        # compute has evicted the interpreter's caches, and each Python-level lock costs there.
        self._pending = False

    @staticmethod
    def _serve(requests: queue.SimpleQueue, results: queue.SimpleQueue, group: Any) -> None:
        while (request := requests.get()) is not None:
            preempt, due = request
            try:
                # device="cpu" explicitly: under torch.set_default_device("cuda") gloo would get a CUDA tensor.
                flags = torch.tensor([int(preempt), int(due)], dtype=torch.int32, device="cpu")
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
                p, d = flags.tolist()
                results.put(Vote(bool(p), bool(d)))
            except BaseException as e:  # noqa: BLE001 - handed to decide()
                results.put(e)

    @property
    def _requested(self) -> bool:
        return self.watcher is not None and self.watcher.requested

    def decide(self, step: int) -> Vote:
        """What every rank does at ``step``'s boundary: preempt, else whether ``step`` is a save
        step (``interval_steps``, or the clock's answer voted at the previous boundary). Waits
        only while the previous boundary's vote is still running.

        Raises:
            DistCkptError: the previous vote's all-reduce failed (a rank gone, the group's timeout).
        """
        if not self.voting:
            return Vote(preempt=self._requested, due=self.schedule.is_due(step))
        voted = _NOTHING
        if self._pending:
            self._pending = False
            got = self._results.get()
            if isinstance(got, BaseException):
                raise DistCkptError(
                    f"the step vote of step {step - 1} failed ({got}): a rank is gone or stuck"
                ) from got
            voted = got
        due = self.schedule.is_due(step, voted.due)
        return voted if due == voted.due else Vote(voted.preempt, due)

    def start_next(self, step: int) -> None:
        """Start the vote the next boundary reads (every rank, after :meth:`decide` and any save
        of ``step``: rank 0's clock then proposes from the state after that save)."""
        if self._requests is None:
            return
        assert not self._pending, "StepVote.decide() must read the previous vote first"
        due = self.rank == 0 and self.schedule.propose(step)
        self._pending = True
        self._requests.put((self._requested, due))

    def uninstall(self) -> None:
        """Put back the SIGTERM handler the watcher replaced (``close``)."""
        if self.watcher is not None:
            self.watcher.uninstall()

    def close(self, *, tear_down: bool) -> None:
        """Stop voting. ``tear_down`` (every rank is closing): wait for the vote in flight and
        destroy the vote's group; else (leaving on an exception) let the thread go, as a peer may
        never join its all-reduce. Idempotent."""
        pending, requests, group = self._pending, self._requests, self.group
        self._pending, self._requests, self.group = False, None, None
        if requests is None:
            return
        requests.put(None)  # the thread ends after the vote in flight
        if tear_down:
            if pending:
                self._results.get()  # the vote in flight; its failure is moot: every rank is closing
            try:  # every rank past its last vote before any closes its end (gloo aborts otherwise)
                dist.barrier(group=group)
                dist.destroy_process_group(group)
            except Exception as e:  # noqa: BLE001 - closing; nothing is left to agree on
                logging.getLogger(__name__).warning("destroying the step vote's group failed: %s", e)
