"""The checkpoint-store protocol every storage backend implements.

The seam is at the level of what distckpt does with a root, not of file calls: *locations*
are strings (a directory path on POSIX, an ``s3://`` data prefix on S3) naming one checkpoint's
DCP files; the store maps a location to its manifest, writes and commits saves, lists,
validates and deletes checkpoints, and hands DCP a ``StorageWriter`` / ``StorageReader``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Protocol

from ..errors import CheckpointCorruptError
from ..ondisk.integrity import BlockDigests
from ..ondisk.manifest import FileEntry, Manifest

__all__ = ["CheckpointStore", "LockFile", "is_s3_url", "split_location"]


def is_s3_url(root: str) -> bool:
    """Whether ``root`` names an S3 root (``s3://bucket[/prefix]``)."""
    return root.startswith("s3://")


def split_location(url: str) -> tuple[str, str | None]:
    """``(root, checkpoint location or None)`` of an ``s3://`` URL: a save's data prefix
    ``<root>/data/step-N-<id>`` names one checkpoint; anything else is taken as a root."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if parent.endswith("/data") and re.match(r"^step-\d{9,}-[0-9a-f]+$", name):
        return parent[: -len("/data")], url.rstrip("/")
    return url.rstrip("/"), None


class LockFile(Protocol):
    """The one object behind :class:`~distckpt.storage.lock.RootLock`: created exclusively, read,
    replaced in place and removed. ``where`` names it in messages."""

    where: str

    def create_exclusive(self, text: str) -> bool:
        """Create it holding ``text``; ``False`` when it already exists."""
        ...

    def read(self) -> str | None:
        """Its text, or ``None`` when absent."""
        ...

    def replace(self, text: str) -> None:
        """Overwrite it (lease renewal). Raises ``OSError`` on failure."""
        ...

    def remove(self) -> None:
        """Delete it; absent is fine."""
        ...


class CheckpointStore(Protocol):
    """One checkpoint root. Rank 0 alone commits, deletes and cleans; every rank reads.

    Attributes:
        root: the root as the user wrote it (messages).
        kind: ``"posix"`` or ``"s3"``.
        shared: whether every node sees the same root by construction (object storage):
            then no shared-root probe is needed.
    """

    root: str
    kind: str
    shared: bool

    def prepare(self, *, read_only: bool = False) -> None:
        """Rank 0: create the root and check it is writable / check the bucket (``read_only``:
        only that it exists). Raises ``ConfigError`` naming the root."""
        ...

    def pending_location(self, step: int, save_id: str) -> str:
        """Where a save of ``step`` writes its DCP files before the commit."""
        ...

    def final_location(self, step: int, pending: str) -> str:
        """The checkpoint location once the save of ``pending`` is committed."""
        ...

    def begin_write(self, pending: str) -> None:
        """Every rank, before DCP writes into ``pending`` (creates the directory on POSIX)."""
        ...

    def dcp_writer(self, location: str, *, thread_count: int, write_timeout_s: float | None, reuse: Any = None) -> Any:
        """A DCP ``StorageWriter`` whose ``fs.written`` maps each file it wrote to ``(size, xxh3_128)``;
        with ``reuse`` (an ``engine.incremental_writer.ReuseIndex`` or a callable giving one), an
        incremental save (POSIX only: ``ValueError`` elsewhere)."""
        ...

    def dcp_reader(
        self,
        location: str,
        *,
        expected_files: dict[str, tuple[int, str | None]] | None,
        fast: bool,
        thread_count: int,
        block_digests: dict[str, BlockDigests] | None = None,
    ) -> Any:
        """A DCP ``StorageReader`` that verifies each file it reads against ``expected_files``
        (and, where the store reads ranges, the blocks it reads against ``block_digests``)."""
        ...

    def read_dcp_metadata(self, location: str) -> Any:
        """The checkpoint's DCP ``Metadata``, unpickled with the allow-list."""
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

    def check_file(self, location: str, name: str, *, size_bytes: int, digest: str | None) -> None:
        """Raise ``CheckpointCorruptError`` unless file ``name`` has that size (and digest)."""
        ...

    def list_files(self, pending: str, hashes: dict[str, tuple[int, str]]) -> list[FileEntry]:
        """Every file of a written save with sizes and the writers' hashes (rank 0)."""
        ...

    def write_digests(self, pending: str, rank: int, files: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        """Every rank, after its write: keep the block digests of the files it wrote (``files``, the
        writer's ``{name: (size_bytes, xxh3_128)}``, :class:`~distckpt.ondisk.integrity.WrittenFile`
        with ``.blocks``) out of the manifest, in this rank's digest file (:mod:`distckpt.ondisk.digests`).

        Returns:
            ``{name: (size_bytes, xxh3_128)}`` to report for the manifest: ``files`` as plain pairs,
            plus the digest file when one was written. This default (object storage, whose reads
            fetch whole objects) writes none and drops the blocks.

        Raises:
            OSError: the digest file could not be written.
        """
        return {name: (int(entry[0]), str(entry[1])) for name, entry in files.items()}

    def block_digests(self, location: str, manifest: Manifest) -> dict[str, BlockDigests]:
        """``{relative path: BlockDigests}`` of a committed checkpoint's files: those in its
        manifest (older schemas) and those in the digest files it lists, each checked first.

        Raises:
            CheckpointCorruptError: a digest file is missing, changed or malformed.
        """
        return {f.path: b for f in manifest.files if (b := f.blocks()) is not None}

    def committed_steps(self) -> list[int]:
        """Steps that have a manifest, oldest first, from one listing (nothing validated): what
        retention compares with the checkpoints it already validated."""
        return [s for s, _ in self.existing()]

    def commit(self, pending: str, step: int, manifest: Manifest, on_phase: Callable[[str], None] | None = None) -> str:
        """Make a fully written save a committed checkpoint (rank 0); returns its location.
        Raises ``FileExistsError`` when ``step`` is already committed."""
        ...

    def abort(self, pending: str) -> None:
        """Remove what a failed save wrote (rank 0; never anything committed)."""
        ...

    def read_manifest(self, location: str) -> Manifest:
        """The manifest of a committed checkpoint. Raises ``CheckpointCorruptError``."""
        ...

    def validate(self, location: str, *, check_hashes: bool = False) -> Manifest:
        """Manifest, after checking every listed file (size; hash with ``check_hashes``)."""
        ...

    def verify(self, location: str) -> list[CheckpointCorruptError]:
        """Every problem of one checkpoint (manifest, sizes, hashes)."""
        ...

    def find_committed(self) -> list[tuple[int, str, Manifest | CheckpointCorruptError]]:
        """Every checkpoint, newest first, with its manifest or why it is invalid."""
        ...

    def existing(self) -> list[tuple[int, str]]:
        """``(step, location)`` of every checkpoint with a manifest (committed, or damaged after
        its commit), oldest first: the checkpoints of whatever run wrote the root."""
        ...

    def unmanaged(self) -> list[str]:
        """Locations of step names distckpt did not write (a plain ``dcp.save``): never loaded,
        deleted or overwritten."""
        ...

    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        """Rename checkpoint ``step`` to ``<reason>-step-N-<n>`` (``reason``: ``corrupt``,
        ``rolledback``, ``archived``): kept, never loaded, counted or deleted; its step can be
        saved again. Returns the new name, relative to the root."""
        ...

    def set_aside_names(self) -> list[str]:
        """Names of the set-aside checkpoints, relative to the root."""
        ...

    def step_of(self, location: str) -> int | None:
        """The step of ``location`` when it is one of this root's checkpoints (``None``: another root's)."""
        ...

    def location_of(self, step: int) -> str:
        """The location of this root's checkpoint of ``step`` (committed or not)."""
        ...

    def exists(self, location: str) -> bool:
        """Whether anything is stored at ``location``."""
        ...

    def is_plain_dcp(self, location: str) -> bool:
        """Whether ``location`` holds DCP files without a distckpt manifest (``distckpt import`` it)."""
        ...

    def delete_checkpoint(self, step: int) -> None:
        """Retention: delete the committed checkpoint of ``step`` (crash-safe order)."""
        ...

    def delete_checkpoints(
        self,
        steps: list[int],
        *,
        before: Callable[[int], None] | None = None,
        remove: Callable[[Any], None] | None = None,
    ) -> list[str]:
        """Retention (rank 0 or ``distckpt prune``, holding the lock): delete the checkpoints of
        ``steps``, oldest first, calling ``before(step)`` before each; on POSIX one an incremental
        checkpoint refers to is deferred, not deleted, and ``remove`` (the purger's ``submit``) removes the renamed
        directories' files in the background. Returns one line per action, for the log."""
        ...

    def deferred_by(self, steps: list[int]) -> list[str]:
        """Names of the checkpoints of ``steps`` that :meth:`delete_checkpoints` would defer (a
        kept incremental checkpoint refers to their files); changes nothing."""
        ...

    def check_tool_root(self) -> None:
        """Raise ``CheckpointNotFoundError`` unless the root exists and is a root (not one checkpoint)."""
        ...

    def reuse_index(self, step: int, *, full_every: int | None) -> Any:
        """What an incremental save of ``step`` may reuse (an ``engine.incremental_writer.ReuseIndex``;
        every rank calls it). ``ValueError`` on a store without incremental saves."""
        ...

    def reference_entries(self, pending: str) -> list[FileEntry]:
        """Manifest entries of earlier checkpoints' files a written incremental save refers to (rank 0)."""
        ...

    def remove_leftovers(self) -> list[str]:
        """Rank 0 holding the lock, at start: delete what interrupted saves/deletes left (only
        distckpt's own names). Returns what was removed."""
        ...

    def leftovers(self) -> list[str]:
        """Names (relative to the root) of what :meth:`remove_leftovers` would remove: saves in
        progress or interrupted. Changes nothing."""
        ...

    def read_latest(self) -> str | None:
        """The name ``latest`` holds, or ``None``."""
        ...

    def repair_latest(self) -> str | None:
        """Point ``latest`` at the newest committed checkpoint if it names a missing one."""
        ...

    def lock_file(self) -> LockFile:
        """The root's lock object (:class:`~distckpt.storage.lock.RootLock` runs the protocol)."""
        return self.root_file(".lock")

    def root_file(self, name: str) -> LockFile:
        """A small object ``name`` at the root, with the lock's operations (the interval journal
        ``.interval.json``, :mod:`distckpt.save.schedule`; written by rank 0 only)."""
        ...
