"""Streaming writers for single-file weights: safetensors and ``torch.save`` zip files.

Both know every tensor's name, shape and dtype before any data arrives, lay the file out
first, then take tensors one at a time, so memory stays about one tensor whatever the file size.

* safetensors (https://github.com/huggingface/safetensors, format in its README): 8-byte
  little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}`` padded
  with spaces to 8 bytes, then the raw little-endian tensor bytes in header order.
* torch: ``torch.save`` under ``torch.serialization.skip_data`` writes the archive with every
  storage record reserved but empty; each tensor's bytes are then written into its record and
  the record's CRC-32 patched, giving the file ``torch.save`` would have written.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile
import zlib
from typing import Any, BinaryIO

import torch

from .._engine.torch_format.internals import FakeTensorMode

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsWriter", "TorchZipWriter", "tensor_bytes"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}

if sys.byteorder != "little":  # pragma: no cover - both formats store little-endian bytes
    raise ImportError("distckpt._tools.single_file writes raw tensor bytes and needs a little-endian host")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as raw bytes (C order, native little-endian), a view if contiguous."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype, device="cpu").element_size()
    for d in shape:
        n *= d
    return n


class _Ordered:
    """Checks that tensors arrive in the announced order with the announced shape and dtype."""

    def __init__(self, entries: list[tuple[str, list[int], torch.dtype]]) -> None:
        self.entries = entries
        self.next = 0

    def take(self, name: str, tensor: torch.Tensor) -> int:
        if self.next >= len(self.entries):
            raise ValueError(f"unexpected tensor {name!r}: all {len(self.entries)} were written")
        want, shape, dtype = self.entries[self.next]
        if name != want or list(tensor.shape) != list(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"expected tensor {want!r} {list(shape)} {dtype}, got {name!r} {list(tensor.shape)} {tensor.dtype}"
            )
        self.next += 1
        return self.next - 1

    def check_done(self) -> None:
        if self.next != len(self.entries):
            raise ValueError(
                f"only {self.next} of {len(self.entries)} tensors were written (next: {self.entries[self.next][0]!r})"
            )


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor.

    Args:
        f: binary file opened for writing, positioned at 0.
        entries: ``(name, shape, dtype)`` of every tensor, in the order they will be written.
        metadata: string-to-string ``__metadata__`` of the header.

    Raises:
        ValueError: a dtype safetensors cannot store (names the tensor).
    """

    def __init__(
        self, f: BinaryIO, entries: list[tuple[str, list[int], torch.dtype]], metadata: dict[str, str] | None = None
    ) -> None:
        self.f = f
        self.order = _Ordered(entries)
        header: dict[str, Any] = {}
        offset = 0
        for name, shape, dtype in entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            n = _nbytes(shape, dtype)
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        self.data_bytes = offset

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor (must match the announced name, shape and dtype)."""
        self.order.take(name, tensor)
        self.f.write(tensor_bytes(tensor))

    def close(self) -> None:
        """Check that every announced tensor was written."""
        self.order.check_done()


class TorchZipWriter:
    """Write a ``torch.save`` file of ``{name: tensor | value}`` tensor by tensor.

    Args:
        path: output file (created or truncated).
        entries: ``(name, shape, dtype)`` of every tensor, in the order they will be written.
        values: non-tensor entries (made of containers and primitives, no tensors); they are
            stored in the pickle and need no later write.

    The result loads with ``torch.load(path, weights_only=True)`` as a dict with the tensors
    first (in ``entries`` order), then ``values``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        entries: list[tuple[str, list[int], torch.dtype]],
        values: dict[str, Any] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.order = _Ordered(entries)
        with FakeTensorMode():
            layout: dict[str, Any] = {
                name: torch.empty(shape, dtype=dtype, device="cpu") for name, shape, dtype in entries
            }
        layout.update(values or {})
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(layout, self.path)
        self.records = self._storage_records(len(entries))
        for i, (name, shape, dtype) in enumerate(entries):
            if self.records[i][2] != _nbytes(shape, dtype):
                raise RuntimeError(
                    f"{self.path}: storage record {i} holds {self.records[i][2]} bytes, "
                    f"tensor {name!r} needs {_nbytes(shape, dtype)}"
                )
        self.fd: int | None = os.open(self.path, os.O_RDWR)
        self.crcs: dict[str, int] = {}

    def __enter__(self) -> "TorchZipWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Release the file on an error (the file is then incomplete: the caller removes it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _storage_records(self, count: int) -> list[tuple[str, int, int]]:
        """``(record name, data offset, size)`` of ``<archive>/data/<i>`` for i < count.

        ``torch.save`` numbers storages in pickling order, which for a flat dict whose only
        tensors are its values is the dict's order.
        """
        with zipfile.ZipFile(self.path) as zf, open(self.path, "rb") as f:
            by_index: dict[int, tuple[str, int, int]] = {}
            for info in zf.infolist():
                parts = info.filename.split("/")
                if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                    f.seek(info.header_offset)
                    local = f.read(30)
                    name_len, extra_len = struct.unpack("<HH", local[26:30])
                    by_index[int(parts[2])] = (
                        info.filename,
                        info.header_offset + 30 + name_len + extra_len,
                        info.file_size,
                    )
        if sorted(by_index) != list(range(count)):
            raise RuntimeError(f"{self.path}: expected storage records 0..{count - 1}, found {sorted(by_index)}")
        return [by_index[i] for i in range(count)]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor's bytes into its reserved record."""
        if self.fd is None:
            raise ValueError(f"{self.path}: writer already closed")
        i = self.order.take(name, tensor)
        record, offset, size = self.records[i]
        data = tensor_bytes(tensor)
        done = 0
        while done < size:
            done += os.pwrite(self.fd, data[done:], offset + done)
        self.crcs[record] = zlib.crc32(data)

    def close(self) -> None:
        """Patch the CRC-32 of every record (local headers and central directory) and close.

        Raises:
            ValueError: not every announced tensor was written.
        """
        if self.fd is None:
            raise ValueError(f"{self.path}: writer already closed")
        try:
            self.order.check_done()
            with zipfile.ZipFile(self.path) as zf:
                start_dir = zf.start_dir
                headers = {info.filename: info.header_offset for info in zf.infolist()}
            for record, crc in self.crcs.items():
                os.pwrite(self.fd, struct.pack("<I", crc), headers[record] + 14)
            self._patch_central_directory(start_dir)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None

    def _patch_central_directory(self, offset: int) -> None:
        assert self.fd is not None  # only called by close() before it releases the file
        with open(self.path, "rb") as f:
            f.seek(offset)
            while True:
                fixed = f.read(46)
                if len(fixed) < 46 or fixed[:4] != b"PK\x01\x02":
                    return
                name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
                name = f.read(name_len).decode()
                if name in self.crcs:
                    os.pwrite(self.fd, struct.pack("<I", self.crcs[name]), offset + 16)
                offset += 46 + name_len + extra_len + comment_len
                f.seek(offset)
