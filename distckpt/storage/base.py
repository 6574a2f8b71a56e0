"""The checkpoint-store protocol every storage backend implements.

The seam is at the level of what distckpt does with a root, not of file calls: *locations*
are strings (a directory path on POSIX, an ``s3://`` data prefix on S3) naming one checkpoint's
DCP files; the store maps a location to its manifest, writes and commits saves, lists,
validates and deletes checkpoints, and hands DCP a ``StorageWriter`` / ``StorageReader``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ..errors import CheckpointCorruptError
from ..ondisk.integrity import BlockDigests
from ..ondisk.manifest import FileEntry, Manifest

__all__ = ["CheckpointStore", "LockFile", "is_s3_url"]


def is_s3_url(root: str) -> bool:
    """Whether ``root`` names an S3 root (``s3://bucket[/prefix]``)."""
    return root.startswith("s3://")


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

    def prepare(self) -> None:
        """Rank 0: create the root / check the bucket. Raises ``ConfigError`` naming the root."""
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

    def dcp_writer(self, location: str, *, thread_count: int, write_timeout_s: float | None) -> Any:
        """A DCP ``StorageWriter`` whose ``fs.written`` maps each file it wrote to ``(size, xxh3_128)``."""
        ...

    def dcp_reader(self, location: str, *, expected_files: dict[str, tuple[int, str | None]] | None,
                   fast: bool, thread_count: int, block_digests: dict[str, BlockDigests] | None = None) -> Any:
        """A DCP ``StorageReader`` that verifies each file it reads against ``expected_files``
        (and, where the store reads ranges, the blocks it reads against ``block_digests``)."""
        ...

    def read_dcp_metadata(self, location: str) -> Any:
        """The checkpoint's DCP ``Metadata``, unpickled with the allow-list."""
        ...

    def check_file(self, location: str, name: str, *, size_bytes: int, digest: str | None) -> None:
        """Raise ``CheckpointCorruptError`` unless file ``name`` has that size (and digest)."""
        ...

    def list_files(self, pending: str, hashes: dict[str, tuple[int, str]]) -> list[FileEntry]:
        """Every file of a written save with sizes and the writers' hashes (rank 0)."""
        ...

    def commit(self, pending: str, step: int, manifest: Manifest,
               on_phase: Callable[[str], None] | None = None) -> str:
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

    def delete_checkpoint(self, step: int) -> None:
        """Retention: delete the committed checkpoint of ``step`` (crash-safe order)."""
        ...

    def remove_leftovers(self) -> list[str]:
        """Rank 0 holding the lock, at start: delete what interrupted saves/deletes left (only
        distckpt's own names). Returns what was removed."""
        ...

    def read_latest(self) -> str | None:
        """The name ``latest`` holds, or ``None``."""
        ...

    def repair_latest(self) -> str | None:
        """Point ``latest`` at the newest committed checkpoint if it names a missing one."""
        ...

    def lock_file(self) -> LockFile:
        """The root's lock object (:class:`~distckpt.storage.lock.RootLock` runs the protocol)."""
        ...
