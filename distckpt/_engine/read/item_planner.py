"""Per-item planning for :class:`~distckpt._engine.read.fast_reader.FastFileSystemReader`: turn one
stored item and this rank's requests of it into byte ranges added to a
:class:`~distckpt._engine.read.read_stream.ReadStream` -- header bytes to check, data straight into
the destinations or into buffers, trailers to check, small items whole.

The first big item of a stream is located by reading its first ``PEEK_BYTES``; later ones are
*predicted* (same header length as the previous item, a compact storage of the chunk size and
dtype that DCP's metadata records -- DCP clones views before saving) and checked after the read
against their real header and zip data descriptor; a mismatch re-decodes the item the stock way.

Internal to :mod:`distckpt._engine` (used by the fast reader's modules); the engine package does
not re-export these names and they may change without notice.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner

from ..safe_io import SafeLoadPlanner
from ..torch_format.save_format import (
    TRAILER_MAX,
    HeaderCache,
    NeedMoreBytes,
    TensorLayout,
    UnsupportedLayout,
    check_trailer,
    parse_torch_save_header,
)
from .item_decode import ItemDecoder
from .read_stream import (
    ReadRequest,
    ReadResults,
    ReadStream,
    StoredItem,
    check_sizes,
    covering_range,
    direct_ok,
    src_view,
    strided_view,
    typed_view,
    writable_view,
)

__all__ = ["PEEK_BYTES", "ChunkIndex", "ItemPlanner", "needed_bytes", "resolves_in_place"]

# Bytes of a big item read before its data: holds the zip local headers, data.pkl and the
# small records (the data of a tensor saved by torch 2.x starts at byte 704).
PEEK_BYTES = 4096


class ChunkIndex:
    """Saved size and dtype of every tensor chunk DCP's metadata records, built on first use.

    Args:
        metadata: DCP ``Metadata`` of the checkpoint (``None``: no chunk is known).
    """

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] | None = None

    def get(self, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        """``(size, dtype)`` of the chunk the ``MetadataIndex`` ``index`` names, or ``None``."""
        if self._chunks is None:
            chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
            for fqn, md in getattr(self._metadata, "state_dict_metadata", {}).items():
                if isinstance(md, TensorStorageMetadata):
                    for ch in md.chunks:
                        chunks[(fqn, tuple(ch.offsets))] = (tuple(ch.sizes), md.properties.dtype)
            self._chunks = chunks
        if index.offset is None:
            return None
        return self._chunks.get((index.fqn, tuple(index.offset)))


class ItemPlanner:
    """Adds the reads of one stored item to a stream (:meth:`add_item`).

    Args:
        decoder: decodes items read whole (small, bytes, transformed, or not understood).
        chunks: the checkpoint's chunk sizes and dtypes (for predictions).
        header_cache: the reader's parse cache.
        direct_min_bytes: items larger than this are read into their destinations directly;
            smaller ones are read whole and decoded from memory.
        results: the current ``read_data``'s results (items to re-decode, counters).
    """

    def __init__(
        self,
        decoder: ItemDecoder,
        chunks: ChunkIndex,
        header_cache: HeaderCache,
        direct_min_bytes: int,
        results: ReadResults,
    ) -> None:
        self.decoder = decoder
        self.chunks = chunks
        self.header_cache = header_cache
        self.direct_min_bytes = direct_min_bytes
        self.results = results

    def _predict(self, stream: ReadStream, st: StoredItem) -> TensorLayout | None:
        """The layout of ``st`` if it is like the stream's previous item: same header length,
        a compact storage of the chunk's size (DCP clones views before saving)."""
        if stream.hint is None:
            return None
        info = self.chunks.get(st.reqs[0].item.storage_index)
        if info is None:
            return None
        sizes, dtype = info
        data_offset, flags = stream.hint
        numel = 1
        for d in sizes:
            numel *= d
        nbytes = numel * dtype.itemsize
        if not 16 <= st.length - data_offset - nbytes <= TRAILER_MAX:
            return None
        strides, acc = [], 1
        for d in reversed(sizes):
            strides.append(acc)
            acc *= max(d, 1)
        sig = (dtype, tuple(sizes), tuple(reversed(strides)), 0)
        meta = self.header_cache.predicted_meta(sig)
        return TensorLayout(meta=meta, data_offset=data_offset, nbytes=nbytes, flags=flags, sig=sig)

    def add_item(self, stream: ReadStream, st: StoredItem) -> None:
        """Add the reads of ``st`` to ``stream`` (which may flush to locate its header).

        Raises:
            AssertionError: a destination's size differs from the stored chunk's (as DCP).
            CheckpointCorruptError: the file ends early (from the stream).
        """
        results = self.results
        # A per-item planner resolves each target only after the item's bytes are in memory.
        if st.is_bytes or st.descriptors or st.length <= self.direct_min_bytes or self.decoder.planner is not None:

            def whole_item(t, mv, st=st) -> None:
                self.decoder.decode_whole(st, mv, t)

            stream.add_scratch(st.offset, st.length, whole_item)
            return
        layout = self._predict(stream, st)
        if layout is not None:
            # Header predicted from the previous item of this stream and DCP's chunk metadata:
            # no extra request; the header is read in the same request as the data and
            # checked afterwards (a mismatch re-decodes the item the stock way).
            predicted = layout

            def verify(_t, mv, st=st, predicted=predicted) -> None:
                if not self.header_cache.same_layout(mv, predicted):
                    stream.hint = None
                    with results.lock:
                        results.redo.append(st)

            stream.add_scratch(st.offset, layout.data_offset, verify)
            peek, peek_len = b"", 0
        else:
            peek_len = min(PEEK_BYTES, st.length)
            holder: dict[str, bytes] = {}
            stream.add_scratch(st.offset, peek_len, lambda t, mv: holder.__setitem__("peek", bytes(mv)))
            stream.flush()
            peek = holder["peek"]
            try:
                layout = parse_torch_save_header(peek, self.header_cache)
            except (NeedMoreBytes, UnsupportedLayout):
                layout = None
            if layout is not None and layout.data_offset + layout.nbytes > st.length:
                layout = None
            if layout is None:  # the rest of the item into one buffer, then the stock decode
                rest = torch.empty(st.length, dtype=torch.uint8, device="cpu")
                rest_mv = writable_view(rest)
                rest_mv[:peek_len] = peek

                def whole(_t, _mv, st=st, rest=rest, rest_mv=rest_mv) -> None:
                    self.decoder.decode_whole(st, rest_mv, rest)

                if st.length > peek_len:
                    stream.add_view(st.offset + peek_len, rest_mv[peek_len:], keep=rest, cb=whole)
                else:
                    whole(None, rest_mv)
                return
            stream.hint = (layout.data_offset, layout.flags)
        peek_end = st.offset + peek_len
        data_abs = st.offset + layout.data_offset
        isz = layout.meta.element_size()
        # Needed byte ranges, one per request: direct into the destination, or a buffer.
        wants: list[tuple[int, int, ReadRequest, torch.Tensor | None, torch.Tensor]] = []
        for req in st.reqs:
            src = src_view(layout, req.item)
            check_sizes(req.item, req.tensor, src.size())
            if src.numel() == 0:
                continue
            if direct_ok(src, req.tensor):
                a = data_abs + int(src.storage_offset()) * isz
                wants.append((a, a + src.numel() * isz, req, None, src))
            else:
                lo, hi = covering_range(src)
                buf = torch.empty((hi - lo) * isz, dtype=torch.uint8, device="cpu")
                wants.append((data_abs + lo * isz, data_abs + hi * isz, req, buf, src))
        wants.sort(key=lambda w: w[0])
        overlapping = any(wants[i][0] < wants[i - 1][1] for i in range(1, len(wants)))
        if overlapping or any(w[0] < data_abs or w[1] > data_abs + layout.nbytes for w in wants):
            # Two requests read the same bytes: one buffer for the item's data.
            wants = []
            buf = torch.empty(layout.nbytes, dtype=torch.uint8, device="cpu")

            def all_reqs(_t, _mv, st=st, buf=buf, layout=layout) -> None:
                for req in st.reqs:
                    self.decoder.copy_from(layout, buf, 0, req)

            self._add_range(stream, data_abs, data_abs + layout.nbytes, buf, peek, st.offset, peek_end, cb=all_reqs)
        for a, b, req, want_buf, src in wants:
            if want_buf is None:
                dst = writable_view(req.tensor)
                results.count(direct_bytes=b - a)
                self._add_range(stream, a, b, req.tensor, peek, st.offset, peek_end, view=dst)
            else:
                lo = (a - data_abs) // isz

                def copy_out(_t, _mv, req=req, buf=want_buf, src=src, lo=lo) -> None:
                    view = strided_view(typed_view(buf, src.dtype), src, lo)
                    req.tensor.copy_(view)
                    results.count(copied_bytes=buf.numel())

                self._add_range(stream, a, b, want_buf, peek, st.offset, peek_end, cb=copy_out)
        data_end = data_abs + layout.nbytes
        trailer = st.end - data_end
        if 0 < trailer <= TRAILER_MAX:

            def check(_t, mv, st=st, layout=layout) -> None:
                if not check_trailer(mv, layout):
                    with results.lock:
                        results.redo.append(st)

            if data_end >= peek_end:
                stream.add_scratch(data_end, trailer, check)
            else:  # tiny item fully inside the peek (only when PEEK_BYTES >= item)
                check(None, memoryview(peek)[data_end - st.offset :])

    def joins_run(self, st: StoredItem) -> bool:
        """Whether ``st`` may be read and decoded in a run of equal neighbours
        (:meth:`add_run`): a small tensor item without transforms, one request, its target
        resolved up front."""
        return (
            not st.is_bytes
            and not st.descriptors
            and st.length <= self.direct_min_bytes
            and self.decoder.planner is None
            and len(st.reqs) == 1
            and st.reqs[0].target is not None
        )

    def add_run(self, stream: ReadStream, run: list[StoredItem]) -> None:
        """Add ``run`` -- items of one length that follow each other in the file, each
        :meth:`joins_run` -- as one read, decoded together
        (:meth:`~distckpt._engine.read.item_decode.ItemDecoder.decode_run`)."""
        if len(run) == 1:
            self.add_item(stream, run[0])
            return
        stream.add_scratch(run[0].offset, run[-1].end - run[0].offset, lambda _t, mv: self.decoder.decode_run(run, mv))

    def _add_range(
        self,
        stream: ReadStream,
        a: int,
        b: int,
        keep: torch.Tensor,
        peek: bytes,
        peek_off: int,
        peek_end: int,
        view: memoryview | None = None,
        cb: Callable[[torch.Tensor | None, memoryview], None] | None = None,
    ) -> None:
        """Fill ``[a, b)`` of the file into ``view`` (default: all of ``keep``): the part already
        in the peek is copied, the rest is added to the stream."""
        if view is None:
            view = writable_view(keep)
        head = max(min(b, peek_end) - a, 0)
        if head:
            view[:head] = memoryview(peek)[a - peek_off : a - peek_off + head]
        if b - a > head:
            stream.add_view(a + head, view[head:], keep=keep, cb=cb)
        elif cb is not None:
            cb(None, view)


def resolves_in_place(planner: LoadPlanner) -> bool:
    """Whether ``planner`` keeps ``DefaultLoadPlanner``'s ``resolve_tensor`` (with its
    ``lookup_tensor`` and ``transform_tensor``: views of its state dict; or
    ``SafeLoadPlanner``'s, the same tensors) and ``commit_tensor`` (a no-op), so resolving every
    request up front cannot be told from DCP's per-item order."""
    cls = type(planner)
    return all(
        getattr(cls, name, None) is getattr(DefaultLoadPlanner, name)
        or (name == "resolve_tensor" and getattr(cls, name, None) is SafeLoadPlanner.resolve_tensor)
        for name in ("resolve_tensor", "lookup_tensor", "transform_tensor", "commit_tensor")
    )


def needed_bytes(st: StoredItem, chunks: ChunkIndex) -> int:
    """Bytes of ``st`` this rank's requests read: the narrowed chunk of each tensor request (at
    most the item; element size of the resolved target, else of the stored chunk), the whole
    item for bytes."""
    if st.is_bytes:
        return st.length
    n = 0
    for r in st.reqs:
        if r.target is not None:
            isz = r.target.element_size()
        else:
            info = chunks.get(r.item.storage_index)
            isz = info[1].itemsize if info else 1
        n += math.prod(r.item.lengths) * isz
    return min(n, st.length)
