"""The stream engine of :class:`~distckpt._engine.read.fast_reader.FastFileSystemReader`: one file
(or one region of it) read front to back with coalesced ``preadv`` calls straight into the
destination tensors, hashed in file order; plus the plan structures and tensor helpers it uses.

Internal to :mod:`distckpt._engine` (used by the fast reader's modules); the engine package does
not re-export these names and they may change without notice.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ..._errors import CheckpointCorruptError, ReaderInvariantError
from ..torch_format.internals import narrow_tensor_by_index
from ..torch_format.save_format import TensorLayout

__all__ = [
    "WARM_GAP_BYTES",
    "ReadRequest",
    "ReadResults",
    "ReadStream",
    "StoredItem",
    "check_sizes",
    "covering_range",
    "direct_ok",
    "fstat_size",
    "page_cached",
    "read_item",
    "src_view",
    "strided_view",
    "typed_view",
    "writable_view",
]


def fstat_size(fd: int) -> int:
    """Size in bytes of the open file ``fd``."""
    return os.fstat(fd).st_size


# Gaps read through when the stream's range is already in the page cache.
WARM_GAP_BYTES = 64 * 1024


def page_cached(fd: int, start: int, end: int, probes: int = 5) -> bool:
    """Whether ``[start, end)`` looks page-cache resident: one-byte ``RWF_NOWAIT`` reads (which
    fail with ``EAGAIN`` instead of doing I/O) at a few points all succeed."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or end <= start:
        return False
    buf = bytearray(1)
    try:
        for k in range(probes):
            off = start + (end - 1 - start) * k // max(probes - 1, 1)
            if os.preadv(fd, [buf], off, flag) != 1:
                return False
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP/EINVAL: cannot tell
        return False
    return True


# preadv takes at most this many buffers per call.
try:
    _IOV_MAX = max(min(os.sysconf("SC_IOV_MAX"), 1024), 16)
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024


# ============================================================================ tensor helpers
def writable_view(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def typed_view(u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``u8`` (1-D uint8) reinterpreted as ``dtype``; copies into an aligned buffer if needed."""
    isz = dtype.itemsize
    if isz == 1 or u8.data_ptr() % isz == 0:
        try:
            return u8.view(dtype)
        except RuntimeError:
            pass
    out = torch.empty(u8.numel() // isz, dtype=dtype, device="cpu")
    out.view(torch.uint8).copy_(u8)
    return out


def strided_view(typed: torch.Tensor, src: torch.Tensor, lo: int) -> torch.Tensor:
    """``src``'s view over ``typed``, which holds storage elements ``[lo, ...)`` (``as_strided``
    offsets count from the start of the underlying storage, not of the view)."""
    return typed.as_strided(src.size(), src.stride(), typed.storage_offset() + src.storage_offset() - lo)


def src_view(layout: TensorLayout, req: ReadItem) -> torch.Tensor:
    """The part of the stored tensor (a meta view of ``layout``) that ``req`` reads."""
    return narrow_tensor_by_index(layout.meta, req.storage_offsets, req.lengths)


def covering_range(src: torch.Tensor) -> tuple[int, int]:
    """Element range ``[lo, hi)`` of the storage that ``src`` (a meta view) touches."""
    lo = int(src.storage_offset())  # int() only narrows torch's int | SymInt: meta sizes are ints
    if src.numel() == 0:
        return lo, lo
    hi = lo + int(sum((s - 1) * st for s, st in zip(src.size(), src.stride()))) + 1
    return lo, hi


def direct_ok(src: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether the bytes of ``src`` can be read straight into ``target``: both contiguous, same
    dtype, and ``target`` a plain CPU tensor."""
    return (
        src.is_contiguous()
        and target.device.type == "cpu"
        and target.dtype == src.dtype
        and target.is_contiguous()
        and not target.is_quantized
        and not target.is_conj()
        and not target.is_neg()
        and target.layout == torch.strided
        and type(target) is torch.Tensor
    )


def check_sizes(req: ReadItem, target: torch.Tensor, src_size: Sequence[int]) -> None:
    """DCP's own check that the destination has the size of what is read.

    Raises:
        AssertionError: the sizes differ (the message ``FileSystemReader`` gives).
    """
    if tuple(target.size()) != tuple(src_size):
        raise AssertionError(f"req {req.storage_index} mismatch sizes {tuple(target.size())} vs {tuple(src_size)}")


def read_item(fd: int, path: str, st: StoredItem) -> tuple[torch.Tensor, memoryview]:
    """The whole stored item ``st`` of the open file ``fd`` (named ``path``) as a new uint8
    tensor and a writable view of it.

    Raises:
        CheckpointCorruptError: the file ends before the item does.
    """
    buf = torch.empty(st.length, dtype=torch.uint8, device="cpu")
    mv = writable_view(buf)
    done = 0
    while done < st.length:
        n = os.preadv(fd, [mv[done:]], st.offset + done)
        if n <= 0:
            raise CheckpointCorruptError(
                f"{path}: truncated: short read at byte {st.offset + done} (item needs bytes up to {st.end})", path=path
            )
        done += n
    return buf, mv


# ============================================================================ plan structures
@dataclass
class ReadRequest:
    """One ``ReadItem`` of the plan and where its data goes."""

    item: ReadItem
    target: torch.Tensor | None  # resolved destination (tensor requests)

    @property
    def tensor(self) -> torch.Tensor:
        """``target`` of a tensor request (bytes requests have none and never reach tensor code)."""
        assert self.target is not None, f"{self.item.storage_index}: bytes request has no destination tensor"
        return self.target


@dataclass
class StoredItem:
    """One stored item (a ``_StorageInfo``) and the requests of this rank that read it."""

    relpath: str
    offset: int
    length: int
    descriptors: tuple[str, ...]
    is_bytes: bool
    reqs: list[ReadRequest] = field(default_factory=list)

    @property
    def end(self) -> int:
        """File offset just past the item (``offset + length``)."""
        return self.offset + self.length


@dataclass
class _Seg:
    off: int
    length: int
    view: memoryview | None  # None: arena scratch
    cb: Callable[[torch.Tensor | None, memoryview], None] | None = None
    keep: Any = None

    @property
    def end(self) -> int:
        return self.off + self.length


class ReadResults:
    """What the streams hand back to the calling thread (guarded by a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_items: list[tuple[ReadItem, bytes]] = []
        self.redo: list[StoredItem] = []
        self.stats = {
            "direct_bytes": 0,
            "copied_bytes": 0,
            "fallback_items": 0,
            "read_bytes": 0,
            "syscalls": 0,
            "needed_bytes": 0,
            "ranged_files": 0,
            "verified_blocks": 0,
        }

    def add_bytes(self, req: ReadItem, data: bytes) -> None:
        """Keep ``data``, the stored bytes of the bytes request ``req``, for the calling thread."""
        with self.lock:
            self.bytes_items.append((req, data))

    def count(self, **kw: int) -> None:
        """Add to the named counters of ``stats`` (bytes, syscalls, items)."""
        with self.lock:
            for k, v in kw.items():
                self.stats[k] += v


# ============================================================================ the stream engine
class ReadStream:
    """Reads one file (or one region of it) front to back with coalesced ``preadv`` calls.

    Segments are added in increasing file order; ``flush`` reads all pending ones, merging
    contiguous segments (and short gaps) into single requests, feeds the digest check in file
    order, then runs the segments' callbacks.

    Args:
        path: the file's path (in error messages); ``fd``: its open descriptor;
            ``file_size``: its size when opened.
        hasher: a digest check (:mod:`~distckpt._engine.read.read_verify`) fed every byte read, in
            file order; it also says which parts of a skipped gap must be read (``None``: no
            hashing).
        results: where byte counts and syscalls are counted.
        start: file offset of the first byte this stream reads (or hashes).
        chunk_bytes, max_request_bytes, gap_read_bytes: the reader's settings of the same
            names (:class:`~distckpt._engine.read.fast_reader.FastFileSystemReader`).
    """

    def __init__(
        self,
        path: str,
        fd: int,
        file_size: int,
        hasher: Any,
        results: ReadResults,
        start: int,
        *,
        chunk_bytes: int,
        max_request_bytes: int,
        gap_read_bytes: int,
    ) -> None:
        self.path, self.fd, self.file_size = path, fd, file_size
        self.hasher, self.results = hasher, results
        self.chunk_bytes, self.max_request_bytes = chunk_bytes, max_request_bytes
        self.pending: list[_Seg] = []
        self.pending_scratch = 0
        self.pending_total = 0
        self.pos = start  # end of the last byte handed to a read (or skipped)
        self.hint: tuple[int, int] | None = None  # (data offset, zip flags) of the last parsed item
        self.gap_read_bytes = gap_read_bytes
        self._arena: torch.Tensor | None = None
        self._junk: memoryview | None = None

    # -- adding work
    def add(self, seg: _Seg) -> None:
        """Queue ``seg`` (segments come in file order); flushes once the queued scratch bytes reach
        ``chunk_bytes`` or the queued bytes ``max_request_bytes``.

        Raises:
            ReaderInvariantError: ``seg`` starts before the end of the previous one.
        """
        if seg.length <= 0:
            return
        last_end = self.pending[-1].end if self.pending else self.pos
        if seg.off < last_end:
            raise ReaderInvariantError(f"{self.path}: overlapping reads at {seg.off} (< {last_end})")
        gap = seg.off - last_end
        if gap <= self.gap_read_bytes:  # read through into the arena
            self.pending_scratch += gap
            self.pending_total += gap
        self.pending.append(seg)
        self.pending_total += seg.length
        if seg.view is None:
            self.pending_scratch += seg.length
        if self.pending_scratch >= self.chunk_bytes or self.pending_total >= self.max_request_bytes:
            self.flush()

    def add_view(
        self,
        off: int,
        view: memoryview,
        keep: Any = None,
        cb: Callable[[torch.Tensor | None, memoryview], None] | None = None,
    ) -> None:
        """Queue a read of ``len(view)`` bytes at file offset ``off`` straight into ``view``, in parts of
        at most ``max_request_bytes``; ``cb(None, last part)`` runs once the last part is read, and
        ``keep`` (the owner of ``view``'s memory) stays referenced until then."""
        # Big destinations are split so hashing and callbacks interleave with the reads.
        step = self.max_request_bytes
        n = len(view)
        for s in range(0, n, step):
            last = s + step >= n
            self.add(_Seg(off + s, min(step, n - s), view[s : s + step], cb if last else None, keep))

    def add_scratch(self, off: int, length: int, cb: Callable[[torch.Tensor | None, memoryview], None] | None) -> None:
        """Queue a read of ``length`` bytes at file offset ``off`` into the stream's arena; ``cb(None,
        view)`` gets them (a writable memoryview, valid during the call only: the arena is reused)."""
        self.add(_Seg(off, length, None, cb))

    # -- reading
    def _arena_for(self, n: int) -> torch.Tensor:
        if self._arena is None or self._arena.numel() < n:
            self._arena = None
            self._arena = torch.empty(max(n, 64 * 1024), dtype=torch.uint8, device="cpu")
        return self._arena

    def _junk_view(self) -> memoryview:
        if self._junk is None:
            self._junk_t = torch.empty(self.chunk_bytes, dtype=torch.uint8, device="cpu")
            self._junk = writable_view(self._junk_t)
        return self._junk

    def _truncated(self, at: int) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.path}: truncated: the file ends at byte {self.file_size_now()}, but the "
            f"checkpoint's items need bytes up to {at} (short read)",
            path=self.path,
        )

    def file_size_now(self) -> int:
        """The file's size in bytes now (``fstat``; -1 when that fails), for the message of a short read."""
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return -1

    def _read_exact(self, off: int, views: list[memoryview]) -> None:
        views = [v for v in views if len(v)]
        total = sum(len(v) for v in views)
        done = 0
        i = 0
        while i < len(views):
            n = os.preadv(self.fd, views[i : i + _IOV_MAX], off + done)
            self.results.count(syscalls=1)
            if n <= 0:
                raise self._truncated(off + total)
            done += n
            while n > 0:
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0
        self.results.count(read_bytes=total)

    def _read_gap(self, start: int, end: int) -> None:
        """Read what the digest check needs of ``[start, end)``, only to hash it (resharding
        with hashes: bytes of other ranks; with block digests only their blocks' ends)."""
        junk = self._junk_view()
        for a, b in self.hasher.gap_parts(start, end):
            off = a
            while off < b:
                n = min(len(junk), b - off)
                self._read_exact(off, [junk[:n]])
                self.hasher.update(off, junk[:n])
                off += n

    def flush(self) -> None:
        """Read every queued segment: runs of contiguous segments (gaps of at most ``gap_read_bytes``
        read through) with one ``preadv`` each, longer gaps skipped or read only as far as the digest
        check needs; the bytes go to the digest check in file order, then the callbacks run.

        Raises:
            CheckpointCorruptError: the file ends early, or a block's digest differs (block digests).
        """
        segs, self.pending = self.pending, []
        self.pending_scratch = self.pending_total = 0
        if not segs:
            return
        # Arena space for scratch segments and for gaps read through.
        arena_need, pos = 0, self.pos
        for s in segs:
            if 0 < s.off - pos <= self.gap_read_bytes:
                arena_need += s.off - pos
            if s.view is None:
                arena_need += s.length
            pos = s.end
        arena = self._arena_for(arena_need) if arena_need else None
        arena_mv = writable_view(arena) if arena is not None else None
        a = 0
        # Runs of contiguous bytes, each read by one preadv (or a few, past _IOV_MAX); a long
        # gap ends a run (and is read only to be hashed, when hashing). Consecutive arena parts
        # (small items, gaps read through) are one buffer: one iovec and one hash update each.
        runs: list[tuple[int, int, list[memoryview]]] = []
        run_off: int | None = None
        iovs: list[memoryview] = []
        span = -1  # arena offset where the last iovec starts, when it is arena
        done: list[tuple[Callable[[torch.Tensor | None, memoryview], None], memoryview]] = []
        pos = self.pos
        for s in segs:
            gap = s.off - pos
            if gap > self.gap_read_bytes:
                if iovs:
                    assert run_off is not None  # set with a run's first part
                    runs.append((run_off, 0, iovs))
                runs.append((pos, gap, []))
                run_off, iovs, span = None, [], -1
            elif gap > 0:
                assert arena_mv is not None  # arena_need counted every gap read through
                if not iovs:
                    run_off = pos
                if span < 0:
                    span = a
                    iovs.append(arena_mv[a : a + gap])
                else:
                    iovs[-1] = arena_mv[span : a + gap]
                a += gap
            if not iovs:
                run_off, span = s.off, -1
            if s.view is None:
                assert arena_mv is not None  # arena_need counted every scratch segment
                mv = arena_mv[a : a + s.length]
                if span < 0:
                    span = a
                    iovs.append(mv)
                else:
                    iovs[-1] = arena_mv[span : a + s.length]
                a += s.length
            else:
                mv = s.view
                iovs.append(mv)
                span = -1
            if s.cb is not None:
                done.append((s.cb, mv))
            pos = s.end
        if iovs:
            assert run_off is not None  # set with a run's first part
            runs.append((run_off, 0, iovs))
        for off, skip, parts in runs:
            if skip:
                if self.hasher is not None:
                    self._read_gap(off, off + skip)
                continue
            self._read_exact(off, parts)
            if self.hasher is not None:
                for mv in parts:
                    self.hasher.update(off, mv)
                    off += len(mv)
        self.pos = pos
        for cb, mv in done:
            cb(None, mv)

    def finish_to(self, end: int) -> None:
        """Flush, then (hashing) read and hash everything up to ``end``."""
        self.flush()
        if self.hasher is not None and end > self.pos:
            self._read_gap(self.pos, end)
            self.pos = end
