"""Liveness of the ranks an entry check waits for (:meth:`Collective.arrive`).

A rank that is gone (its node lost, its worker killed) never makes the call the others wait
for, and nothing on the default group's store says so: the survivors would wait the whole
``coordination.arrival_timeout_s`` (600 s by default), while torchrun's agent on their node sees
healthy workers and restarts nothing. So each rank's manager runs a :class:`Heartbeat`, a daemon
thread that adds 1 to the store key ``alive/<group rank>`` every ``liveness_timeout_s / 6``
seconds on a connection of its own (``Store.clone``: a main thread blocked in a long store wait
does not hold it up), and a rank waiting in an entry check reads the missing ranks' counters
(:class:`LivenessWatch`). A counter that stood still for ``liveness_timeout_s`` marks its rank as
lost. Only the counter's movement counts, timed on the reader's clock: no clock is compared
across hosts. A rank that is slow but alive keeps counting (the thread needs the GIL for a
moment per beat: only a single call holding the GIL for ``liveness_timeout_s`` stops it).

Costs: one store request per rank per beat, on no step's path; nothing more while every rank
arrives within one beat period; past that, per waiting rank, one read of the ranks that arrived
and one existence check, then one ``multi_get`` of the missing ranks' counters per poll.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .._engine.blocking import describe_exception

__all__ = ["BEATS_PER_TIMEOUT", "Heartbeat", "LivenessWatch", "heartbeat_key"]

BEATS_PER_TIMEOUT = 6
"""Heartbeats per ``liveness_timeout_s``: a rank is taken for lost after this many missed beats."""
MIN_PERIOD_S = 0.1
"""Shortest heartbeat period (seconds), whatever ``liveness_timeout_s`` is."""
_log = logging.getLogger(__name__)


def heartbeat_key(rank: int) -> str:
    """The store key (under the collective's prefix) of group rank ``rank``'s heartbeat counter."""
    return f"alive/{rank}"


def beat_period_s(liveness_timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank."""
    return max(MIN_PERIOD_S, liveness_timeout_s / BEATS_PER_TIMEOUT)


class Heartbeat:
    """Adds 1 to ``alive/<rank>`` on ``store`` now and then every :func:`beat_period_s` seconds,
    from a daemon thread, until :meth:`stop` (or the process ends: the thread never keeps it
    alive). A failed request (the store unreachable) is logged once and retried at the next beat.

    Args:
        store: the collective's store (a ``PrefixStore`` over the default group's store).
        rank: this process's rank in the collective's group.
        liveness_timeout_s: ``coordination.liveness_timeout_s`` (seconds).
    """

    def __init__(self, store: Any, rank: int, *, liveness_timeout_s: float) -> None:
        self._stop = threading.Event()
        try:  # a connection of its own: the main thread's long store waits would delay each beat
            own = store.clone()
        except Exception:  # noqa: BLE001 - a store without clone: share the caller's connection
            own = store
        key = heartbeat_key(rank)
        try:  # the first beat before the constructor returns: the key exists before any save
            own.add(key, 1)
        except Exception as e:  # noqa: BLE001 - the waiting ranks then fall back to arrival_timeout_s
            _log.warning("distckpt heartbeat: the store refused %s: %s", key, describe_exception(e))
        self._thread = threading.Thread(
            target=_beat,
            args=(own, key, beat_period_s(liveness_timeout_s), self._stop),
            name="distckpt-heartbeat",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (the waiting ranks then take this rank for lost after ``liveness_timeout_s``). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # a beat in flight to an unreachable store is left to the daemon


def _beat(store: Any, key: str, period_s: float, stop: threading.Event) -> None:
    failing = False
    while not stop.wait(period_s):
        try:
            store.add(key, 1)
            failing = False
        except Exception as e:  # noqa: BLE001 - a daemon thread: log, retry at the next beat
            if not failing:
                _log.warning("distckpt heartbeat: %s failed (retrying): %s", key, describe_exception(e))
            failing = True


class LivenessWatch:
    """The waiting side of an entry check: which missing ranks' heartbeats stood still for
    ``liveness_timeout_s``.

    Nothing is read during the first beat period of the wait. Then :meth:`poll` reads the
    missing ranks once (``missing()``) and checks that their counters exist (a rank without one,
    e.g. of an older distckpt, is not watched: ``arrival_timeout_s`` alone applies to it), and at
    each call reads every watched counter with one ``multi_get``. A store request that fails
    (the store unreachable) counts as no news: that poll marks no rank as lost.

    Args:
        store: the collective's store.
        liveness_timeout_s: ``coordination.liveness_timeout_s`` (seconds).
        missing: the group ranks that have not made this entry check yet (one store request).
    """

    def __init__(self, store: Any, liveness_timeout_s: float, missing: Callable[[], list[int]]) -> None:
        self.store, self.timeout_s, self.missing = store, liveness_timeout_s, missing
        self.start = time.monotonic()
        self.ranks: list[int] | None = None  # watched group ranks; None until the first read
        self.seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (counter, when it last moved)

    def poll(self) -> list[int]:
        """Group ranks whose counter has not moved for ``liveness_timeout_s`` (usually none)."""
        now = time.monotonic()
        try:
            if self.ranks is None:
                if now - self.start < beat_period_s(self.timeout_s):
                    return []
                self.ranks = self._with_counters(self.missing())
                self.seen = {r: (None, now) for r in self.ranks}
            if not self.ranks:
                return []
            counters = self.store.multi_get([heartbeat_key(r) for r in self.ranks])
        except Exception as e:  # noqa: BLE001 - no news: the arrival timeout still bounds the wait
            _log.debug("liveness poll failed: %s", describe_exception(e))
            return []
        for rank, counter in zip(self.ranks, counters):
            if self.seen[rank][0] != counter:
                self.seen[rank] = (counter, now)
        return [r for r in self.ranks if now - self.seen[r][1] >= self.timeout_s]

    def forget(self, ranks: list[int]) -> None:
        """Stop watching ``ranks`` (they arrived after all)."""
        assert self.ranks is not None  # poll() named them
        self.ranks = [r for r in self.ranks if r not in ranks]

    def stood_still_s(self, rank: int) -> float:
        """Seconds since ``rank``'s counter last moved (or since the watch began)."""
        return time.monotonic() - self.seen[rank][1]

    def _with_counters(self, ranks: list[int]) -> list[int]:
        """The ranks among ``ranks`` with a heartbeat counter (a ``multi_get`` of a missing key
        would wait for it): one request when all have one."""
        if not ranks or self.store.check([heartbeat_key(r) for r in ranks]):
            return ranks
        return [r for r in ranks if self.store.check([heartbeat_key(r)])]
