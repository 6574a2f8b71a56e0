"""The checkpoint-store protocol every storage backend implements: the runtime contract.

The seam is at the level of what distckpt does with a root, not of file calls: *locations*
are strings (a directory path on POSIX, an ``s3://`` data prefix on S3) naming one checkpoint's
DCP files; the store maps a location to its manifest, writes and commits saves, lists, validates
and deletes checkpoints, and hands DCP a ``StorageWriter`` / ``StorageReader``. What only the
tools ask (``distckpt verify`` / ``ls`` / ``prune``) is :mod:`distckpt._tools.store_queries`'s;
what every store gets from the contract is :mod:`distckpt._storage.generic`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Protocol

from .._ondisk.integrity import BlockDigests
from .._ondisk.manifest import FileEntry, Manifest

__all__ = ["CheckpointStore", "LockFile", "Others", "is_s3_url", "split_location"]


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
    """The one object behind :class:`~distckpt._storage.lock.RootLock`: created exclusively, read,
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


class Others(NamedTuple):
    """What a root holds besides its committed checkpoints (:meth:`CheckpointStore.others`).

    Attributes:
        unmanaged: locations of ``step-N`` names distckpt did not write (a plain ``dcp.save``):
            never loaded, deleted or overwritten.
        damaged: locations of ``step-N`` directories holding distckpt's files but no manifest
            (``no manifest (uncommitted or damaged)``; on S3 the data prefixes of the step
            ``latest`` names without its manifest): never loaded, deleted or overwritten; a load
            treats the newest as a corrupt checkpoint.
        deferred: locations of checkpoints retention retired while a kept incremental checkpoint
            refers to their files (POSIX): never loaded or counted.
        set_aside: names, relative to the root, of the checkpoints set aside
            (``<reason>-step-N-<n>``; ``manifests/...`` on S3).
        latest: the name ``latest`` holds, or ``None``: a hint, never the truth.
    """

    unmanaged: list[str]
    deferred: list[str]
    set_aside: list[str]
    latest: str | None
    damaged: list[str] = []  # a backend without the classification (third-party): none


class CheckpointStore(Protocol):
    """One checkpoint root: the runtime contract of a storage backend (what the manager's save,
    load, discovery and retention call; the tools' extra queries are
    :class:`distckpt._tools.store_queries.ToolStore`'s). Rank 0 alone commits, deletes and
    cleans; every rank reads.

    Call order, as the manager makes the calls:

    1. construction: rank 0 :meth:`prepare`; the lock (``RootLock``) on :meth:`root_file`
       ``(".lock")``; the interval journal on :meth:`root_file`.
    2. a save (``save/transaction.py``), every rank: :meth:`pending_location`,
       :meth:`final_location`, :meth:`begin_write`, :meth:`dcp_writer` (DCP writes through it),
       :meth:`write_digests`; then rank 0: :meth:`list_files`, :meth:`commit` (or, when any
       rank failed, :meth:`abort`).
    3. retention, rank 0 right after its commit: :meth:`committed_steps` (one listing per save),
       :func:`~distckpt._storage.generic.find_committed` (:meth:`location_of`, :meth:`validate`)
       for steps it has not validated yet, then :meth:`delete_checkpoints`.
    4. a load, rank 0 (``load/discovery.py``): holding the lock, :meth:`remove_leftovers`;
       :meth:`others` (warnings, refusing a root of corrupt checkpoints only),
       :meth:`committed_steps` / :meth:`location_of` / :meth:`read_manifest` (restarts, claims),
       :func:`~distckpt._storage.generic.find_committed` (the newest valid one), :meth:`exists` /
       :meth:`is_plain_dcp` / :meth:`validate` (``load.path``), :meth:`set_aside` (corrupt,
       archived, rolled back); then every rank (``load/loading.py``): rank 0
       :meth:`read_manifest` and :meth:`read_file` (``.metadata``, digest files), and
       :meth:`dcp_reader`.

    Attributes:
        root: the root as the user wrote it (messages).
        kind: ``"posix"`` or ``"s3"``.
        shared: whether every node sees the same root by construction (object storage):
            then no shared-root probe is needed.
    """

    root: str
    kind: str
    shared: bool

    # ------------------------------------------------------------------ setup
    def prepare(self, *, read_only: bool = False) -> None:
        """Rank 0: create the root and check it is writable / check the bucket (``read_only``:
        only that it exists). Raises ``ConfigError`` naming the root."""
        ...

    def root_file(self, name: str) -> LockFile:
        """A small object ``name`` at the root with the lock's operations: the lock ``.lock``
        (:class:`~distckpt._storage.lock.RootLock`) and the interval journal ``.interval.json``
        (:mod:`distckpt._save.schedule`; written by rank 0 only)."""
        ...

    # ------------------------------------------------------------------ save
    def pending_location(self, step: int, save_id: str) -> str:
        """Where a save of ``step`` writes its DCP files before the commit."""
        ...

    def final_location(self, step: int, pending: str) -> str:
        """The checkpoint location once the save of ``pending`` is committed."""
        ...

    def begin_write(self, pending: str) -> None:
        """Every rank, before DCP writes into ``pending`` (creates the directory on POSIX)."""
        ...

    def dcp_writer(
        self,
        location: str,
        *,
        thread_count: int,
        write_timeout_s: float | None,
        incremental: tuple[int, int | None] | None = None,
    ) -> Any:
        """A DCP ``StorageWriter`` whose ``fs.written`` maps each file it wrote to ``(size, xxh3_128)``.

        Args:
            incremental: ``(step, full_every)`` for an incremental save of ``step`` (items
                unchanged since the previous checkpoint are not written; POSIX only).

        Raises:
            ValueError: ``incremental`` on a store without incremental saves.
        """
        ...

    def write_digests(self, pending: str, rank: int, files: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        """Every rank, after its write: keep the block digests of the files it wrote (``files``, the
        writer's ``{name: (size_bytes, xxh3_128)}``, :class:`~distckpt._ondisk.integrity.WrittenFile`
        with ``.blocks``) out of the manifest, in this rank's digest file (:mod:`distckpt._ondisk.digests`).

        Returns:
            ``{name: (size_bytes, xxh3_128)}`` to report for the manifest: ``files`` as plain pairs,
            plus the digest file when one was written. This default (object storage, whose reads
            fetch whole objects) writes none and drops the blocks.

        Raises:
            OSError: the digest file could not be written.
        """
        return {name: (int(entry[0]), str(entry[1])) for name, entry in files.items()}

    def list_files(
        self, pending: str, hashes: dict[str, tuple[int, str]], *, references: bool = False
    ) -> list[FileEntry]:
        """Rank 0: every file of a written save with sizes and the writers' hashes; with
        ``references`` (an incremental save), also the earlier checkpoints' files it refers to."""
        ...

    def commit(self, pending: str, step: int, manifest: Manifest, on_phase: Callable[[str], None] | None = None) -> str:
        """Make a fully written save a committed checkpoint (rank 0); returns its location.
        Raises ``FileExistsError`` when ``step`` is already committed."""
        ...

    def abort(self, pending: str) -> None:
        """Remove what a failed save wrote (rank 0; never anything committed)."""
        ...

    # ------------------------------------------------------------------ listing
    def committed_steps(self) -> list[int]:
        """Steps of every checkpoint with a manifest (committed, or damaged after its commit),
        oldest first, from one listing (nothing validated): the checkpoints of whatever run wrote
        the root."""
        ...

    def others(self) -> Others:
        """Everything else the root holds that a run or a tool must know of (:class:`Others`),
        from one listing. Saves in progress and crash leftovers are not listed (see
        :meth:`remove_leftovers`)."""
        ...

    def location_of(self, step: int) -> str:
        """The location of this root's checkpoint of ``step`` (committed or not); its last
        component starts with ``step-<N>`` (:func:`~distckpt._storage.generic.step_of`)."""
        ...

    def exists(self, location: str) -> bool:
        """Whether anything is stored at ``location``."""
        ...

    def is_plain_dcp(self, location: str) -> bool:
        """Whether ``location`` holds DCP files without a distckpt manifest (``distckpt import`` it)."""
        ...

    # ------------------------------------------------------------------ read
    def read_manifest(self, location: str) -> Manifest:
        """The manifest of a committed checkpoint. Raises ``CheckpointCorruptError``."""
        ...

    def validate(self, location: str, *, check_hashes: bool = False) -> Manifest:
        """Manifest, after checking every listed file (size; hash with ``check_hashes``).
        Raises ``CheckpointCorruptError`` naming the first problem."""
        ...

    def read_file(self, location: str, name: str) -> bytes:
        """The bytes of a small file of a checkpoint (``.metadata``, a digest file), ``name``
        relative to ``location``. Raises ``FileNotFoundError`` when absent, ``OSError``."""
        ...

    def dcp_reader(
        self,
        location: str,
        *,
        expected_files: dict[str, tuple[int, str | None]] | None,
        fast: bool,
        thread_count: int,
        block_digests: Mapping[str, BlockDigests] | None = None,
    ) -> Any:
        """A DCP ``StorageReader`` that verifies each file it reads against ``expected_files``
        (and, where the store reads ranges, the blocks it reads against ``block_digests``)."""
        ...

    # ------------------------------------------------------------------ change (rank 0, holding the lock)
    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        """Rename checkpoint ``step`` to ``<reason>-step-N-<n>`` (``reason``: ``corrupt``,
        ``rolledback``, ``archived``): kept, never loaded, counted or deleted; its step can be
        saved again. ``latest`` then names a committed checkpoint (or is removed). Returns the
        new name, relative to the root."""
        ...

    def remove_leftovers(self) -> list[str]:
        """At start: delete what interrupted saves/deletes left (only distckpt's own names); a
        ``latest`` left naming nothing is repaired. Returns what was removed."""
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
