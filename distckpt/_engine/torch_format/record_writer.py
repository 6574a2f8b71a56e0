"""Write DCP's per-item ``torch.save`` records without calling ``torch.save`` per item.

DCP's ``FileSystemWriter`` serialises every tensor item with ``torch.save``: a zip archive
(``data.pkl``, ``byteorder``, ``data/0``, ``version``, ``.data/serialization_id``) built by
torch's C++ zip writer, about 0.5 ms of Python and C++ work per item however small the tensor,
plus about ten small writes through the file object. For states of many small tensors (per-layer
norms and biases, per-expert weights, optimizer state) that is most of a save (profile in
``docs/benchmarks.md#many-tensors``).

With the zip CRC-32 switched off (distckpt hashes every file with xxh3 instead, see
:mod:`distckpt._engine.writer`), ``torch.save`` of two tensors with the same dtype, shape,
stride, storage offset, storage size and ``requires_grad`` gives the same bytes except for the
storage's raw bytes. So a *template* per such layout -- the bytes before and after the storage,
learnt once from two ``torch.save`` calls of that layout (storage filled with ``0x00`` and with
``0xff``) and checked to differ in exactly the storage's bytes -- turns each later item into
``prefix + storage bytes + suffix``: byte for byte what ``torch.save`` writes, so plain
``dcp.load``/``torch.load`` read it as before. Small records are gathered in a buffer and
written in pieces below 1 MiB (one write, one hash update); a storage of at least 1 MiB is its
own write, as with ``torch.save``, so block digests still start at its data
(:mod:`distckpt._ondisk.integrity`). Small contiguous items of one layout (a model's equal
parameters and their optimizer moments) are written together, in the order their layout first
appears in the file (records are found through DCP's metadata, so their order in a file is
free, as DCP's split by size shows), built in a few tensor operations: one ``torch.stack`` of
their storages into rows that already hold the template's head and tail. A tensor the template
cannot describe (a subclass, extra Python attributes, negative/conjugate bits, a non-strided
layout, big-endian host) is written by ``torch.save`` itself.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
import torch.serialization
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..._ondisk import integrity
from .internals import StorageInfo

__all__ = ["RecordTemplates", "BUFFER_BYTES", "TEMPLATES", "parallel_pays", "write_files", "zip_crc32_off"]

BUFFER_BYTES = integrity.MIN_BLOCK_BYTES - 1
"""Small records are gathered up to this many bytes per write (just below
``integrity.MIN_BLOCK_BYTES``, read when a file starts: a gathered write never starts blocks of
its own, and every storage of at least that size is its own write, where a block starts)."""


@contextlib.contextmanager
def zip_crc32_off() -> Iterator[None]:
    """Skip ``torch.save``'s per-record CRC-32 in this thread while the block runs.

    torch keeps the setting per thread (a ``ContextVar`` in ``torch.utils.serialization.config``,
    torch >= 2.7), so it is switched where DCP serialises: in each writer thread, around its file.
    """
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(saved)


_LITTLE_ENDIAN = sys.byteorder == "little"


def _layout_key(tensor: torch.Tensor, storage_nbytes: int | None = None) -> tuple[Any, ...] | None:
    """What ``torch.save``'s bytes depend on besides the storage's contents; ``None`` when
    the tensor is not one the template can describe (``storage_nbytes``: its storage's size,
    when the caller has it)."""
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_neg()
        or tensor.is_conj()
        or tensor.__dict__
        or not _LITTLE_ENDIAN
    ):
        return None
    return (
        tensor.dtype,
        tensor.shape,  # a torch.Size: a tuple
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes() if storage_nbytes is None else storage_nbytes,
        tensor.requires_grad,
    )


# dtypes whose tensors ``Tensor.numpy()`` views directly (no bfloat16, no float8).
_NUMPY_DTYPES = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8)
    + (torch.uint8, torch.bool, torch.complex64, torch.complex128)
)


def _storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's whole storage as bytes (no copy)."""
    if (
        tensor.dtype in _NUMPY_DTYPES
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    ):
        # The storage is the tensor's elements in order: a numpy view of them costs a third
        # of a tensor made over the storage (the common case: a whole parameter or state).
        return memoryview(tensor.detach().numpy()).cast("B")  # type: ignore[arg-type]
    raw = torch.empty(0, dtype=torch.uint8, device="cpu").set_(tensor.untyped_storage())
    return memoryview(raw.numpy()).cast("B")  # type: ignore[arg-type]


class _Sink:
    """``torch.save`` target that keeps each write, except the storage's (one write of exactly
    ``nbytes``, over 4 KiB: kept as ``None``), so learning a large layout costs no copy of it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.parts: list[bytes | None] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.parts.append(None if len(view) == self.nbytes > 4096 else bytes(view))
        return len(view)

    def flush(self) -> None:
        pass


def _writes_of(tensor: torch.Tensor, nbytes: int) -> list[bytes | None]:
    sink = _Sink(nbytes)
    with zip_crc32_off():
        torch.save(tensor, sink)  # type: ignore[arg-type]  # write() is all torch.save needs
    return sink.parts


def _split_at_data(zeros: list[bytes | None], ones: list[bytes | None], nbytes: int) -> tuple[bytes, bytes] | None:
    """``(head, tail)`` around the storage's write, found as the only write that differs between
    a storage of ``0x00`` and one of ``0xff`` (or the only one not kept); ``None`` unless exactly
    one write differs and it is the storage, all ``0x00`` resp. ``0xff``."""
    if len(zeros) != len(ones):
        return None
    differ = [i for i, (a, b) in enumerate(zip(zeros, ones)) if a is None or b is None or a != b]
    if len(differ) != 1:
        return None
    i = differ[0]
    a, b = zeros[i], ones[i]
    if not ((a is None and b is None) or (a == bytes(nbytes) and b == b"\xff" * nbytes)):
        return None
    return b"".join(p for p in zeros[:i] if p is not None), b"".join(p for p in zeros[i + 1 :] if p is not None)


def _torch_save(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    with zip_crc32_off():
        torch.save(tensor, out)
    return out.getvalue()


class RecordTemplates:
    """Per-layout templates of ``torch.save``'s bytes (module docstring). Thread-safe; one per
    process (:data:`TEMPLATES`), so a structure that does not change learns nothing new.

    Args:
        max_layouts: the cache starts over past this many layouts.

    Attributes:
        learnt: layouts learnt so far; ``fallbacks``: items written by ``torch.save``.
    """

    def __init__(self, max_layouts: int = 4096) -> None:
        self._templates: dict[tuple[Any, ...], tuple[bytes, bytes] | None] = {}
        self._lock = threading.Lock()
        self.max_layouts = max_layouts
        self.fallbacks = 0

    @property
    def learnt(self) -> int:
        """Layouts learnt so far (each with a template, or marked as written by ``torch.save``)."""
        return len(self._templates)

    def template(self, key: tuple[Any, ...], tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
        """``(head, tail)`` of the layout ``key`` (:func:`_layout_key` of ``tensor``), learnt from
        ``tensor``'s layout on first use; ``None``: ``torch.save`` writes that layout."""
        found = self._templates.get(key, False)
        if found is not False:
            return found  # type: ignore[return-value]
        template = None
        nbytes = key[4]
        probe = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
        if 0 < nbytes == probe.untyped_storage().nbytes() and tensor.storage_offset() == 0:
            probe.requires_grad_(tensor.requires_grad)
            raw = torch.empty(0, dtype=torch.uint8, device="cpu").set_(probe.untyped_storage())
            with torch.no_grad():
                raw.fill_(0)
                zeros = _writes_of(probe, nbytes)
                raw.fill_(255)
                ones = _writes_of(probe, nbytes)
            template = _split_at_data(zeros, ones, nbytes)
        with self._lock:
            if len(self._templates) >= self.max_layouts:
                self._templates.clear()  # a structure that keeps changing: start over
            self._templates[key] = template
        return template

    def record(self, tensor: torch.Tensor) -> tuple[bytes, memoryview | None, bytes]:
        """``(head, storage bytes, tail)`` whose concatenation is ``torch.save(tensor)`` (zip
        CRC-32 off); ``(all bytes, None, b"")`` when the template does not apply.

        Args:
            tensor: a CPU tensor whose storage holds exactly its elements (DCP clones others).
        """
        key = _layout_key(tensor)
        template = None if key is None else self.template(key, tensor)
        if template is None:
            self.fallbacks += 1
            return _torch_save(tensor), None, b""
        return template[0], _storage_bytes(tensor), template[1]


TEMPLATES = RecordTemplates()
"""The process's templates, shared by every writer (a training job saves the same layouts)."""


class GatheringWriter:
    """Writes records to ``stream``, gathering small ones (module docstring); tracks the offset.

    Args:
        stream: the file's write stream (hashing, deadline-checking); written front to back.
        offset: the stream's position now.
    """

    def __init__(self, stream: Any, offset: int = 0) -> None:
        self._stream = stream
        self._limit = integrity.MIN_BLOCK_BYTES - 1
        self._buf = bytearray(self._limit)  # one allocation per file, reused: no heap churn
        self._used = 0
        self.offset = offset  # bytes written or gathered so far

    def write_gathered(self, data: memoryview) -> None:
        """Append ``data`` (whole records, each below the gathering limit) through the gathering
        buffer: the same writes as appending its records one by one would make, but for where
        the pieces end (no piece starts a block)."""
        i, n = 0, len(data)
        while i < n:
            take = min(self._limit - self._used, n - i)
            self._buf[self._used : self._used + take] = data[i : i + take]
            self._used += take
            i += take
            if self._used == self._limit:
                self.flush()
        self.offset += n

    def write(self, *parts: bytes | memoryview) -> None:
        """Append ``parts`` (one record) to the file."""
        for part in parts:
            n = len(part)
            if n >= self._limit:
                self.flush()
                self._stream.write(part)
            else:
                if self._used + n > self._limit:
                    self.flush()
                self._buf[self._used : self._used + n] = part
                self._used += n
            self.offset += n

    def flush(self) -> None:
        """Write what was gathered."""
        if self._used:
            with memoryview(self._buf) as view:
                self._stream.write(view[: self._used])
            self._used = 0


def _resolver(planner: SavePlanner) -> Callable[[WriteItem], Any]:
    """``planner.resolve_data``, with a short cut for a plain tensor under DCP's default lookup:
    the flattened state dict's value itself, as ``find_state_dict_object`` returns it, without
    its generic checks (a few microseconds per item). Any other object, a tensor subclass
    (``DTensor``, ``Parameter``), a non-zero offset or a planner overriding the lookup: DCP's."""
    if not isinstance(planner, DefaultSavePlanner):
        return planner.resolve_data
    cls = type(planner)
    if not (
        cls.resolve_data is DefaultSavePlanner.resolve_data
        and cls.lookup_object is DefaultSavePlanner.lookup_object
        and cls.transform_object is DefaultSavePlanner.transform_object
    ):
        return planner.resolve_data
    state_dict = planner.state_dict

    def resolve(item: WriteItem) -> Any:
        obj = state_dict.get(item.index.fqn)
        if type(obj) is torch.Tensor and item.type != WriteItemType.BYTE_IO and not any(item.index.offset or ()):
            return obj
        return planner.resolve_data(item)

    return resolve


def _write_file(
    create_stream: Callable[..., Any],
    path: str,
    file_name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    templates: RecordTemplates,
    sync_files: bool,
) -> list[WriteResult]:
    """One file: bytes items, then tensor items, in ``torch.save``'s record format."""
    results = []
    offsets: dict[torch.Size, torch.Size] = {}

    def done(item: WriteItem, start: int, end: int) -> None:
        index = item.index
        offset = index.offset
        if offset is not None:
            # One torch.Size object per distinct offset: .metadata pickles (and unpickles) a
            # shared object once. Equal value, so the frozen index's hash and equality stay.
            shared = offsets.setdefault(offset, offset)
            if shared is not offset:
                object.__setattr__(index, "offset", shared)
        results.append(
            WriteResult(index=index, size_in_bytes=end - start, storage_data=StorageInfo(file_name, start, end - start))
        )

    resolve = _resolver(planner)
    with create_stream(path, "wb") as stream:
        out = GatheringWriter(stream)
        for item in (wi for wi in items if wi.type == WriteItemType.BYTE_IO):
            start = out.offset
            data = planner.resolve_data(item)
            assert isinstance(data, io.BytesIO)  # DCP resolves a bytes item to a BytesIO
            out.write(data.getbuffer())
            done(item, start, out.offset)
        # Tensors by layout, in first-seen order; one that joins no run is a group of its own.
        groups: dict[Any, tuple[tuple[bytes, bytes] | None, list[tuple[WriteItem, torch.Tensor]]]] = {}
        for item in (wi for wi in items if wi.type != WriteItemType.BYTE_IO):
            resolved = resolve(item)
            assert isinstance(resolved, torch.Tensor)  # DCP resolves a tensor item to a tensor
            # As DCP: detached (a plain tensor, no autograd), the same bytes as its writer's.
            tensor = resolved if type(resolved) is torch.Tensor and not resolved.requires_grad else resolved.detach()
            if not tensor.is_cpu:
                tensor = tensor.cpu()
            nbytes = tensor.untyped_storage().nbytes()
            if nbytes != tensor.nbytes:  # as DCP: a view's own storage
                tensor = tensor.clone()
                nbytes = tensor.nbytes
            key = _layout_key(tensor, nbytes)
            template = None if key is None else templates.template(key, tensor)
            group = key if key is not None and template is not None and _Run.joins(key, tensor) else object()
            groups.setdefault(group, (template, []))[1].append((item, tensor))
        run = _Run(out, done)
        for key, (template, members) in groups.items():
            if template is None or len(members) == 1:
                for item, tensor in members:
                    start = out.offset
                    out.write(*(part for part in templates.record(tensor) if part is not None))
                    done(item, start, out.offset)
            else:
                run.write(key, template, members)
        out.flush()
        if sync_files:
            os.fsync(stream.fileno())
    return results


RUN_ITEM_MAX_BYTES = 64 * 1024
"""Records up to this size join a run (:class:`_Run`); bigger ones are written one by one."""
RUN_MAX_BYTES = 32 * 1024 * 1024
"""A run is written once its rows hold this many bytes (the memory it copies into)."""


class _Run:
    """Writes records of one layout, each a contiguous storage of at most
    :data:`RUN_ITEM_MAX_BYTES`, together: a ``(k, head + storage + tail)`` uint8 table whose head
    and tail columns are the template's and whose middle is ``torch.stack`` of the k storages --
    the bytes of k :meth:`RecordTemplates.record` calls, in a few tensor operations.

    Args:
        out: the file's writer; ``done(item, start, end)``: records an item's byte range.
    """

    def __init__(self, out: GatheringWriter, done: Callable[[WriteItem, int, int], None]) -> None:
        self.out, self.done = out, done

    @staticmethod
    def joins(key: tuple[Any, ...], tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (of layout ``key``) is written in a run: small, its storage its
        elements in order."""
        return key[4] <= RUN_ITEM_MAX_BYTES and key[3] == 0 and tensor.is_contiguous()

    def write(
        self, key: tuple[Any, ...], template: tuple[bytes, bytes], members: list[tuple[WriteItem, torch.Tensor]]
    ) -> None:
        """Write the records of ``members`` (items and tensors of layout ``key``, each
        :meth:`joins`), at most :data:`RUN_MAX_BYTES` of rows at a time, reporting each item's range."""
        head, tail = template
        h, n = len(head), key[4]
        row = h + n + len(tail)
        per = max(RUN_MAX_BYTES // row, 1)
        for i in range(0, len(members), per):
            part = members[i : i + per]
            k = len(part)
            rows = torch.empty((k, row), dtype=torch.uint8)
            rows[:, :h] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            rows[:, h + n :] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
            with torch.no_grad():
                rows[:, h : h + n] = torch.stack([t for _, t in part]).view(torch.uint8).reshape(k, n)
            start = self.out.offset
            self.out.write_gathered(memoryview(rows.numpy()).cast("B"))  # type: ignore[arg-type]
            for j, (item, _) in enumerate(part):
                self.done(item, start + j * row, start + (j + 1) * row)


PARALLEL_MIN_BYTES_PER_ITEM = 64 * 1024
"""Files are written by parallel threads only when their items average at least this many
bytes: each item costs Python work under the GIL, which threads contend for and never share,
while only the byte writes (and ``fsync``) release it."""


def _item_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:  # a bytes item: serialised small values
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


_PAYS: list[tuple[list[WriteItem], int, bool]] = []  # the last answers, by item list (and its length)


def parallel_pays(items: list[WriteItem]) -> bool:
    """Whether a rank's ``items`` are written faster by a thread per file than by one thread:
    items of at least :data:`PARALLEL_MIN_BYTES_PER_ITEM` bytes on average (a state of many
    small tensors is written faster by one thread, into one file). Remembered for the last few
    item lists (the same list object while a saved structure repeats)."""
    for seen, n, pays in _PAYS:
        if seen is items and n == len(items):
            return pays
    pays = bool(items) and sum(_item_bytes(item) for item in items) >= PARALLEL_MIN_BYTES_PER_ITEM * len(items)
    _PAYS[:] = [(items, len(items), pays)] + _PAYS[:3]
    return pays


def write_files(
    jobs: list[tuple[str, str, list[WriteItem]]],
    planner: SavePlanner,
    *,
    create_stream: Callable[..., Any],
    sync_files: bool,
    templates: RecordTemplates,
) -> list[WriteResult]:
    """Write each ``(path, file name, items)`` of ``jobs`` -- the files and item split
    ``FileSystemWriter.write_data`` chose -- bytes items first, each tensor a ``torch.save``
    record (module docstring), one thread per file (the writer asks for one file where threads
    would not pay: :func:`parallel_pays`).

    Returns:
        DCP's ``WriteResult`` per item (``StorageInfo``: file name, offset, length in bytes).

    Raises:
        OSError, TimeoutError: the first failure of any file (the stream records it too).
    """

    def run(job: tuple[str, str, list[WriteItem]]) -> list[WriteResult]:
        return _write_file(create_stream, job[0], job[1], job[2], planner, templates, sync_files)

    if len(jobs) <= 1:
        return run(jobs[0]) if jobs else []
    results: list[WriteResult] = []
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="distckpt-write") as pool:
        futures = [pool.submit(run, job) for job in jobs]
        first: BaseException | None = None
        for f in futures:
            try:
                results += f.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised once all are done
                first = first or e
    if first is not None:
        raise first
    return results
