"""Retention: which committed checkpoints to delete after a commit."""

from __future__ import annotations

__all__ = ["steps_to_delete"]


def steps_to_delete(
    committed_steps: list[int], *, keep_last: int | None, keep_every_steps: int | None,
    just_committed: int | None = None,
) -> list[int]:
    """Steps of committed checkpoints that retention removes.

    Args:
        committed_steps: steps of valid committed checkpoints (any order).
        keep_last: keep this many newest; ``None`` keeps all. The newest is always kept.
        keep_every_steps: steps that are multiples of this are kept forever.
        just_committed: the step the caller just committed: only older steps are counted and
            deleted, so neither it nor a newer checkpoint (left by another run) is ever deleted.

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
    return sorted(s for s in newest_first if s not in keep)
