"""Per-file checksums, computed by the rank that writes a file from the bytes it writes.

Hash: xxHash's XXH3-128 (https://xxhash.com): an order of magnitude faster than the write
itself, where a cryptographic hash (blake2b, sha256) runs slower than the disk writes and
would about double the save (README "Benchmarks" has the measured rates). It runs inside the
writer threads. It detects corruption, it is not a defence against a forger (the trust model
in README says so).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from .errors import CheckpointCorruptError

__all__ = ["HASH_ALGORITHM", "new_hasher", "hash_file", "HashingFileSystem", "check_file", "describe_path"]

HASH_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


def new_hasher() -> Any:
    return xxhash.xxh3_128()


def hash_file(path: str | os.PathLike) -> tuple[int, str]:
    """``(size_bytes, hex digest)`` of a file, read sequentially in 8 MiB chunks."""
    hasher, size = new_hasher(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def describe_path(path: str | os.PathLike) -> str:
    """``path`` as an error message names it. A file reached through ``..`` -- an incremental
    checkpoint's reference to an earlier checkpoint's file -- names both checkpoints."""
    parts = Path(path).parts
    if ".." not in parts or parts.index("..") == 0:
        return str(path)
    owner = Path(os.path.normpath(path))
    return (f"{owner} (a file of checkpoint {owner.parent.name}, which the incremental checkpoint "
            f"{parts[parts.index('..') - 1]} being read refers to)")


def check_file(path: str | os.PathLike, *, size_bytes: int, digest: str | None) -> None:
    """Compare a file with its manifest entry.

    Raises:
        CheckpointCorruptError: missing file, wrong size, or wrong hash (expected vs actual).
    """
    path = Path(path)
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{describe_path(path)}: file listed in the manifest is missing",
                                     path=str(path)) from None
    if actual_size != size_bytes:
        raise CheckpointCorruptError(
            f"{describe_path(path)}: size {actual_size} bytes, manifest expects {size_bytes} bytes (truncated?)",
            path=str(path))
    if digest is None:
        return
    _, actual = hash_file(path)
    if actual != digest:
        raise CheckpointCorruptError(
            f"{describe_path(path)}: {HASH_ALGORITHM} {actual} does not match the manifest's {digest} "
            "(bytes changed after the commit)", path=str(path))


class _HashingStream:
    """Write-through proxy that hashes every byte written (writes are sequential in DCP)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.hasher = new_hasher()
        self.size = 0

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        n = self._raw.write(data)
        self.size += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP ``FileSystem`` that records ``{file name: (size_bytes, digest)}`` of files it writes.

    Set it as ``FileSystemWriter.fs``; thread-safe (DCP writes files from several threads).
    """

    def __init__(self) -> None:
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = _HashingStream(raw)
            yield hashing
        with self._lock:
            self.written[Path(path).name] = (hashing.size, hashing.hasher.hexdigest())

    def __getstate__(self) -> dict[str, Any]:
        # The process executor pickles the writer; locks do not pickle.
        return {"written": dict(self.written)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.written = state["written"]
        self._lock = threading.Lock()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP writes .metadata.tmp then renames it: keep the record under the final name.
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.written:
                self.written[Path(new_path).name] = self.written.pop(Path(path).name)
