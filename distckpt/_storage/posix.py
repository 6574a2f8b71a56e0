"""The POSIX store: today's on-disk layout and rename-based commit (docs/design.md, sections 3-4),
reached through :class:`~distckpt._storage.base.CheckpointStore` (and the tools' queries,
:class:`distckpt._tools.store_queries.ToolStore`). Every method delegates to
:mod:`distckpt._storage.commit` / :mod:`distckpt._engine`; nothing on disk changes."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from typing_extensions import override

from .._engine import SafeFileSystemReader
from .._engine.blocking import hashing_writer
from .._engine.torch_format.internals import format_tested
from .._errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError
from .._ondisk.digests import digests_name, encode_digests
from .._ondisk.integrity import BlockDigests, hash_file
from .._ondisk.layout import (
    LATEST,
    MANIFEST,
    checkpoint_dirs,
    checkpoint_name,
    is_deferred,
    is_deleting,
    is_pending,
    parse_set_aside,
    parse_step,
    pending_name,
)
from .._ondisk.manifest import FileEntry, Manifest
from . import commit as _commit
from .base import CheckpointStore, Others
from .incremental import References, delete_or_defer, reference_entries, reuse_for
from .lock import PosixLockFile

__all__ = ["PosixStore"]

logger = logging.getLogger(__name__)


class PosixStore(CheckpointStore):
    """A checkpoint root directory (see :class:`~distckpt._storage.base.CheckpointStore`).

    Args:
        root: the directory (created by :meth:`prepare`).
    """

    kind = "posix"
    shared = False

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = Path(root)

    @staticmethod
    def is_checkpoint_dir(path: str) -> bool:
        """Whether ``path`` looks like one checkpoint (manifest, ``.metadata`` or a ``step-N`` name)."""
        p = Path(path)
        return p.is_dir() and ((p / MANIFEST).exists() or (p / ".metadata").exists() or parse_step(p.name) is not None)

    def leftovers(self) -> list[str]:
        """Names of what :meth:`remove_leftovers` would remove (tools)."""
        names = [e.name for e in os.scandir(self.path)] if self.path.is_dir() else []
        return sorted(n for n in names if is_pending(n) or is_deleting(n))

    def prepare(self, *, read_only: bool = False) -> None:
        """Create the root and check that a file can be written in it (``read_only``: that it is
        a directory; nothing is written). Raises ``ConfigError`` naming the root and the OS error."""
        if read_only:
            if not self.path.is_dir():
                raise ConfigError(f"CheckpointConfig.root={self.root!r} (save.enabled: false) is not a directory")
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"CheckpointConfig.root={self.root!r} is not a writable directory: {e}") from e

    @override
    def pending_location(self, step: int, save_id: str) -> str:
        return str(self.path / pending_name(step, save_id))

    @override
    def final_location(self, step: int, pending: str) -> str:
        return str(self.path / checkpoint_name(step))

    @override
    def begin_write(self, pending: str) -> None:
        Path(pending).mkdir(parents=True, exist_ok=True)

    @override
    def dcp_writer(
        self,
        location: str,
        *,
        thread_count: int,
        write_timeout_s: float | None,
        incremental: tuple[int, int | None] | None = None,
    ) -> Any:
        reuse = None  # an incremental save reads what it may reuse when its write starts
        if incremental is not None:
            reuse = functools.partial(reuse_for, self.path, incremental[0], full_every=incremental[1])
        return hashing_writer(location, thread_count=thread_count, write_timeout_s=write_timeout_s, reuse=reuse)

    @override
    def dcp_reader(
        self,
        location: str,
        *,
        expected_files: dict[str, tuple[int, str | None]] | None,
        fast: bool,
        thread_count: int,
        block_digests: Mapping[str, BlockDigests] | None = None,
    ) -> Any:
        if fast and format_tested():  # another torch: the stock reader (engine/torch_internals.py)
            from .._engine.read.shared_read import SharingReader

            return SharingReader(
                location, expected_files=expected_files, thread_count=thread_count, block_digests=block_digests
            )
        return SafeFileSystemReader(location, expected_files=expected_files)

    @override
    def read_file(self, location: str, name: str) -> bytes:
        return (Path(location) / name).read_bytes()

    def object_sizes(self, location: str) -> dict[str, int]:
        """``{relative name: size in bytes}`` of every file under a checkpoint directory (tools)."""
        root = Path(location)
        return {name: (root / name).stat().st_size for name in _commit.own_files(root)}

    def manifest_path(self, location: str) -> str | None:
        """The manifest's path, for messages (tools)."""
        return str(Path(location) / MANIFEST)

    def named_step(self, location: str) -> int | None:
        """The step the directory's name says (tools: checked against the manifest)."""
        return parse_step(Path(location).name)

    @override
    def list_files(
        self, pending: str, hashes: dict[str, tuple[int, str]], *, references: bool = False
    ) -> list[FileEntry]:
        entries = _commit.list_files(pending, hashes)
        for entry in entries:  # the block digests the writers recorded (integrity.WrittenFile)
            if entry.hash is None:  # no writer reported it: hash it here
                logger.warning("no writer reported a hash for %s; hashing it on rank 0", entry.path)
                entry.hash = hash_file(Path(pending) / entry.path)[1]
            blocks = getattr(hashes.get(entry.path), "blocks", None)
            if isinstance(blocks, BlockDigests) and blocks.valid_for(entry.size_bytes):
                entry.block_ends, entry.block_hashes = list(blocks.ends), list(blocks.hashes)
        return entries + (reference_entries(pending) if references else [])

    @override
    def write_digests(self, pending: str, rank: int, files: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        out = {name: (int(entry[0]), str(entry[1])) for name, entry in files.items()}
        blocks = {n: b for n, e in files.items() if isinstance(b := getattr(e, "blocks", None), BlockDigests)}
        if not blocks and rank != 0:  # small files only: nothing to keep beside the manifest
            return out
        # Rank 0 always writes its own (empty with small files only): the cheap mark that a step-N
        # directory is distckpt's, so one that loses its manifest is told from a user's dcp.save (is_damaged).
        name = digests_name(rank)
        data, digest = encode_digests(rank, blocks)
        with open(Path(pending) / name, "wb") as f:  # durable before the commit, like DCP's files
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        out[name] = (len(data), digest)
        return out

    @override
    def committed_steps(self) -> list[int]:
        return [s for s, _ in _commit.existing_checkpoints(self.path)]

    @override
    def commit(self, pending: str, step: int, manifest: Manifest, on_phase: Callable[[str], None] | None = None) -> str:
        final = self.final_location(step, pending)
        _commit.commit(pending, final, manifest, on_phase=on_phase)
        return final

    @override
    def abort(self, pending: str) -> None:
        shutil.rmtree(pending, ignore_errors=True)

    @override
    def read_manifest(self, location: str) -> Manifest:
        return Manifest.read(location)

    @override
    def validate(self, location: str, *, check_hashes: bool = False) -> Manifest:
        return _commit.validate(location, check_hashes=check_hashes)

    def verify(self, location: str) -> list[CheckpointCorruptError]:
        """Every problem of one checkpoint (tools)."""
        return _commit.verify(location)

    @override
    def others(self) -> Others:
        unmanaged = [str(p) for p in _commit.unmanaged_step_dirs(self.path)]
        deferred = [str(p) for _, p in checkpoint_dirs(self.path) if is_deferred(p)]
        names = [e.name for e in os.scandir(self.path)] if self.path.is_dir() else []
        aside = sorted(n for n in names if parse_set_aside(n) is not None)
        damaged = [str(p) for p in _commit.damaged_step_dirs(self.path)]
        return Others(unmanaged=unmanaged, damaged=damaged, deferred=deferred, set_aside=aside, latest=self._latest())

    @override
    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        name = _commit.set_aside(self.path / checkpoint_name(step), reason).name
        _commit.repair_latest(self.path)
        return name

    @override
    def location_of(self, step: int) -> str:
        return str(self.path / checkpoint_name(step))

    @override
    def exists(self, location: str) -> bool:
        return Path(location).is_dir()

    @override
    def is_plain_dcp(self, location: str) -> bool:
        return not (Path(location) / MANIFEST).exists() and (Path(location) / ".metadata").exists()

    def delete_checkpoints(
        self,
        steps: list[int],
        *,
        before: Callable[[int], None] | None = None,
        remove: Callable[[Path], None] | None = None,
    ) -> list[str]:
        """Deletes, or defers while an incremental checkpoint refers to its files
        (:func:`~distckpt._storage.incremental.delete_or_defer`)."""
        return delete_or_defer(self.path, steps, before=before, remove=remove)

    def deferred_by(self, steps: list[int]) -> list[str]:
        """Names of the checkpoints of ``steps`` that :meth:`delete_checkpoints` would defer (tools)."""
        refs = References(self.path)
        for step in steps:
            refs.forget(checkpoint_name(step))
        return [checkpoint_name(s) for s in steps if refs.referenced(checkpoint_name(s))]

    def check_tool_root(self) -> None:
        """Raise ``CheckpointNotFoundError`` unless the root is an existing directory, not one checkpoint."""
        if not self.path.exists():
            raise CheckpointNotFoundError(f"{self.root}: no such checkpoint root")
        if not self.path.is_dir():
            raise CheckpointNotFoundError(f"{self.root}: not a directory (expected a checkpoint root)")
        if (self.path / MANIFEST).exists():
            raise CheckpointNotFoundError(f"{self.root} is a checkpoint directory; pass its root {self.path.parent}")

    @override
    def remove_leftovers(self) -> list[str]:
        removed = _commit.remove_leftovers(self.path)
        _commit.repair_latest(self.path)
        return removed

    def _latest(self) -> str | None:
        try:
            return (self.path / LATEST).read_text().strip() or None
        except OSError:
            return None

    @override
    def root_file(self, name: str) -> PosixLockFile:
        return PosixLockFile(os.path.join(self.root, name))
