"""Digest checks for :class:`~distckpt._engine.read.read_stream.ReadStream`: what a stream must read
to verify a file, and the check of the bytes it read.

* :class:`WholeFileCheck`: the file's xxh3-128 (the manifest's ``hash``) from every byte, in
  order; a stream that checks it reads the whole file (bytes this rank does not need are read
  only to be hashed).
* :class:`BlockCheck`: the file's block digests (the manifest's ``block_ends`` /
  ``block_hashes``, :mod:`distckpt._ondisk.integrity`): every block holding a byte the stream reads is
  read whole and verified when its last byte arrives; blocks with no byte this rank needs are
  not read at all (a reshard's ranged reads).

Both take the stream's bytes in file order (``update``) and say which parts of a skipped gap
must still be read (``gap_parts``) and how far the stream must read at its end (``end_after``).

Internal to :mod:`distckpt._engine` (used by the fast reader's modules); the engine package does
not re-export these names and they may change without notice.
"""

from __future__ import annotations

import bisect
import os

from ..._errors import CheckpointCorruptError, ReaderInvariantError
from ..._ondisk.integrity import HASH_ALGORITHM, BlockDigests, describe_path, new_hasher

__all__ = ["BlockCheck", "WholeFileCheck"]


class WholeFileCheck:
    """The whole-file digest, from every byte of the file in order.

    Args:
        path: the file (in error messages); ``file_size``: its size; ``digest``: the manifest's.
        source: the record ``digest`` comes from, in error messages (``"hash sidecar"``).
    """

    def __init__(self, path: str, file_size: int, digest: str, source: str = "manifest") -> None:
        self.path, self.file_size, self.digest, self.source = path, file_size, digest, source
        self._hasher = new_hasher()
        self._pos = 0

    def update(self, off: int, data: memoryview) -> None:
        """Hash ``data``, the bytes at ``off`` (must follow the previous bytes)."""
        if off != self._pos:
            raise ReaderInvariantError(f"{self.path}: hashed out of order at {off} (expected {self._pos})")
        self._hasher.update(data)
        self._pos += len(data)

    def gap_parts(self, start: int, end: int) -> list[tuple[int, int]]:
        """All of a skipped gap is read (to be hashed)."""
        return [(start, end)] if end > start else []

    def end_after(self, pos: int) -> int:
        """The stream reads to the end of the file."""
        return self.file_size

    def finish(self) -> None:
        """Raises:
        CheckpointCorruptError: the digest differs from the manifest's.
        """
        if self._pos != self.file_size:
            raise ReaderInvariantError(f"{self.path}: hashed {self._pos} of {self.file_size} bytes")
        actual = self._hasher.hexdigest()
        if actual != self.digest:
            raise CheckpointCorruptError(
                f"{describe_path(self.path)}: {HASH_ALGORITHM} {actual} does not match the {self.source}'s "
                f"{self.digest} (bytes changed after the commit)",
                path=self.path,
            )


class BlockCheck:
    """Block digests: each block the stream touches is read whole and verified.

    Args:
        path: the file (in error messages); ``blocks``: its block digests (they tile the file).
        source: the record ``blocks`` come from, in error messages (``"hash sidecar"``).
    """

    def __init__(self, path: str, blocks: BlockDigests, source: str = "manifest") -> None:
        self.path, self.blocks, self.source = path, blocks, source
        self._ends = blocks.ends
        self._hasher = new_hasher()
        self._cur: int | None = None  # block being hashed
        self._pos = 0  # next byte expected in that block
        self.verified = 0  # blocks verified
        self.verified_bytes = 0

    def _block(self, off: int) -> int:
        """Index of the block holding byte ``off``."""
        return bisect.bisect_right(self._ends, off)

    def _start(self, i: int) -> int:
        return self._ends[i - 1] if i else 0

    def update(self, off: int, data: memoryview) -> None:
        """Hash ``data``, the bytes at ``off``; verify each block it completes.

        Raises:
            CheckpointCorruptError: a completed block's digest differs from the manifest's.
        """
        n, i = len(data), 0
        while i < n:
            b = self._block(off + i)
            if b >= len(self._ends):
                raise ReaderInvariantError(f"{self.path}: read past the last block at {off + i}")
            if self._cur != b:
                if self._cur is not None or off + i != self._start(b):
                    raise ReaderInvariantError(f"{self.path}: block {b} not read from its start (byte {off + i})")
                self._cur, self._pos = b, off + i
                self._hasher.reset()
            if off + i != self._pos:
                raise ReaderInvariantError(f"{self.path}: hashed out of order at {off + i} (expected {self._pos})")
            k = min(n - i, self._ends[b] - self._pos)
            self._hasher.update(data[i : i + k])
            self._pos += k
            i += k
            if self._pos == self._ends[b]:
                self._check(b, self._hasher.hexdigest())
                self._cur = None

    def _check(self, b: int, actual: str) -> None:
        start, end = self._start(b), self._ends[b]
        if actual != self.blocks.hashes[b]:
            raise CheckpointCorruptError(
                f"{describe_path(self.path)}: bytes [{start}, {end}) (block {b} of {len(self._ends)}): "
                f"{HASH_ALGORITHM} {actual} does not match the {self.source}'s {self.blocks.hashes[b]} (bytes changed "
                "after the commit); load an older checkpoint (fallback_to_older) and run `distckpt verify` on "
                "this one",
                path=self.path,
            )
        self.verified += 1
        self.verified_bytes += end - start

    def gap_parts(self, start: int, end: int) -> list[tuple[int, int]]:
        """Of a gap ``[start, end)`` the stream skips: the rest of the block it is in at
        ``start`` and the head of the block where it resumes at ``end``; whole blocks between
        are not read."""
        parts = []
        tail_end = start
        if start < end and self._cur is not None:
            tail_end = min(end, self._ends[self._cur])
            parts.append((start, tail_end))
        if end < self._ends[-1]:
            head = max(self._start(self._block(end)), tail_end)
            if head < end:
                parts.append((head, end))
        return parts

    def end_after(self, pos: int) -> int:
        """Where the stream must read to at its end: the end of the block it is in."""
        return self._ends[self._cur] if self._cur is not None else pos

    def finish(self) -> None:
        """Check that no block was left read in part at the end of the stream.

        Raises:
            ReaderInvariantError: a block was read in part (a bug of the reader, not damage).
        """
        if self._cur is not None:
            raise ReaderInvariantError(f"{self.path}: block {self._cur} was read in part")

    def read_verified(self, fd: int, offset: int, length: int) -> bytearray:
        """Bytes ``[offset, offset + length)`` of the open file ``fd``, read with the blocks
        that cover them, each verified (for items decoded apart from the stream).

        Raises:
            CheckpointCorruptError: a block's digest differs, or the file ends early.
        """
        first, last = self._block(offset), self._block(max(offset + length - 1, offset))
        lo, hi = self._start(first), self._ends[min(last, len(self._ends) - 1)]
        buf = bytearray(hi - lo)
        view = memoryview(buf)
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], lo + done)
            if n <= 0:
                raise CheckpointCorruptError(
                    f"{describe_path(self.path)}: truncated: short read at byte {lo + done}", path=self.path
                )
            done += n
        check = BlockCheck(self.path, self.blocks)
        check.update(lo, view)
        return buf[offset - lo : offset - lo + length]
