"""Single-process probes of the pure pieces of distckpt whose cost grows with the world size W,
for ``bench_scale``: replica placement (``distckpt.memory.placement``) and the manifest a save at
W ranks commits (``distckpt.ondisk.manifest``), at W far beyond what this machine can fork.

These probes import the modules under test directly (not only the public API): they time pure
functions on synthetic inputs, no process group, no disk beyond sparse files. Each probe is one
small function so that a change of the module's shape (another manifest layout, per-rank digest
files) touches one place here.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

__all__ = ["manifest_probe", "placement_probe"]

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
    from distckpt.memory.placement import NodeLayout, assign_replicated

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
