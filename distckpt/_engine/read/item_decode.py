"""Decoding of stored items already in memory, for
:class:`~distckpt._engine.read.fast_reader.FastFileSystemReader`: copy a tensor item's needed bytes out
of a buffer into its destinations, or decode an item the way DCP's ``FileSystemReader`` does
(transforms, then ``torch.load(weights_only=True)``) when the fast path does not understand it.

Internal to :mod:`distckpt._engine` (used by the fast reader's modules); the engine package does
not re-export these names and they may change without notice.
"""

from __future__ import annotations

import io
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.planner import LoadPlanner

from ..torch_format.internals import narrow_tensor_by_index
from ..torch_format.save_format import HeaderCache, NeedMoreBytes, TensorLayout, UnsupportedLayout, check_trailer
from .read_stream import (
    ReadRequest,
    ReadResults,
    StoredItem,
    check_sizes,
    covering_range,
    direct_ok,
    src_view,
    strided_view,
    typed_view,
    writable_view,
)

__all__ = ["ItemDecoder"]


class ItemDecoder:
    """Decodes stored items held in memory into their requests' destinations, counting what it
    copies in ``results``.

    Args:
        transforms: the reader's ``_StorageReaderTransforms`` (stream transforms of items saved
            with extensions).
        header_cache: the reader's parse cache.
        results: the current ``read_data``'s results (byte items, counters).
        planner: ``None`` when every request's target was resolved up front; else the
            ``LoadPlanner`` whose ``resolve_tensor`` / ``commit_tensor`` are called around each
            request's copy, one request at a time (DCP's per-item contract).
    """

    def __init__(
        self, transforms: Any, header_cache: HeaderCache, results: ReadResults, planner: LoadPlanner | None = None
    ) -> None:
        self.transforms = transforms
        self.header_cache = header_cache
        self.results = results
        self.planner = planner

    def each_request(self, st: StoredItem) -> Iterator[ReadRequest]:
        """The requests of ``st``; with a per-item ``planner`` each is resolved before it is
        yielded and committed once the caller has copied into it (not when the copy raised)."""
        for req in st.reqs:
            if self.planner is None or st.is_bytes:
                yield req
                continue
            req.target = self.planner.resolve_tensor(req.item).detach()
            yield req
            self.planner.commit_tensor(req.item, req.target)

    def copy_from(
        self,
        layout: TensorLayout,
        base: torch.Tensor | None,
        base_data_off: int,
        req: ReadRequest,
        base_mv: memoryview | None = None,
    ) -> None:
        """Copy what ``req`` needs from the item data in ``base[base_data_off:]`` into its target
        (``base_mv``: the same bytes as a memoryview; ``base`` may then be ``None``).

        Raises:
            AssertionError: the destination's size differs from the stored chunk's (as DCP).
        """
        src = src_view(layout, req.item)
        check_sizes(req.item, req.tensor, src.size())
        if src.numel() == 0:
            return
        isz = layout.meta.element_size()
        if direct_ok(src, req.tensor):
            a = base_data_off + src.storage_offset() * isz
            n = src.numel() * isz
            data = base_mv if base_mv is not None else writable_view(base)  # type: ignore[arg-type]
            writable_view(req.tensor)[:] = data[a : a + n]
            self.results.count(copied_bytes=n)
            return
        if base is None:
            assert base_mv is not None  # one of the two is given
            base = torch.frombuffer(base_mv, dtype=torch.uint8)
        lo, hi = covering_range(src)
        u8 = base[base_data_off + lo * isz : base_data_off + hi * isz]
        view = strided_view(typed_view(u8, src.dtype), src, lo)
        req.tensor.copy_(view)
        self.results.count(copied_bytes=(hi - lo) * isz)

    def decode_whole(self, st: StoredItem, mv: memoryview, t: torch.Tensor | None = None) -> None:
        """Decode a whole stored item held in memory (``mv``, writable; ``t``: the same bytes as a
        uint8 tensor, made from ``mv`` when needed and not given): a bytes item goes to
        ``results``, a tensor item into its destinations.

        Raises:
            AssertionError: a destination's size differs from the stored chunk's (as DCP).
            Exception: what ``torch.load`` or a stream transform raises for bytes it cannot decode.
        """
        if st.is_bytes:
            if st.descriptors:
                data = self.transformed(st, mv).read(-1)
            else:
                data = bytes(mv)
            for req in st.reqs:
                self.results.add_bytes(req.item, data)
            return
        if not st.descriptors:
            try:
                layout = self.header_cache.parse(mv)
                end = layout.data_offset + layout.nbytes
                if end > len(mv) or not check_trailer(mv[end:], layout):
                    raise UnsupportedLayout("trailer")
            except (NeedMoreBytes, UnsupportedLayout):
                layout = None
            if layout is not None:
                if self.planner is None and len(st.reqs) == 1 and self._copy_whole(layout, mv, st.reqs[0]):
                    return
                for req in self.each_request(st):
                    self.copy_from(layout, t, layout.data_offset, req, mv)
                return
        self.stock_decode(st, mv)

    def decode_run(self, items: list[StoredItem], mv: memoryview) -> None:
        """Decode consecutive stored items of one length held in memory (``mv``: their bytes,
        writable), each with one resolved request: where every item has the first one's header
        and trailer bytes (the record writer's runs) and asks for the whole compact tensor, one
        copy of their data and one batched ``copy_`` into the targets; else item by item
        (:meth:`decode_whole`).

        Raises:
            AssertionError, Exception: as :meth:`decode_whole`.
        """
        if not self._copy_run(items, mv):
            length = items[0].length
            for i, st in enumerate(items):
                self.decode_whole(st, mv[i * length : (i + 1) * length])

    def _copy_run(self, items: list[StoredItem], mv: memoryview) -> bool:
        k, length = len(items), items[0].length
        try:
            layout = self.header_cache.parse(mv[:length])
        except (NeedMoreBytes, UnsupportedLayout):
            return False
        a, n = layout.data_offset, layout.nbytes
        if not layout.compact or a + n > length or not check_trailer(mv[a + n : length], layout):
            return False
        dtype, shape = layout.sig[0], layout.sig[1]
        targets = []
        for st in items:
            req = st.reqs[0]
            target, item = req.target, req.item
            if target is None or not target.is_cpu or item.lengths != shape or target.shape != shape:
                return False  # a device destination: item by item, through copy_from's own path
            if any(item.storage_offsets):
                return False
            targets.append(target)
        rows = torch.frombuffer(mv, dtype=torch.uint8).view(k, length)
        head, tail = rows[:, :a], rows[:, a + n :]
        if not (torch.equal(head, head[:1].expand(k, a)) and torch.equal(tail, tail[:1].expand(k, length - a - n))):
            return False  # not the framing of one layout (torch.save's own CRCs, another writer)
        if n:
            data = rows[:, a : a + n].contiguous().view(dtype).view(k, *shape)
            torch._foreach_copy_(targets, list(data.unbind(0)))
        self.results.count(copied_bytes=k * n)
        return True

    def _copy_whole(self, layout: TensorLayout, mv: memoryview, req: ReadRequest) -> bool:
        """:meth:`copy_from` of the common case in one copy, without its views: a request for the
        whole stored tensor (compact, as DCP saves it) into a plain contiguous CPU tensor of its
        dtype and size. ``False``: not that case, nothing done."""
        target, item, sig = req.target, req.item, layout.sig
        if (
            not layout.compact
            or type(target) is not torch.Tensor
            or item.lengths != sig[1]
            or any(item.storage_offsets)
            or target.dtype != sig[0]
            or target.shape != item.lengths
            or not target.is_cpu
            or not target.is_contiguous()
            or target.is_conj()
            or target.is_neg()
            or target.layout != torch.strided
        ):
            return False
        a, n = layout.data_offset, layout.nbytes
        if n:
            writable_view(target)[:] = mv[a : a + n]
        self.results.count(copied_bytes=n)
        return True

    def transformed(self, st: StoredItem, mv: memoryview) -> Any:
        """The item's bytes through its stream transforms (none: the bytes as they are)."""
        raw = io.BytesIO(bytes(mv))
        return self.transforms.transform_load_stream(st.reqs[0].item, st.descriptors, raw)

    def stock_decode(self, st: StoredItem, mv: memoryview) -> None:
        """What ``FileSystemReader.read_data`` does with a tensor item, from bytes in memory.

        Raises:
            AssertionError: a destination's size differs from the stored chunk's (as DCP).
            Exception: what ``torch.load(weights_only=True)`` raises for bytes it refuses.
        """
        self.results.count(fallback_items=1)
        stream = self.transformed(st, mv)
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
            stream.seek(0)
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        for req in self.each_request(st):
            view = narrow_tensor_by_index(tensor, req.item.storage_offsets, req.item.lengths)
            check_sizes(req.item, req.tensor, view.size())
            req.tensor.copy_(view)
