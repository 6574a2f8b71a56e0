"""Retention: which committed checkpoints to delete after a commit."""

from __future__ import annotations

from typing import Iterable

from .._config import KeepBest
from .._errors import CheckpointCorruptError
from .._ondisk.manifest import Manifest
from .._storage import CheckpointStore, find_committed

__all__ = ["steps_to_delete", "best_steps", "KnownCheckpoints"]


def steps_to_delete(
    committed_steps: list[int],
    *,
    keep_last: int | None,
    keep_every_steps: int | None,
    just_committed: int | None = None,
    also_keep: Iterable[int] = (),
) -> list[int]:
    """Steps of committed checkpoints that retention removes.

    Args:
        committed_steps: steps of valid committed checkpoints (any order).
        keep_last: keep this many newest; ``None`` keeps all. The newest is always kept.
        keep_every_steps: steps that are multiples of this are kept forever.
        just_committed: the step the caller just committed: only older steps are counted and
            deleted, so neither it nor a newer checkpoint (left by another run) is ever deleted.
        also_keep: steps kept whatever ``keep_last`` says (the best-K of :func:`best_steps`).

    Returns:
        Steps to delete, oldest first. Uncommitted or corrupt directories are never counted.
    """
    if keep_last is None:
        return []
    if just_committed is not None:
        committed_steps = [s for s in committed_steps if s <= just_committed] + [just_committed]
    newest_first = sorted(set(committed_steps), reverse=True)
    keep = set(newest_first[: max(1, keep_last)])
    if keep_every_steps:
        keep.update(s for s in newest_first if s % keep_every_steps == 0)
    keep.update(also_keep)
    return sorted(s for s in newest_first if s not in keep)


def best_steps(metrics: dict[int, dict[str, float]], keep_best: KeepBest) -> list[int]:
    """The ``keep_best.k`` steps with the best ``keep_best.metric``, best first.

    Args:
        metrics: ``{step: {name: value}}`` of committed checkpoints (their manifests' metrics).
        keep_best: metric, ``min``/``max`` and ``k``.

    Returns:
        At most ``k`` steps. Ties: the earlier step wins. A step without the metric, or with
        a NaN, never counts.
    """
    sign = 1.0 if keep_best.mode == "min" else -1.0
    ranked = sorted((sign * v, s) for s, m in metrics.items() if (v := m.get(keep_best.metric)) is not None and v == v)
    return [s for _, s in ranked[: keep_best.k]]


class KnownCheckpoints:
    """Rank 0's memory of the root's committed checkpoints, each validated once: at its commit
    (this run's) or at the first retention that finds it (any other), so retention costs one
    listing per save, not a look at every file of every kept checkpoint (docs/design.md).
    A checkpoint found damaged stays ignored, as :func:`~distckpt._storage.generic.find_committed` reports it."""

    def __init__(self) -> None:
        self._known: dict[int, Manifest | CheckpointCorruptError] = {}

    def committed(self, store: CheckpointStore, *, new: tuple[int, Manifest] | None = None) -> dict[int, Manifest]:
        """``{step: manifest}`` of the valid committed checkpoints of ``store``.

        Args:
            new: ``(step, manifest)`` of the checkpoint just committed (already validated).
        """
        if new is not None:
            self._known[new[0]] = new[1]
        steps = store.committed_steps()
        if any(s not in self._known for s in steps):  # another process's, or this run's first save
            self._known.update({s: r for s, _, r in find_committed(store)})
        self._known = {s: self._known[s] for s in steps if s in self._known}  # forget deleted ones
        return {s: r for s, r in self._known.items() if isinstance(r, Manifest)}
