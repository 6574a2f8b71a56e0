"""``distckpt import`` into an object-storage root (``s3://bucket/prefix``): the same checkpoint
:func:`distckpt.tools.export.import_weights` commits on POSIX, by the same code
(:func:`distckpt.tools.export.import_into`) through the root's
:class:`~distckpt.storage.base.CheckpointStore` (data prefix, then the manifest PUT as a
conditional create); only the refuse-or-archive of existing checkpoints is object storage's."""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from ..errors import ConfigError
from ..storage import open_store
from .export import import_into

__all__ = ["import_to_store"]

logger = logging.getLogger(__name__)


def import_to_store(weights_path: str | os.PathLike, root: str, *, step: int = 0,
                    on_existing: Literal["refuse", "archive"] = "refuse") -> str:
    """:func:`~distckpt.tools.export.import_weights` into an ``s3://`` root.

    Returns:
        The committed checkpoint's location (its data-prefix URL).

    Raises:
        CheckpointNotFoundError, ValueError: as ``import_weights`` (the weights file).
        ConfigError: the bucket is missing or not accessible, or the root holds checkpoints
            and ``on_existing`` is ``"refuse"``.
        CheckpointLockedError: another job writes this root.
        CheckpointSaveError: never; a failed write or commit raises ``OSError`` /
            ``FileExistsError`` (the step is committed already) and leaves nothing committed.
    """
    store: Any = open_store(root)  # an S3Store: set_aside is object storage's

    def refuse_or_archive() -> None:
        existing = sorted(s for s, _, _ in store.find_committed())
        if existing and on_existing != "archive":
            raise ConfigError(f"{root} already holds {len(existing)} checkpoint(s), newest step {existing[-1]}: "
                              "a load: true run would resume those, not the import. Import into another root, "
                              "or archive them first (their manifests renamed archived-step-N-<n>)")
        moved = [store.set_aside(s, "archived") for s in existing]
        if moved:
            store.repair_latest()
            logger.warning("import: set aside the %d checkpoint(s) of %s: %s", len(moved), root, ", ".join(moved))

    return import_into(store, weights_path, step=step, before_write=refuse_or_archive)
