"""``torch.save`` bytes as DCP stores them: parse the zip local headers and ``data.pkl`` of one
stored tensor item without touching its data, to learn the exact file range of the raw storage.

A stored tensor item is an uncompressed zip (PyTorch's ``inline_container`` format) whose members
(``data.pkl``, ``byteorder``, ``data/0``, ...) are 64-byte aligned; ``data.pkl`` is unpickled
with torch's ``weights_only`` unpickler onto a *meta* storage. Used by
:mod:`distckpt.engine.fast_reader`.
"""

from __future__ import annotations

import io
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import _weights_only_unpickler

__all__ = ["TensorLayout", "parse_torch_save_header", "parse_torch_save_header_cached"]

_MIB = 1 << 20
# Trailers (and predicted trailers) longer than this are not torch.save's (~900 bytes).
_TRAILER_MAX = 1 * _MIB
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

    def __post_init__(self) -> None:
        if not self.sig:
            m = self.meta
            self.sig = (m.dtype, tuple(m.size()), tuple(m.stride()), m.storage_offset())


class _NeedMore(Exception):
    """The header extends past the bytes given."""


class _Unsupported(Exception):
    """Not a layout the fast path decodes; use the stock path for this item."""


_META_CACHE: dict[bytes, tuple[torch.Tensor, str, int, tuple]] = {}
_META_CACHE_MAX = 4096
_PRED_CACHE: dict[tuple, torch.Tensor] = {}


def _meta_from_pickle(pkl: bytes) -> tuple[torch.Tensor, str, int, tuple]:
    """Unpickle ``data.pkl`` with torch's ``weights_only`` unpickler onto a *meta* storage.

    Returns ``(meta tensor, storage key, storage nbytes, (dtype, size, stride, offset))``. Results are cached on the exact
    pickle bytes (a model's items share a handful of shapes; unpickling costs ~0.2 ms).
    """
    hit = _META_CACHE.get(pkl)
    if hit is not None:
        return hit
    stream = io.BytesIO(pkl)
    storages: list[tuple[str, int]] = []

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] not in ("storage", b"storage"):
            raise _Unsupported(f"persistent id {saved_id!r}")
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * torch._utils._element_size(dtype)
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        storages.append((key, nbytes))
        untyped = torch.UntypedStorage(nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(stream, encoding="utf-8")
    unpickler.persistent_load = persistent_load
    try:
        obj = unpickler.load()
    except _Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - anything odd: torch.load decides (and raises)
        raise _Unsupported(f"data.pkl: {type(e).__name__}: {e}") from e
    if stream.tell() != len(pkl):
        raise _Unsupported("data.pkl has trailing bytes")
    if len(storages) != 1 or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        raise _Unsupported("not a plain tensor with one storage")
    if obj.layout != torch.strided or obj.is_quantized or obj.is_conj() or obj.is_neg() or obj.device.type != "meta":
        raise _Unsupported("not a plain strided tensor")
    if any(s < 0 for s in obj.stride()):
        raise _Unsupported("negative stride")
    meta = obj.detach()
    out = (meta, storages[0][0], storages[0][1],
           (meta.dtype, tuple(meta.size()), tuple(meta.stride()), meta.storage_offset()))
    if len(_META_CACHE) >= _META_CACHE_MAX:
        _META_CACHE.clear()
    _META_CACHE[pkl] = out
    return out


def _record_size_by_descriptor(buf: memoryview, start: int, limit: int) -> int:
    """Size of a small stored record whose local header does not carry it (flag bit 3, which
    torch's writer sets on every record): the first data descriptor whose CRC-32 and size
    match the bytes before it."""
    window_end = min(len(buf), start + limit + 16)
    window = bytes(buf[start:window_end])
    pos = 0
    while True:
        p = window.find(_DD_SIG, pos)
        if p < 0 or p + 12 > len(window):
            if window_end < len(buf):
                raise _Unsupported("small zip record without a size")
            raise _NeedMore()
        crc, size = struct.unpack_from("<II", window, p + 4)
        if size == p and zlib.crc32(window[:p]) == crc:
            return size
        pos = p + 1


def _descriptor_len(buf: memoryview, pos: int, size: int) -> int:
    """Length of the data descriptor at ``pos`` for a record of ``size`` bytes (0: none fits)."""
    if pos + 4 <= len(buf) and buf[pos:pos + 4] == _DD_SIG:
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
        raise _NeedMore()
    return 0


def _zip64_sizes(extra: memoryview) -> tuple[int, int] | None:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, pos)
        if hid == 0x0001 and hlen >= 16:
            return struct.unpack_from("<QQ", extra, pos + 4)
        pos += 4 + hlen
    return None


def parse_torch_save_header(buf: bytes | bytearray | memoryview) -> TensorLayout:
    """Parse the start of a ``torch.save(tensor)`` blob up to its storage's data.

    Walks the zip local headers in order (``data.pkl``, small records, ``data/<key>``); each
    record's size comes from its local header, the pickle's own end (``data.pkl``) or a data
    descriptor whose CRC matches (small records).

    Raises:
        _NeedMore: ``buf`` ends before the storage's data starts.
        _Unsupported: anything the fast path does not decode (the stock path will).
    """
    buf = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    pos = 0
    meta = key = None
    nbytes = 0
    byteorder: str | None = None
    while True:
        if pos + _LFH.size > len(buf):
            raise _NeedMore()
        magic, _ver, flags, method, _t, _d, _crc, csize, usize, nlen, elen = _LFH.unpack_from(buf, pos)
        if magic != _LFH_SIG:
            raise _Unsupported(f"no zip local header at {pos}")
        if method != 0 or flags & 0x1:
            raise _Unsupported("compressed or encrypted zip entry")
        data_at = pos + _LFH.size + nlen + elen
        if data_at > len(buf):
            raise _NeedMore()
        name = bytes(buf[pos + _LFH.size:pos + _LFH.size + nlen]).decode("utf-8", "replace")
        record = name.split("/", 1)[1] if "/" in name else name
        size: int | None = None
        if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF:
            z64 = _zip64_sizes(buf[pos + _LFH.size + nlen:data_at])
            if z64 is None:
                raise _Unsupported("zip64 sizes missing")
            size = z64[1] if z64[1] else None
        elif not (flags & 0x8 and csize == 0 and usize == 0):
            if csize != usize:
                raise _Unsupported("stored entry with different sizes")
            size = usize
        if record == "data.pkl":
            if meta is not None:
                raise _Unsupported("two data.pkl records")
            if size is None:
                size = _record_size_by_descriptor(buf, data_at, _PICKLE_MAX)
            if data_at + size > len(buf):
                raise _NeedMore()
            meta, key, nbytes, sig = _meta_from_pickle(bytes(buf[data_at:data_at + size]))
        elif record.startswith("data/") and "/" not in record[5:]:
            if meta is None or record[5:] != key:
                raise _Unsupported(f"unexpected storage record {record!r}")
            if size is not None and size != nbytes:
                raise _Unsupported("storage size mismatch")
            if byteorder not in (None, sys.byteorder):
                raise _Unsupported(f"byteorder {byteorder!r}")
            _dtype, size_, stride_, soff = sig
            numel = nbytes // max(torch._utils._element_size(_dtype), 1)
            if all(size_):
                extent = soff + sum((s - 1) * st for s, st in zip(size_, stride_)) + 1
                if extent > numel:
                    raise _Unsupported("tensor view outside its storage")
            return TensorLayout(meta=meta, data_offset=data_at, nbytes=nbytes, flags=flags, sig=sig)
        else:
            if size is None:
                size = _record_size_by_descriptor(buf, data_at, _SMALL_RECORD_MAX)
            if data_at + size > len(buf):
                raise _NeedMore()
            if record == "byteorder":
                byteorder = bytes(buf[data_at:data_at + size]).decode("ascii", "replace")
        pos = data_at + size
        if flags & 0x8:
            dlen = _descriptor_len(buf, pos, size)
            if dlen == 0:
                raise _Unsupported(f"bad data descriptor after {record!r}")
            pos += dlen


_HEAD_CACHE: dict[bytes, tuple | None] = {}
_LAYOUT_CACHE: dict[bytes, TensorLayout] = {}
_HEADER_LENGTHS: dict[int, None] = {}  # data offsets seen, most recent last


def parse_torch_save_header_cached(buf: memoryview) -> TensorLayout:
    """:func:`parse_torch_save_header`, cached on the header bytes.

    The parse reads nothing past the data offset, so equal header bytes give an equal layout;
    items of the same dtype and shape have equal headers (a model's thousands of biases or
    resharded pieces parse once). Lookups try the few header lengths seen so far.

    Raises:
        _NeedMore, _Unsupported: as :func:`parse_torch_save_header` (never cached).
    """
    for n in reversed(tuple(_HEADER_LENGTHS)):  # a snapshot: other streams may add
        if n <= len(buf):
            layout = _LAYOUT_CACHE.get(bytes(buf[:n]))
            if layout is not None:
                return layout
    layout = parse_torch_save_header(buf)
    if len(_LAYOUT_CACHE) >= _META_CACHE_MAX:
        _LAYOUT_CACHE.clear()
        _HEADER_LENGTHS.clear()
    _LAYOUT_CACHE[bytes(buf[:layout.data_offset])] = layout
    _HEADER_LENGTHS.pop(layout.data_offset, None)
    _HEADER_LENGTHS[layout.data_offset] = None
    if len(_HEADER_LENGTHS) > 8:
        del _HEADER_LENGTHS[next(iter(_HEADER_LENGTHS))]
    return layout


def _same_layout(head: memoryview, predicted: TensorLayout) -> bool:
    """Whether the header bytes ``head`` describe exactly the ``predicted`` layout.

    The header bytes of items with the same dtype and shape are identical (torch's writer puts
    sizes and CRCs in data descriptors, after the data), so parses are cached on them.
    """
    key = bytes(head)
    if key in _HEAD_CACHE:
        got = _HEAD_CACHE[key]
    else:
        try:
            actual = parse_torch_save_header(head)
            got = (actual.data_offset, actual.nbytes, actual.flags, actual.sig)
        except (_NeedMore, _Unsupported):
            got = None
        if len(_HEAD_CACHE) >= _META_CACHE_MAX:
            _HEAD_CACHE.clear()
        _HEAD_CACHE[key] = got
    return got == (len(head), predicted.nbytes, predicted.flags, predicted.sig) \
        and predicted.data_offset == len(head)


def _check_trailer(buf: memoryview, layout: TensorLayout) -> bool:
    """``True`` when the bytes right after the storage data are the expected descriptor."""
    if not layout.flags & 0x8:
        return len(buf) == 0 or bytes(buf[:4]) in (b"PK\x03\x04", b"PK\x01\x02")
    try:
        return _descriptor_len(buf, 0, layout.nbytes) > 0
    except _NeedMore:
        return False

