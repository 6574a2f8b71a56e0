"""Per-file checksums, computed by the rank that writes a file from the bytes it writes.

Hash: xxHash's XXH3-128 (https://xxhash.com): an order of magnitude faster than the write
itself, where a cryptographic hash (blake2b, sha256) runs slower than the disk writes and
would about double the save (docs/benchmarks.md, "Save" has the measured rates). It runs inside the
writer threads. It detects corruption, it is not a defence against a forger (the trust model
in README says so).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem
from typing_extensions import override

from .._errors import CheckpointCorruptError

__all__ = [
    "HASH_ALGORITHM",
    "MAX_BLOCK_BYTES",
    "MIN_BLOCK_BYTES",
    "BlockDigests",
    "BlockHasher",
    "WrittenFile",
    "new_hasher",
    "hash_file",
    "hash_blocks",
    "HashingFileSystem",
    "check_file",
    "describe_path",
]

HASH_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20

# Block digests (module docstring). Chosen by measurement (benchmarks/README.md, "Read
# amplification"): with 2 MiB stored shards a 2 -> 4 reshard reads 1.04x what it needs at 1 MiB
# (2.13x at 8 MiB), for 392 digests per 256 MiB; 8 MiB blocks keep big tensors at ~7 KB per GiB.
MIN_BLOCK_BYTES = 1 << 20
_HEX128 = re.compile(r"[0-9a-f]{32}")  # an xxh3-128 hexdigest
MAX_BLOCK_BYTES = 8 << 20
BLOCK_SPLIT = 8  # blocks per large write, within the bounds above


def new_hasher() -> Any:
    """A fresh incremental hasher of :data:`HASH_ALGORITHM` (``update(bytes)``, ``hexdigest()``)."""
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class BlockDigests:
    """The blocks of one file: ``ends[i]`` is the end offset of block ``i`` (block ``i`` starts
    at ``ends[i - 1]``, block 0 at 0; the last end is the file size) and ``hashes[i]`` its
    xxh3-128 hex digest."""

    ends: tuple[int, ...]
    hashes: tuple[str, ...]

    def valid_for(self, size_bytes: int) -> bool:
        """Whether these blocks tile a file of ``size_bytes`` exactly, with one xxh3-128 hex
        digest per block (integer ends, 32-hex-digit strings)."""
        return (
            len(self.ends) == len(self.hashes) > 0
            and self.ends[-1] == size_bytes
            and all(type(e) is int for e in self.ends)
            and all(isinstance(h, str) and _HEX128.fullmatch(h) for h in self.hashes)
            and all(b > a for a, b in zip((0,) + self.ends, self.ends))
        )


class BlockHasher:
    """Block digests of a file written front to back (see the module docstring for where blocks
    are cut). Feed every write with :meth:`update`; :meth:`finish` returns the blocks."""

    def __init__(self) -> None:
        self._hasher = new_hasher()
        self._start = self._pos = 0
        self._ends: list[int] = []
        self._hashes: list[str] = []

    def _cut(self) -> None:
        if self._pos > self._start:
            self._ends.append(self._pos)
            self._hashes.append(self._hasher.hexdigest())
            self._hasher.reset()
            self._start = self._pos

    def update(self, data: memoryview) -> None:
        """Hash one write (``data``: its bytes, a 1-D byte view)."""
        n = len(data)
        large = n >= MIN_BLOCK_BYTES
        if large:  # the write starts its own blocks
            self._cut()
            block = min(max(-(-n // BLOCK_SPLIT), MIN_BLOCK_BYTES), MAX_BLOCK_BYTES)
        else:
            block = MIN_BLOCK_BYTES
        i = 0
        while i < n:
            k = min(n - i, block - (self._pos - self._start))
            self._hasher.update(data[i : i + k])
            self._pos += k
            i += k
            if self._pos - self._start >= block:
                self._cut()
        if large:
            self._cut()

    def finish(self) -> BlockDigests:
        """The blocks of everything fed so far (the last one may be short)."""
        self._cut()
        return BlockDigests(tuple(self._ends), tuple(self._hashes))


class WrittenFile(tuple[int, str]):
    """``(size_bytes, digest)`` of a written file, also carrying its block digests as
    ``.blocks`` (``None`` for a file of at most ``MIN_BLOCK_BYTES``): it travels wherever the
    writers' ``(size, digest)`` pairs go (``fs.written``, the ranks' outcome exchange) without
    changing their shape, and the POSIX store puts the blocks into the manifest."""

    blocks: BlockDigests | None

    def __new__(cls, size_bytes: int, digest: str, blocks: BlockDigests | None = None) -> "WrittenFile":
        """The pair ``(size_bytes, digest)`` with ``blocks`` attached."""
        self = super().__new__(cls, (size_bytes, digest))
        self.blocks = blocks
        return self

    def __reduce__(self) -> Any:
        return (WrittenFile, (self[0], self[1], self.blocks))


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
    return (
        f"{owner} (a file of checkpoint {owner.parent.name}, which the incremental checkpoint "
        f"{parts[parts.index('..') - 1]} being read refers to)"
    )


def hash_blocks(path: str | os.PathLike, blocks: BlockDigests) -> tuple[str, int | None]:
    """One sequential pass over a file: its whole digest and the index of its first block whose
    digest differs from ``blocks`` (``None``: all match). ``blocks`` must tile the file."""
    whole = new_hasher()
    bad = None
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        start = 0
        for i, end in enumerate(blocks.ends):
            block = new_hasher()
            while start < end:
                n = f.readinto(memoryview(buf)[: min(_CHUNK, end - start)])
                if not n:
                    return whole.hexdigest(), i if bad is None else bad  # shorter than its blocks
                whole.update(memoryview(buf)[:n])
                block.update(memoryview(buf)[:n])
                start += n
            if bad is None and block.hexdigest() != blocks.hashes[i]:
                bad = i
    return whole.hexdigest(), bad


def check_file(
    path: str | os.PathLike,
    *,
    size_bytes: int,
    digest: str | None,
    blocks: BlockDigests | None = None,
    source: str = "manifest",
) -> None:
    """Compare a file with its manifest entry: size, then (when ``digest`` is given) the
    whole-file digest and, with ``blocks``, every block digest in the same pass. ``source``
    names the record the entry comes from in error messages (``"hash sidecar"`` for a plain
    DCP directory).

    Raises:
        CheckpointCorruptError: missing file, wrong size, wrong hash (expected vs actual), or a
            block digest that differs (the manifest's block list is wrong for these bytes, so a
            resharded load would refuse them).
    """
    path = Path(path)
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{describe_path(path)}: file listed in the {source} is missing", path=str(path)
        ) from None
    if actual_size != size_bytes:
        raise CheckpointCorruptError(
            f"{describe_path(path)}: size {actual_size} bytes, {source} expects {size_bytes} bytes (truncated?)",
            path=str(path),
        )
    if digest is None:
        return
    actual, bad = hash_blocks(path, blocks) if blocks is not None else (hash_file(path)[1], None)
    if actual != digest:
        raise CheckpointCorruptError(
            f"{describe_path(path)}: {HASH_ALGORITHM} {actual} does not match the {source}'s {digest} "
            "(bytes changed after the commit)",
            path=str(path),
        )
    if bad is not None and blocks is not None:
        lo, hi = (blocks.ends[bad - 1] if bad else 0), blocks.ends[bad]
        raise CheckpointCorruptError(
            f"{describe_path(path)}: bytes [{lo}, {hi}) (block {bad} of {len(blocks.ends)}) do not match the "
            "manifest's block digest although the whole file does: the manifest's block list is wrong, and a "
            "load that reads part of this file would refuse it",
            path=str(path),
        )


class _HashingStream:
    """Write-through proxy that hashes every byte written (writes are sequential in DCP), whole
    and per block."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.hasher = new_hasher()
        self.blocks = BlockHasher()
        self.size = 0

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        self.blocks.update(memoryview(data).cast("B"))
        n = self._raw.write(data)
        self.size += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP ``FileSystem`` that records ``{file name: (size_bytes, digest)}`` of files it writes
    (:class:`WrittenFile`: with the block digests of files larger than ``MIN_BLOCK_BYTES``).

    Set it as ``FileSystemWriter.fs``; thread-safe (DCP writes files from several threads).
    """

    def __init__(self) -> None:
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = _HashingStream(raw)
            yield hashing
        blocks = hashing.blocks.finish()
        entry = WrittenFile(
            hashing.size, hashing.hasher.hexdigest(), blocks if hashing.size > MIN_BLOCK_BYTES else None
        )
        with self._lock:
            self.written[Path(path).name] = entry

    def __getstate__(self) -> dict[str, Any]:
        # The process executor pickles the writer; locks do not pickle.
        return {"written": dict(self.written)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.written = state["written"]
        self._lock = threading.Lock()

    @override
    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP writes .metadata.tmp then renames it: keep the record under the final name.
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.written:
                self.written[Path(new_path).name] = self.written.pop(Path(path).name)
