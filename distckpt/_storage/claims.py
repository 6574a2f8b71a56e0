"""What a job may do with the checkpoints already in a root it did not write: refuse them or
archive them (``on_existing``), in one place for every store and every caller (the manager's
discovery, ``distckpt import``)."""

from __future__ import annotations

import logging
from typing import Literal

from .._errors import ConfigError
from .._ondisk.layout import checkpoint_name
from .base import CheckpointStore

__all__ = ["refuse_or_archive"]

logger = logging.getLogger(__name__)


def refuse_or_archive(
    store: CheckpointStore,
    *,
    on_existing: Literal["refuse", "archive"],
    locked: bool,
    subject: str,
    why: str,
    choices: str,
) -> list[str]:
    """Refuse a root that holds checkpoints, or set them all aside as ``archived-step-N-<n>``.

    Args:
        store: the root's store.
        on_existing: ``"refuse"`` or ``"archive"``.
        locked: whether the caller holds the root's lock (archiving renames what another job
            could be writing, so it needs the lock).
        subject: how the root is named in messages (``CheckpointConfig.root='/x'``).
        why: why the caller does not resume them (``"this run does not resume from them (load: false)"``).
        choices: what the user can do instead (setting them aside included); "or another root" follows.

    Returns:
        ``"<old> -> <new>"`` for each checkpoint set aside (empty when the root holds none).

    Raises:
        ConfigError: the root holds checkpoints and ``on_existing`` is ``"refuse"``, or archiving
            without the lock.
    """
    existing = store.committed_steps()
    if not existing:
        return []
    if on_existing != "archive":
        raise ConfigError(
            f"{subject} already holds {len(existing)} checkpoint(s), newest {checkpoint_name(existing[-1])}, "
            f"and {why}. Choose: {choices}; or another root."
        )
    if not locked:
        raise ConfigError(
            f"load.on_existing='archive' for {subject} needs coordination.lock: true: it renames "
            "checkpoints that another job could be writing"
        )
    moved = [f"{checkpoint_name(step)} -> {store.set_aside(step, 'archived')}" for step in existing]
    logger.warning(
        "on_existing=archive (%s): set aside the %d checkpoint(s) in %s, nothing deleted: %s",
        why,
        len(moved),
        store.root,
        ", ".join(moved),
    )
    return moved
