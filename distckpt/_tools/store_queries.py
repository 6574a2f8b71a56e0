"""What the tools (``distckpt verify`` / ``ls`` / ``prune``, the audit) ask of a store beyond the
runtime contract (:class:`~distckpt._storage.base.CheckpointStore`): a narrow protocol that the
POSIX and S3 stores implement, where the two differ (a directory's files and names vs a data
prefix's objects and a manifest elsewhere; incremental references on POSIX only). A backend
that implements only the runtime contract serves the manager; the tools then refuse it with
:class:`~distckpt._errors.ConfigError`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .._errors import CheckpointCorruptError, ConfigError
from .._storage import CheckpointStore

__all__ = ["ToolStore", "tool_store"]


@runtime_checkable
class ToolStore(CheckpointStore, Protocol):
    """A store the tools can inspect: the runtime contract plus these queries."""

    def check_tool_root(self) -> None:
        """Raise ``CheckpointNotFoundError`` unless the root exists and is a root (not one checkpoint)."""
        ...

    def verify(self, location: str) -> list[CheckpointCorruptError]:
        """Every problem of one checkpoint (manifest, every file's size and hash), not just the first."""
        ...

    def object_sizes(self, location: str) -> dict[str, int]:
        """``{relative name: size in bytes}`` of every file stored under a checkpoint's location."""
        ...

    def manifest_path(self, location: str) -> str | None:
        """Where the manifest of ``location`` is, for messages (``None``: no separate name)."""
        ...

    def named_step(self, location: str) -> int | None:
        """The step a checkpoint's name says, to check against its manifest (``None``: the
        store checks it when it parses the manifest)."""
        ...

    def leftovers(self) -> list[str]:
        """Names (relative to the root) of what ``remove_leftovers`` would remove: saves in
        progress or interrupted. Changes nothing."""
        ...

    def deferred_by(self, steps: list[int]) -> list[str]:
        """Names of the checkpoints of ``steps`` that ``delete_checkpoints`` would defer (a kept
        incremental checkpoint refers to their files); changes nothing."""
        ...


def tool_store(store: CheckpointStore) -> ToolStore:
    """``store`` as a :class:`ToolStore`.

    Raises:
        ConfigError: the store implements only the runtime contract (names the missing queries).
    """
    if isinstance(store, ToolStore):
        return store
    missing = sorted(n for n in ToolStore.__dict__ if not n.startswith("_") and not hasattr(store, n))
    raise ConfigError(
        f"{store.root}: its store ({type(store).__name__}) implements only the runtime contract; "
        f"distckpt's tools need {', '.join(missing)} (distckpt._tools.store_queries.ToolStore)"
    )
