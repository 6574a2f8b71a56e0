"""The POSIX store: today's on-disk layout and rename-based commit (docs/design.md, sections 3-4),
reached through :class:`~distckpt.storage.base.CheckpointStore`. Every method delegates to
:mod:`distckpt.storage.commit` / :mod:`distckpt.engine`; nothing on disk changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ..engine import SafeFileSystemReader, read_dcp_metadata
from ..engine.blocking import hashing_writer
from ..errors import CheckpointCorruptError
from ..ondisk.integrity import BlockDigests, check_file
from ..ondisk.layout import LATEST, checkpoint_name, pending_name
from ..ondisk.manifest import FileEntry, Manifest
from . import commit as _commit
from .lock import PosixLockFile

__all__ = ["PosixStore"]


class PosixStore:
    """A checkpoint root directory (see :class:`~distckpt.storage.base.CheckpointStore`).

    Args:
        root: the directory (created by :meth:`prepare`).
    """

    kind = "posix"
    shared = False

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = Path(root)

    def prepare(self) -> None:
        """Not used by the manager (its discovery probes the directory); kept for tools."""
        self.path.mkdir(parents=True, exist_ok=True)

    def pending_location(self, step: int, save_id: str) -> str:
        return str(self.path / pending_name(step, save_id))

    def final_location(self, step: int, pending: str) -> str:
        return str(self.path / checkpoint_name(step))

    def begin_write(self, pending: str) -> None:
        Path(pending).mkdir(parents=True, exist_ok=True)

    def dcp_writer(self, location: str, *, thread_count: int, write_timeout_s: float | None) -> Any:
        return hashing_writer(location, thread_count=thread_count, write_timeout_s=write_timeout_s)

    def dcp_reader(self, location: str, *, expected_files: dict[str, tuple[int, str | None]] | None,
                   fast: bool, thread_count: int, block_digests: dict[str, BlockDigests] | None = None) -> Any:
        if fast:
            from ..engine.read.fast_reader import FastFileSystemReader

            return FastFileSystemReader(location, expected_files=expected_files, thread_count=thread_count,
                                        block_digests=block_digests)
        return SafeFileSystemReader(location, expected_files=expected_files)

    def read_dcp_metadata(self, location: str) -> Any:
        return read_dcp_metadata(location)

    def check_file(self, location: str, name: str, *, size_bytes: int, digest: str | None) -> None:
        check_file(Path(location) / name, size_bytes=size_bytes, digest=digest)

    def list_files(self, pending: str, hashes: dict[str, tuple[int, str]]) -> list[FileEntry]:
        entries = _commit.list_files(pending, hashes)
        for entry in entries:  # the block digests the writers recorded (integrity.WrittenFile)
            blocks = getattr(hashes.get(entry.path), "blocks", None)
            if isinstance(blocks, BlockDigests) and blocks.valid_for(entry.size_bytes):
                entry.block_ends, entry.block_hashes = list(blocks.ends), list(blocks.hashes)
        return entries

    def commit(self, pending: str, step: int, manifest: Manifest,
               on_phase: Callable[[str], None] | None = None) -> str:
        final = self.final_location(step, pending)
        _commit.commit(pending, final, manifest, on_phase=on_phase)
        return final

    def abort(self, pending: str) -> None:
        shutil.rmtree(pending, ignore_errors=True)

    def read_manifest(self, location: str) -> Manifest:
        return Manifest.read(location)

    def validate(self, location: str, *, check_hashes: bool = False) -> Manifest:
        return _commit.validate(location, check_hashes=check_hashes)

    def verify(self, location: str) -> list[CheckpointCorruptError]:
        return _commit.verify(location)

    def find_committed(self) -> list[tuple[int, str, Manifest | CheckpointCorruptError]]:
        return [(s, str(p), r) for s, p, r in _commit.find_committed(self.path)]

    def delete_checkpoint(self, step: int) -> None:
        _commit.delete_checkpoint(self.path / checkpoint_name(step))

    def remove_leftovers(self) -> list[str]:
        return _commit.remove_leftovers(self.path)

    def read_latest(self) -> str | None:
        try:
            return (self.path / LATEST).read_text().strip() or None
        except OSError:
            return None

    def repair_latest(self) -> str | None:
        return _commit.repair_latest(self.path)

    def lock_file(self) -> PosixLockFile:
        return PosixLockFile(os.path.join(self.root, ".lock"))
