"""Single-process probes of pure pieces of distckpt that no public call exposes. For
``bench_scale``, the ones whose cost grows with the world size W: replica placement
(``distckpt._memory.placement``) and the manifest a save at W ranks commits
(``distckpt._ondisk.manifest``), at W far beyond what this machine can fork. For
``bench_interval``, the ``interval_steps: auto`` schedule state on a simulated clock
(:class:`AutoIntervalProbe`) and the Young/Daly formulas it uses.

These probes, with ``benchmarks/manifest_size.py``, are the only benchmark code that imports
distckpt's internals (tests/unit/test_scripts.py checks it; each such import says why): they time
or drive pure functions on synthetic inputs, no process group, no disk beyond sparse files. Each
probe is one small function or class so that a change of the module's shape (another manifest
layout, per-rank digest files) touches one place here.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

__all__ = ["AutoIntervalProbe", "daly_interval", "manifest_probe", "placement_probe", "young_interval"]

RANKS_PER_NODE = 4


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def placement_probe(world_sizes: list[int], *, budget_s: float = 20.0, tensors: int = 256) -> list[dict[str, Any]]:
    """Per W: seconds one rank spends on its replica targets and sources (``NodeLayout``, one
    replica, nodes of 4 ranks) and on ``assign_replicated`` of ``tensors`` replicated tensors.

    A call is skipped (``None``) at every W after one that took longer than ``budget_s``: the
    quadratic ones would take minutes at W = 16,384.
    """
    from distckpt._memory.placement import NodeLayout, assign_replicated  # the placement under test; not public

    rows: list[dict[str, Any]] = []
    over: set[str] = set()
    sizes = {f"layer{i}.weight": 4096 * (1 + i % 7) for i in range(tensors)}
    for w in world_sizes:
        layout = NodeLayout(tuple(f"node{r // RANKS_PER_NODE}" for r in range(w)))
        rank = w - 1  # the last node: the ring's longest walk
        calls: dict[str, Callable[[], Any]] = {
            "targets_s": functools.partial(layout.targets, rank, 1),
            "sources_s": functools.partial(layout.sources, rank, 1),
            "assign_replicated_s": functools.partial(assign_replicated, sizes, w),
        }
        row: dict[str, Any] = {"world_size": w}
        for name, fn in calls.items():
            if name in over:
                row[name] = None
                continue
            row[name], _ = _timed(fn)
            if row[name] > budget_s:
                over.add(name)
        rows.append(row)
    return rows


def manifest_probe(world_sizes: list[int], *, bytes_per_rank: int = 8 << 30) -> list[dict[str, Any]]:
    """Per W: the size (bytes) of the manifest a save of ``bytes_per_rank`` per rank commits and the
    seconds rank 0 takes to build and serialise it, by :func:`benchmarks.manifest_size.manifest_size`
    (every rank's digest file, then the save's own ``list_files`` and ``to_json``; sparse files)."""
    from benchmarks.manifest_size import manifest_size

    rows = []
    for w in world_sizes:
        got = manifest_size(w, bytes_per_rank)
        rows.append(
            {
                "world_size": w,
                "bytes_per_rank": bytes_per_rank,
                "manifest_bytes": got["manifest_bytes"],
                "digest_bytes": got["digest_bytes"],
                "build_s": got["seconds"],
            }
        )
    return rows


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal interval (seconds) for save cost ``cost_s`` and MTBF ``mtbf_s``, as distckpt computes it."""
    from distckpt._save import interval  # the formulas interval_steps: auto uses; not public

    return interval.young_interval(cost_s, mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimal interval (seconds), as distckpt computes it."""
    from distckpt._save import interval  # the formulas interval_steps: auto uses; not public

    return interval.daly_interval(cost_s, mtbf_s)


class _Journal:
    """The root's journal in memory (``distckpt._save.schedule.JOURNAL``)."""

    where = "memory"

    def __init__(self) -> None:
        self.text: str | None = None

    def read(self) -> str | None:
        return self.text

    def replace(self, text: str) -> None:
        self.text = text

    def create_exclusive(self, text: str) -> bool:
        if self.text is not None:
            return False
        self.text = text
        return True

    def remove(self) -> None:
        self.text = None


class AutoIntervalProbe:
    """distckpt's schedule state on the simulated clock (a new one per run, as in a restarted job),
    with the root's journal: each start reads it, as rank 0 does at its first ``maybe_save``."""

    def __init__(self, clock: dict[str, float]) -> None:
        from distckpt import ScheduleConfig

        self.clock = clock
        self.config = ScheduleConfig(interval_steps="auto", min_interval_s=1.0, max_overhead=None)
        self.state: Any = None
        self.intervals: list[float] = []
        self.journal = _Journal()

    def start(self, now: float, saved: dict[str, Any] | None) -> None:
        # The schedule state the manager keeps for interval_steps: auto; no public call runs it on another clock.
        from distckpt._save.schedule import AutoInterval

        clock = lambda: self.clock["t"]  # noqa: E731
        self.state = AutoInterval(self.config, rank=1, clock=clock, wall=clock, journal=self.journal)
        self.state.begin()

    def failing(self, at: float) -> None:
        """The journal writes a run makes every ``JOURNAL_EVERY_S`` while it trains, up to a failure at ``at``."""
        assert self.state is not None and self.state.journal_written is not None
        last = self.state.journal_written
        from distckpt._save.schedule import JOURNAL_EVERY_S  # how often a training run rewrites the journal

        if at - last >= JOURNAL_EVERY_S:
            self.clock["t"] = last + JOURNAL_EVERY_S * math.floor((at - last) / JOURNAL_EVERY_S)
            self.state.write_journal("running")

    def interval(self) -> float:
        assert self.state is not None and self.state.decision is not None
        self.intervals.append(self.state.decision.interval_s)
        return self.state.decision.interval_s

    def snapshot(self) -> dict[str, Any] | None:
        assert self.state is not None
        return self.state.snapshot("periodic")

    def saved(self, cost_s: float) -> None:
        assert self.state is not None
        self.state.saved(cost_s, None)
