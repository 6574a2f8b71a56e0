"""``torch.save`` bytes as DCP stores them: parse the zip local headers and ``data.pkl`` of one
stored tensor item without touching its data, to learn the exact file range of the raw storage.

A stored tensor item is an uncompressed zip (PyTorch's ``inline_container`` format) whose members
(``data.pkl``, ``byteorder``, ``data/0``, ...) are 64-byte aligned; ``data.pkl`` is unpickled
with torch's ``weights_only`` unpickler onto a *meta* storage. Parse results are cached per
reader in a bounded :class:`HeaderCache`.

Internal to :mod:`distckpt._engine` (used by the fast reader's modules); the engine package does
not re-export these names and they may change without notice.
"""

from __future__ import annotations

import io
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from .internals import weights_only_unpickler

__all__ = [
    "CACHE_ENTRIES",
    "TRAILER_MAX",
    "HeaderCache",
    "LruCache",
    "NeedMoreBytes",
    "TensorLayout",
    "UnsupportedLayout",
    "check_trailer",
    "parse_torch_save_header",
]

_MIB = 1 << 20
# Trailers (and predicted trailers) longer than this are not torch.save's (~900 bytes).
TRAILER_MAX = 1 * _MIB
# Entries per cache of a HeaderCache: a model's items share a handful of headers; the bound
# only matters for a pathological checkpoint with thousands of distinct shapes.
CACHE_ENTRIES = 4096
# The header parser only looks this far: a tensor's data.pkl is ~150-300 bytes, the small
# records (.format_version, .storage_alignment, byteorder) a few bytes each.
_PICKLE_MAX = 64 * 1024
_SMALL_RECORD_MAX = 4096
_LFH = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LFH_SIG = 0x04034B50
_DD_SIG = b"PK\x07\x08"


# ============================================================================ zip/pickle parsing
@dataclass
class TensorLayout:
    """Where a ``torch.save(tensor)`` blob keeps its data, learnt from its header alone.

    Attributes:
        meta: a meta tensor with the saved dtype, size, stride and storage offset.
        data_offset: offset of the storage bytes from the start of the blob.
        nbytes: size of the storage in bytes.
        flags: general-purpose flags of the storage's zip entry (bit 3: a data descriptor
            follows the data).
    """

    meta: torch.Tensor
    data_offset: int
    nbytes: int
    flags: int
    sig: tuple = ()  # (dtype, size, stride, storage offset), compared without touching torch
    compact: bool = False  # the data is exactly the tensor's elements, in order (set from meta)

    def __post_init__(self) -> None:
        m = self.meta
        if not self.sig:
            self.sig = (m.dtype, tuple(m.size()), tuple(m.stride()), m.storage_offset())
        self.compact = m.is_contiguous() and m.storage_offset() == 0 and m.numel() * m.element_size() == self.nbytes


class NeedMoreBytes(Exception):
    """The header extends past the bytes given."""


class UnsupportedLayout(Exception):
    """Not a layout the fast path decodes; use the stock path for this item."""


_MISSING = object()


class LruCache:
    """A mapping bounded to ``max_entries`` that forgets its least recently used entry; safe to
    share between the reader's stream threads.

    Raises:
        ValueError: ``max_entries`` is less than 1.
    """

    def __init__(self, max_entries: int = CACHE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = int(max_entries)
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value of ``key`` (now the most recently used), or ``default``."""
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Set ``key``; the least recently used entry goes when that makes one too many."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class HeaderCache:
    """Parse results of one reader, each cache bounded (:class:`LruCache`).

    A model's items share a handful of dtypes and shapes, and items of the same dtype and shape
    have byte-identical headers (torch's writer puts sizes and CRCs in data descriptors, after
    the data), so a model's thousands of items parse a few times.

    Attributes:
        pickles: ``data.pkl`` bytes -> ``(meta tensor, storage key, nbytes, sig)``.
        layouts: header bytes -> :class:`TensorLayout` (:meth:`parse`).
        heads: header bytes -> ``(data offset, nbytes, flags, sig)`` or ``None`` (:meth:`same_layout`).
        predicted: ``sig`` -> meta tensor of a predicted layout (:meth:`predicted_meta`).
    """

    def __init__(self, max_entries: int = CACHE_ENTRIES) -> None:
        self.pickles = LruCache(max_entries)
        self.layouts = LruCache(max_entries)
        self.heads = LruCache(max_entries)
        self.predicted = LruCache(max_entries)
        self._lengths: OrderedDict[int, None] = OrderedDict()  # data offsets seen, most recent last
        self._lock = threading.Lock()
        self._recent: tuple[tuple[bytes, TensorLayout], ...] = ()  # the last few parses, newest first

    def parse(self, buf: memoryview) -> TensorLayout:
        """:func:`parse_torch_save_header`, cached on the header bytes.

        The parse reads nothing past the data offset, so equal header bytes give an equal
        layout. Lookups try the few header lengths seen so far.

        Raises:
            NeedMoreBytes, UnsupportedLayout: as :func:`parse_torch_save_header` (never cached).
        """
        # Neighbouring items share a few headers (a parameter's optimizer state: a scalar step,
        # then moments of its shape): compared with those first, no lookup.
        recent = self._recent
        for head, layout in recent:
            if buf[: len(head)] == head:
                return layout
        layout = self._parse(buf)
        self._recent = ((bytes(buf[: layout.data_offset]), layout),) + recent[:3]
        return layout

    def _parse(self, buf: memoryview) -> TensorLayout:
        with self._lock:
            lengths = tuple(self._lengths)
        for n in reversed(lengths):
            if n <= len(buf):
                layout = self.layouts.get(bytes(buf[:n]))
                if layout is not None:
                    return layout
        layout = parse_torch_save_header(buf, self)
        self.layouts.put(bytes(buf[: layout.data_offset]), layout)
        with self._lock:
            self._lengths.pop(layout.data_offset, None)
            self._lengths[layout.data_offset] = None
            if len(self._lengths) > 8:
                self._lengths.popitem(last=False)
        return layout

    def same_layout(self, head: memoryview, predicted: TensorLayout) -> bool:
        """Whether the header bytes ``head`` describe exactly the ``predicted`` layout."""
        key = bytes(head)
        got = self.heads.get(key, _MISSING)
        if got is _MISSING:
            try:
                actual = parse_torch_save_header(head, self)
                got = (actual.data_offset, actual.nbytes, actual.flags, actual.sig)
            except (NeedMoreBytes, UnsupportedLayout):
                got = None
            self.heads.put(key, got)
        return got == (len(head), predicted.nbytes, predicted.flags, predicted.sig) and predicted.data_offset == len(
            head
        )

    def predicted_meta(self, sig: tuple) -> torch.Tensor:
        """A meta tensor for ``sig`` = ``(dtype, size, contiguous stride, 0)``, shared by the
        predicted layouts of equal chunks."""
        meta = self.predicted.get(sig)
        if meta is None:
            meta = torch.empty(sig[1], dtype=sig[0], device="meta")
            self.predicted.put(sig, meta)
        return meta


def _meta_from_pickle(pkl: bytes, cache: HeaderCache | None) -> tuple[torch.Tensor, str, int, tuple]:
    """Unpickle ``data.pkl`` with torch's ``weights_only`` unpickler onto a *meta* storage.

    Returns ``(meta tensor, storage key, storage nbytes, (dtype, size, stride, offset))``, cached
    in ``cache.pickles`` on the exact pickle bytes (unpickling is the costly part of a parse).
    """
    hit = cache.pickles.get(pkl) if cache is not None else None
    if hit is not None:
        return hit
    stream = io.BytesIO(pkl)
    storages: list[tuple[str, int]] = []

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] not in ("storage", b"storage"):
            raise UnsupportedLayout(f"persistent id {saved_id!r}")
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        storages.append((key, nbytes))
        untyped = torch.UntypedStorage(nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = weights_only_unpickler.Unpickler(stream, encoding="utf-8")
    # torch declares this per-instance pickle hook as a method; torch.serialization assigns it the same way.
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        obj = unpickler.load()
    except UnsupportedLayout:
        raise
    except Exception as e:  # noqa: BLE001 - anything odd: torch.load decides (and raises)
        raise UnsupportedLayout(f"data.pkl: {type(e).__name__}: {e}") from e
    if stream.tell() != len(pkl):
        raise UnsupportedLayout("data.pkl has trailing bytes")
    if len(storages) != 1 or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedLayout("not a plain tensor with one storage")
    if obj.layout != torch.strided or obj.is_quantized or obj.is_conj() or obj.is_neg() or obj.device.type != "meta":
        raise UnsupportedLayout("not a plain strided tensor")
    if any(s < 0 for s in obj.stride()):
        raise UnsupportedLayout("negative stride")
    meta = obj.detach()
    out = (
        meta,
        storages[0][0],
        storages[0][1],
        (meta.dtype, tuple(meta.size()), tuple(meta.stride()), meta.storage_offset()),
    )
    if cache is not None:
        cache.pickles.put(pkl, out)
    return out


def _record_size_by_descriptor(buf: memoryview, start: int, limit: int) -> int:
    """Size of a small stored record whose local header does not carry it (flag bit 3, which
    torch's writer sets on every record): the first data descriptor whose size matches the
    bytes before it and whose CRC-32 matches them too, or is 0 (``torch.save`` with its CRC
    switched off, as distckpt's writer does)."""
    window_end = min(len(buf), start + limit + 16)
    window = bytes(buf[start:window_end])
    pos = 0
    while True:
        p = window.find(_DD_SIG, pos)
        if p < 0 or p + 12 > len(window):
            if window_end < len(buf):
                raise UnsupportedLayout("small zip record without a size")
            raise NeedMoreBytes()
        crc, size = struct.unpack_from("<II", window, p + 4)
        if size == p and (crc == 0 or zlib.crc32(window[:p]) == crc):
            return size
        pos = p + 1


def _descriptor_len(buf: memoryview, pos: int, size: int) -> int:
    """Length of the data descriptor at ``pos`` for a record of ``size`` bytes (0: none fits)."""
    if pos + 4 <= len(buf) and buf[pos : pos + 4] == _DD_SIG:
        pos_sizes, sig = pos + 8, 4
    else:
        pos_sizes, sig = pos + 4, 0
    if pos_sizes + 8 <= len(buf):
        c32, u32 = struct.unpack_from("<II", buf, pos_sizes)
        if c32 == u32 == size:
            return sig + 12
    if pos_sizes + 16 <= len(buf):
        c64, u64 = struct.unpack_from("<QQ", buf, pos_sizes)
        if c64 == u64 == size:
            return sig + 20
    if pos_sizes + 16 > len(buf):
        raise NeedMoreBytes()
    return 0


def _zip64_sizes(extra: memoryview) -> tuple[int, int] | None:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, pos)
        if hid == 0x0001 and hlen >= 16:
            return struct.unpack_from("<QQ", extra, pos + 4)
        pos += 4 + hlen
    return None


def parse_torch_save_header(buf: bytes | bytearray | memoryview, cache: HeaderCache | None = None) -> TensorLayout:
    """Parse the start of a ``torch.save(tensor)`` blob up to its storage's data.

    Walks the zip local headers in order (``data.pkl``, small records, ``data/<key>``); each
    record's size comes from its local header, the pickle's own end (``data.pkl``) or a data
    descriptor whose CRC matches (small records).

    Args:
        buf: the blob's first bytes (at least up to the storage's data).
        cache: where unpickled ``data.pkl`` results are kept (``None``: not cached).

    Raises:
        NeedMoreBytes: ``buf`` ends before the storage's data starts.
        UnsupportedLayout: anything the fast path does not decode (the stock path will).
    """
    buf = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    pos = 0
    meta = key = None
    nbytes = 0
    byteorder: str | None = None
    while True:
        if pos + _LFH.size > len(buf):
            raise NeedMoreBytes()
        magic, _ver, flags, method, _t, _d, _crc, csize, usize, nlen, elen = _LFH.unpack_from(buf, pos)
        if magic != _LFH_SIG:
            raise UnsupportedLayout(f"no zip local header at {pos}")
        if method != 0 or flags & 0x1:
            raise UnsupportedLayout("compressed or encrypted zip entry")
        data_at = pos + _LFH.size + nlen + elen
        if data_at > len(buf):
            raise NeedMoreBytes()
        name = bytes(buf[pos + _LFH.size : pos + _LFH.size + nlen]).decode("utf-8", "replace")
        record = name.split("/", 1)[1] if "/" in name else name
        size: int | None = None
        if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF:
            z64 = _zip64_sizes(buf[pos + _LFH.size + nlen : data_at])
            if z64 is None:
                raise UnsupportedLayout("zip64 sizes missing")
            size = z64[1] if z64[1] else None
        elif not (flags & 0x8 and csize == 0 and usize == 0):
            if csize != usize:
                raise UnsupportedLayout("stored entry with different sizes")
            size = usize
        if record == "data.pkl":
            if meta is not None:
                raise UnsupportedLayout("two data.pkl records")
            if size is None:
                size = _record_size_by_descriptor(buf, data_at, _PICKLE_MAX)
            if data_at + size > len(buf):
                raise NeedMoreBytes()
            meta, key, nbytes, sig = _meta_from_pickle(bytes(buf[data_at : data_at + size]), cache)
        elif record.startswith("data/") and "/" not in record[5:]:
            if meta is None or record[5:] != key:
                raise UnsupportedLayout(f"unexpected storage record {record!r}")
            if size is not None and size != nbytes:
                raise UnsupportedLayout("storage size mismatch")
            if byteorder not in (None, sys.byteorder):
                raise UnsupportedLayout(f"byteorder {byteorder!r}")
            _dtype, size_, stride_, soff = sig
            numel = nbytes // max(_dtype.itemsize, 1)
            if all(size_):
                extent = soff + sum((s - 1) * st for s, st in zip(size_, stride_)) + 1
                if extent > numel:
                    raise UnsupportedLayout("tensor view outside its storage")
            return TensorLayout(meta=meta, data_offset=data_at, nbytes=nbytes, flags=flags, sig=sig)
        else:
            if size is None:
                size = _record_size_by_descriptor(buf, data_at, _SMALL_RECORD_MAX)
            if data_at + size > len(buf):
                raise NeedMoreBytes()
            if record == "byteorder":
                byteorder = bytes(buf[data_at : data_at + size]).decode("ascii", "replace")
        pos = data_at + size
        if flags & 0x8:
            dlen = _descriptor_len(buf, pos, size)
            if dlen == 0:
                raise UnsupportedLayout(f"bad data descriptor after {record!r}")
            pos += dlen


def check_trailer(buf: memoryview, layout: TensorLayout) -> bool:
    """``True`` when the bytes right after the storage data are the expected descriptor."""
    if not layout.flags & 0x8:
        return len(buf) == 0 or bytes(buf[:4]) in (b"PK\x03\x04", b"PK\x01\x02")
    try:
        return _descriptor_len(buf, 0, layout.nbytes) > 0
    except NeedMoreBytes:
        return False
