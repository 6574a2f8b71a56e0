"""Fast DCP load path: large sequential reads straight into the destination tensors.

:class:`FastFileSystemReader` is a drop-in ``StorageReader`` for ``dcp.load`` (a subclass of
:class:`~distckpt.engine.safe_io.SafeFileSystemReader`: same safe ``.metadata`` unpickler, same
``expected_files`` contract). It reads checkpoints written by distckpt or by plain
``dcp.save`` (``FileSystemWriter``, default ``torch.save`` serialization).

Why the stock reader is slow
    ``FileSystemReader.read_data`` walks the plan item by item: for each item it hands a file
    view to ``torch.load`` (several small reads through Python, a fresh tensor, the storage
    copied into it), then ``copy_`` s that tensor into the destination: every byte is copied
    twice in user space, one item at a time, with one reader, and the CPU work does not
    overlap the I/O. Measured here (1 GiB, one process, cold page cache, free page reporting
    held): stock 0.66 s (1.6 GB/s), a plain sequential read 0.30-0.32 s, this reader 0.27-0.29
    s. Cold reads here want large requests (1 MiB requests: ~1 GB/s; 16 MiB: ~3.4 GB/s);
    ``O_DIRECT`` reached only 1.3-2.4 GB/s (16-64 MiB requests, 1-16 threads) and
    ``POSIX_FADV_SEQUENTIAL`` or ``WILLNEED`` made a sequential read slower, so the reader
    stays buffered with the kernel's default readahead.

How this reader reads
    * Per file, the stored items this rank needs are sorted by offset and read front to back
      by a *stream* (its own file descriptor, so the kernel's readahead sees a sequential
      reader). Up to ``thread_count`` streams run in parallel: one per file, and without
      hashes spare threads split the biggest files into contiguous regions.
    * A stored tensor item is ``torch.save(tensor)`` bytes: an uncompressed zip whose members
      (``data.pkl``, ``byteorder``, ``data/0``, ...) are 64-byte aligned. The reader parses the
      zip local headers itself, unpickles ``data.pkl`` with torch's ``weights_only`` unpickler
      onto a *meta* storage (so it learns dtype, shape, stride and storage offset without
      touching data; results cached on the pickle bytes), checks ``byteorder``, and from then
      on knows the exact file range of the raw storage bytes. Those bytes are read with
      ``os.preadv`` **directly into the destination tensor** when the (narrowed) source is a
      contiguous byte range and the destination is a contiguous CPU tensor of the same dtype
      and shape -- the common case, also for FSDP2 resharding (dim-0 shards: a partial read
      of a shard is a contiguous sub-range). Otherwise (a column slice, a dtype change, a
      non-contiguous or non-CPU destination, a stored non-contiguous tensor) the covering byte
      range is read into a buffer and ``copy_`` d through a strided view of it.
    * The first big item of a stream is located by reading its first ``_PEEK`` bytes; later
      ones are *predicted* (same header length as the previous item, a compact storage of the
      chunk size and dtype that DCP's metadata records -- DCP clones views before saving) and
      checked after the read against their real header and zip data descriptor. So one
      ``preadv`` carries many items: header bytes into the arena, data into the destinations,
      trailers into the arena, small items (up to ``direct_min_bytes``) whole into the arena
      (decoded from memory: a memcpy), bytes other ranks need (gaps up to ``gap_read_bytes``)
      into the arena -- up to ``max_request_bytes`` per request, never re-reading a byte.
    * An item whose header or trailer does not match the prediction or the parsed layout is
      decoded again the stock way (``torch.load`` of the whole item, read apart). Any item the
      parser does not fully understand (an unexpected zip layout, a pickle with more or fewer
      than one storage, big-endian data, transform descriptors / extensions) is decoded from
      its bytes the way ``FileSystemReader`` does (transforms, then
      ``torch.load(weights_only=True)``); ``BYTE_IO`` items go to ``planner.load_bytes``.

Integrity
    * Without hashes: the file size is compared with the manifest (when given) and with the
      end of the last item this rank reads before anything is read; a read that ends early is
      never accepted as data (``CheckpointCorruptError`` naming the file).
    * With hashes (``expected_files`` digests): the xxh3-128 of the file is computed from the
      very bytes the stream reads, in file order, so there is no second pass. A digest covers
      the whole file, so when a rank needs only part of a file (resharding) the stream reads
      the bytes it does not need too, sequentially, into a bounded scratch buffer that is only
      hashed (choice documented here: reading the rest once, in order, is cheaper than
      ``check_file``'s separate pass over the whole file followed by reads of the needed parts;
      in a reshard the rest is what other ranks read at the same time, so the disk sees it
      once). With hashes a file is one stream. A file is verified at most once per reader.
    * Bytes land in the destination tensors as they are read, so a digest mismatch is detected
      after the destination was written: on ``CheckpointCorruptError`` the destination state
      is unspecified (partially loaded), exactly as after any failed ``dcp.load``; callers must
      not use it (the manager raises or falls back to an older checkpoint, which rewrites it).

Planner calls
    ``resolve_tensor`` is called for every tensor request up front, in the calling thread;
    ``commit_tensor`` and ``load_bytes`` are called after all reads, in the calling thread, in
    plan order. Worker threads only read files and copy into the resolved tensors. (With
    ``DefaultLoadPlanner`` ``resolve_tensor`` returns views, so nothing extra is held.)
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointCorruptError
from ..integrity import HASH_ALGORITHM, new_hasher
from .read_stream import (_WARM_GAP, _cached, _check_sizes, _covering, _direct_ok, _file_size, _Req, _Results,
                          _src_view, _Stored, _Stream, _strided, _typed, _writable_view)
from .safe_io import SafeFileSystemReader
from .torch_save_format import (_PRED_CACHE, _TRAILER_MAX, TensorLayout, _check_trailer, _NeedMore, _same_layout,
                                _Unsupported, parse_torch_save_header, parse_torch_save_header_cached)

__all__ = ["FastFileSystemReader", "parse_torch_save_header", "TensorLayout"]

_MIB = 1 << 20
# Bytes of a big item read before its data: holds the zip local headers, data.pkl and the
# small records (the data of a tensor saved by torch 2.x starts at byte 704).
_PEEK = 4096

# ============================================================================ the reader
class FastFileSystemReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` that reads each file front to back in large ``preadv`` calls
    straight into the destination tensors, verifying hashes from the bytes it reads.

    Args:
        path: checkpoint directory.
        expected_files: ``{relative path: (size_bytes, digest or None)}``; sizes are checked
            before reading, digests (xxh3-128) from the bytes read; ``None`` skips both.
        thread_count: read streams per rank (default 2): one per file; without hashes spare
            ones split big files into regions. Measured here (1 GiB, cold, one rank, 7 rounds,
            free page reporting held -- see ``benchmarks/_guest_memory.py``): one file 0.29 s
            with 1 or 2 streams (a plain sequential read: 0.30 s); four files 0.278 s with 1
            stream, 0.274 s with 2 (a plain sequential read of the four: 0.317 s). On storage
            with deeper queues (NVMe) parallel streams matter more. ``thread_count`` is per
            rank: ``CheckpointManager`` divides ``load_streams_per_node`` among a node's ranks.
        chunk_bytes: arena size per stream for small items and read-through gaps (one request).
        direct_min_bytes: stored items larger than this are read into their destination
            directly; smaller ones are read whole (coalesced) and copied out of the arena.
        max_request_bytes: upper bound of one request (hashing interleaves at this granularity).
        gap_read_bytes: bytes this rank does not need (resharding: other ranks' rows of a stored
            shard) are read through, into the arena, when the gap is at most this long, so the
            stream stays one sequential reader; longer gaps are skipped (or, when hashing, read
            in ``chunk_bytes`` pieces only to be hashed). Small holes skipped make each read a
            small random read, which costs ~3x per byte on a cold cache here; the bytes read
            through are usually read by the rank that needs them at the same time, so the disk
            sees them once (page cache). When a stream's range is already in the page cache
            (``RWF_NOWAIT`` probes), only gaps up to 64 KiB are read through.
        _extension_registry: as ``FileSystemReader``'s (experimental): decodes items saved with
            stream transforms (those items take the stock decode path).

    Attributes:
        last_stats: counters of the last ``read_data`` (bytes read, direct, copied, fallbacks).
    """

    def __init__(self, path: str | os.PathLike,
                 expected_files: dict[str, tuple[int, str | None]] | None = None,
                 thread_count: int = 2, *, chunk_bytes: int = 32 * _MIB,
                 direct_min_bytes: int = 1 * _MIB, max_request_bytes: int = 16 * _MIB,
                 gap_read_bytes: int = 4 * _MIB, _extension_registry: Any = None) -> None:
        super().__init__(path, expected_files=expected_files)
        if _extension_registry is not None:  # as FileSystemReader's experimental argument
            self.transforms = _StorageReaderTransforms(_extension_registry)
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.thread_count = int(thread_count)
        self.chunk_bytes = max(int(chunk_bytes), _MIB)
        self.direct_min_bytes = max(int(direct_min_bytes), _PEEK)
        self.max_request_bytes = max(int(max_request_bytes), _MIB)
        self.gap_read_bytes = max(int(gap_read_bytes), 0)
        self.last_stats: dict[str, int] = {}

    # -------------------------------------------------------------- public StorageReader API
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        stored: dict[Any, _Stored] = {}
        tensor_reqs: list[_Req] = []
        for item in plan.items:
            md = self.storage_data[item.storage_index]
            key = (md.relative_path, md.offset, md.length)
            st = stored.get(key)
            if st is None:
                st = stored[key] = _Stored(md.relative_path, md.offset, md.length,
                                           tuple(getattr(md, "transform_descriptors", None) or ()),
                                           item.type == LoadItemType.BYTE_IO)
            if item.type == LoadItemType.BYTE_IO:
                st.reqs.append(_Req(item, None))
            else:
                req = _Req(item, planner.resolve_tensor(item).detach())
                st.reqs.append(req)
                tensor_reqs.append(req)
        per_file: dict[str, list[_Stored]] = {}
        for st in stored.values():
            per_file.setdefault(st.relpath, []).append(st)

        results = _Results()
        jobs = self._make_jobs(per_file)
        self._run_jobs(jobs, results)
        for st in results.redo:  # trailer did not match the parsed layout: decode the stock way
            self._redo(st, results)
        # Planner callbacks in the calling thread, in plan order.
        bytes_by_item = {id(req): data for req, data in results.bytes_items}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                data = bytes_by_item.get(id(item))
                if data is None:
                    raise AssertionError(f"{item.storage_index}: bytes item was not read")
                planner.load_bytes(item, io.BytesIO(data))
        for req in tensor_reqs:
            planner.commit_tensor(req.item, req.target)
        self.last_stats = dict(results.stats)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # -------------------------------------------------------------- jobs
    def _make_jobs(self, per_file: dict[str, list[_Stored]]) -> list[tuple[str, list[_Stored], bool]]:
        """``(relpath, items, verify)`` per stream.

        ``thread_count`` streams in all: one per file, and without hashing the spare threads
        split the biggest files into contiguous regions, one stream each. With hashing a file
        is one stream (the digest needs the bytes in order). A pre-reader filling the page
        cache ahead of a hashed stream was tried and removed: it added a copy and was slower
        (one 1 GiB file, cold: 0.34 s vs 0.29 s for the lone stream, 7 rounds).
        """
        jobs = []
        checks: dict[str, tuple[int, str | None]] = {}
        for name in sorted(per_file):
            if self.expected_files is not None and name not in self._checked:
                if name not in self.expected_files:
                    raise CheckpointCorruptError(
                        f"{Path(self.path) / name}: DCP metadata refers to a file the manifest does "
                        "not list", path=str(Path(self.path) / name))
                checks[name] = self.expected_files[name]
        spare = max(self.thread_count - len(per_file), 0)
        sizes = {n: sum(s.length for s in items) for n, items in per_file.items()}
        for name in sorted(per_file, key=lambda n: -sizes[n]):
            items = sorted(per_file[name], key=lambda s: s.offset)
            verify = name in checks and checks[name][1] is not None
            parts = 1
            if not verify and spare > 0 and sizes[name] >= 4 * self.max_request_bytes and len(items) > 1:
                parts = min(1 + spare, len(items))
                spare -= parts - 1
            if parts == 1:
                jobs.append((name, items, verify))
                continue
            share = sizes[name] / parts
            groups: list[list[_Stored]] = [[]]
            acc = 0
            for st in items:
                if groups[-1] and len(groups) < parts and acc >= share * len(groups):
                    groups.append([])
                groups[-1].append(st)
                acc += st.length
            jobs += [(name, g, False) for g in groups]
        self._pending_checks = checks
        # Ranks that read parts of the same files (a reshard, replicated DDP state loaded into
        # FSDP2 shards) start at files spread evenly over the list, so the disk serves
        # sequential streams in different files rather than all ranks in one file. Measured
        # (DDP at 2 -> FSDP2 at 2, 1 GiB in 8 files, cold, 3 rounds): 0.361 s vs 0.479 s.
        if dist.is_available() and dist.is_initialized() and jobs:
            k = dist.get_rank() * len(jobs) // dist.get_world_size()
            jobs = jobs[k:] + jobs[:k]
        return jobs

    def _run_jobs(self, jobs: list[tuple[str, list[_Stored], bool]], results: _Results) -> None:
        if not jobs:
            return
        verified: list[str] = []
        lock = threading.Lock()

        def run(job: tuple[str, list[_Stored], bool]) -> None:
            name, items, verify = job
            if self._stream_file(name, items, verify, results):
                with lock:
                    verified.append(name)

        workers = min(self.thread_count, len(jobs))
        if workers == 1:
            for job in jobs:
                run(job)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="distckpt-read") as pool:
                futures = [pool.submit(run, job) for job in jobs]
                errors = []
                for f in futures:
                    try:
                        f.result()
                    except BaseException as e:  # noqa: BLE001 - re-raised below
                        errors.append(e)
                if errors:
                    corrupt = [e for e in errors if isinstance(e, CheckpointCorruptError)]
                    raise (corrupt or errors)[0]
        for name in verified:
            self._checked.add(name)
        # Files whose manifest entry has no digest: the size check below marks them done.
        for name, (_size, digest) in self._pending_checks.items():
            if digest is None:
                self._checked.add(name)

    # -------------------------------------------------------------- one stream
    def _stream_file(self, relpath: str, items: list[_Stored], verify: bool, results: _Results) -> bool:
        path = str(Path(self.path) / relpath)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            what = "file listed in the manifest" if relpath in self._pending_checks else "checkpoint data file"
            raise CheckpointCorruptError(f"{path}: {what} is missing", path=path) from None
        except OSError as e:
            raise CheckpointCorruptError(f"{path}: cannot open ({e})", path=path) from e
        try:
            file_size = _file_size(fd)
            expected = self._pending_checks.get(relpath)
            if expected is not None and file_size != expected[0]:
                raise CheckpointCorruptError(
                    f"{path}: size {file_size} bytes, manifest expects {expected[0]} bytes (truncated?)",
                    path=path)
            need_end = max(st.end for st in items)
            if file_size < need_end:
                raise CheckpointCorruptError(
                    f"{path}: truncated: the file has {file_size} bytes, but the checkpoint's "
                    f"metadata places data up to byte {need_end}", path=path)
            hasher = new_hasher() if verify else None
            stream = _Stream(self, path, fd, file_size, hasher, results, 0 if verify else items[0].offset)
            if not verify and stream.gap_read_bytes > _WARM_GAP and _cached(fd, items[0].offset, need_end):
                # Already in the page cache: reading other ranks' bytes through would only
                # cost memcpy; skip all but tiny gaps.
                stream.gap_read_bytes = _WARM_GAP
            side: list[_Stored] = []
            last_end = stream.pos
            for st in items:
                if st.offset < last_end:  # overlapping items (not written by DCP): read apart
                    side.append(st)
                    continue
                self._add_item(stream, st, results)
                last_end = st.end
            stream.finish_to(file_size if verify else stream.pos)
            if verify:
                digest = hasher.hexdigest()
                if digest != expected[1]:
                    raise CheckpointCorruptError(
                        f"{path}: {HASH_ALGORITHM} {digest} does not match the manifest's {expected[1]} "
                        "(bytes changed after the commit)", path=path)
            for st in side:
                buf, mv = self._pread_item(fd, path, st)
                self._decode_whole(st, mv, results, buf)
            return verify
        finally:
            os.close(fd)

    def _pread_item(self, fd: int, path: str, st: _Stored) -> tuple[torch.Tensor, memoryview]:
        buf = torch.empty(st.length, dtype=torch.uint8)
        mv = _writable_view(buf)
        done = 0
        while done < st.length:
            n = os.preadv(fd, [mv[done:]], st.offset + done)
            if n <= 0:
                raise CheckpointCorruptError(
                    f"{path}: truncated: short read at byte {st.offset + done} (item needs bytes up to "
                    f"{st.end})", path=path)
            done += n
        return buf, mv

    # -------------------------------------------------------------- per item
    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] | None = None
        self._metadata = metadata

    def _chunk_info(self, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        """Saved size and dtype of the chunk ``index`` names, from DCP's metadata."""
        if getattr(self, "_chunks", None) is None:
            chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
            for fqn, md in getattr(getattr(self, "_metadata", None), "state_dict_metadata", {}).items():
                if isinstance(md, TensorStorageMetadata):
                    for ch in md.chunks:
                        chunks[(fqn, tuple(ch.offsets))] = (tuple(ch.sizes), md.properties.dtype)
            self._chunks = chunks
        if index.offset is None:
            return None
        return self._chunks.get((index.fqn, tuple(index.offset)))

    def _predict(self, stream: _Stream, st: _Stored) -> TensorLayout | None:
        """The layout of ``st`` if it is like the stream's previous item: same header length,
        a compact storage of the chunk's size (DCP clones views before saving)."""
        if stream.hint is None:
            return None
        info = self._chunk_info(st.reqs[0].item.storage_index)
        if info is None:
            return None
        sizes, dtype = info
        data_offset, flags = stream.hint
        numel = 1
        for d in sizes:
            numel *= d
        nbytes = numel * torch._utils._element_size(dtype)
        if not 16 <= st.length - data_offset - nbytes <= _TRAILER_MAX:
            return None
        strides, acc = [], 1
        for d in reversed(sizes):
            strides.append(acc)
            acc *= max(d, 1)
        sig = (dtype, tuple(sizes), tuple(reversed(strides)), 0)
        meta = _PRED_CACHE.get(sig)
        if meta is None:
            meta = _PRED_CACHE[sig] = torch.empty(sizes, dtype=dtype, device="meta")
        return TensorLayout(meta=meta, data_offset=data_offset, nbytes=nbytes, flags=flags, sig=sig)

    def _add_item(self, stream: _Stream, st: _Stored, results: _Results) -> None:
        if st.is_bytes or st.descriptors or st.length <= self.direct_min_bytes:
            stream.add_scratch(st.offset, st.length,
                               lambda t, mv, st=st: self._decode_whole(st, mv, results, t))
            return
        layout = self._predict(stream, st)
        if layout is not None:
            # Header predicted from the previous item of this stream and DCP's chunk metadata:
            # no extra request; the header is read in the same request as the data and
            # checked afterwards (a mismatch re-decodes the item the stock way).
            predicted = layout

            def verify(_t, mv, st=st, predicted=predicted) -> None:
                if not _same_layout(mv, predicted):
                    stream.hint = None
                    with results.lock:
                        results.redo.append(st)

            stream.add_scratch(st.offset, layout.data_offset, verify)
            peek, peek_len = b"", 0
        else:
            peek_len = min(_PEEK, st.length)
            holder: dict[str, bytes] = {}
            stream.add_scratch(st.offset, peek_len, lambda t, mv: holder.__setitem__("peek", bytes(mv)))
            stream.flush()
            peek = holder["peek"]
            try:
                layout = parse_torch_save_header(peek)
            except (_NeedMore, _Unsupported):
                layout = None
            if layout is not None and layout.data_offset + layout.nbytes > st.length:
                layout = None
            if layout is None:  # the rest of the item into one buffer, then the stock decode
                rest = torch.empty(st.length, dtype=torch.uint8)
                rest_mv = _writable_view(rest)
                rest_mv[:peek_len] = peek

                def whole(_t, _mv, st=st, rest=rest, rest_mv=rest_mv) -> None:
                    self._decode_whole(st, rest_mv, results, rest)

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
        wants: list[tuple[int, int, _Req, torch.Tensor | None, torch.Tensor]] = []
        for req in st.reqs:
            src = _src_view(layout, req.item)
            _check_sizes(req.item, req.target, src.size())
            if src.numel() == 0:
                continue
            if _direct_ok(src, req.target):
                a = data_abs + src.storage_offset() * isz
                wants.append((a, a + src.numel() * isz, req, None, src))
            else:
                lo, hi = _covering(src)
                wants.append((data_abs + lo * isz, data_abs + hi * isz, req, torch.empty((hi - lo) * isz, dtype=torch.uint8), src))
        wants.sort(key=lambda w: w[0])
        overlapping = any(wants[i][0] < wants[i - 1][1] for i in range(1, len(wants)))
        if overlapping or any(w[0] < data_abs or w[1] > data_abs + layout.nbytes for w in wants):
            # Two requests read the same bytes: one buffer for the item's data.
            wants = []
            buf = torch.empty(layout.nbytes, dtype=torch.uint8)

            def all_reqs(_t, _mv, st=st, buf=buf, layout=layout) -> None:
                for req in st.reqs:
                    self._copy_from(layout, buf, 0, req, results)

            self._add_range(stream, data_abs, data_abs + layout.nbytes, buf, peek, st.offset, peek_end,
                            cb=all_reqs)
        for a, b, req, buf, src in wants:
            if buf is None:
                dst = _writable_view(req.target)
                results.count(direct_bytes=b - a)
                self._add_range(stream, a, b, req.target, peek, st.offset, peek_end, view=dst)
            else:
                lo = (a - data_abs) // isz

                def copy_out(_t, _mv, req=req, buf=buf, src=src, lo=lo) -> None:
                    view = _strided(_typed(buf, src.dtype), src, lo)
                    req.target.copy_(view)
                    results.count(copied_bytes=buf.numel())

                self._add_range(stream, a, b, buf, peek, st.offset, peek_end, cb=copy_out)
        data_end = data_abs + layout.nbytes
        trailer = st.end - data_end
        if 0 < trailer <= _TRAILER_MAX:
            def check(_t, mv, st=st, layout=layout) -> None:
                if not _check_trailer(mv, layout):
                    with results.lock:
                        results.redo.append(st)

            if data_end >= peek_end:
                stream.add_scratch(data_end, trailer, check)
            else:  # tiny item fully inside the peek (only when _PEEK >= item)
                check(None, memoryview(peek)[data_end - st.offset:])

    def _add_range(self, stream: _Stream, a: int, b: int, keep: torch.Tensor, peek: bytes, peek_off: int,
                   peek_end: int, view: memoryview | None = None,
                   cb: Callable[[torch.Tensor | None, memoryview], None] | None = None) -> None:
        """Fill ``[a, b)`` of the file into ``view`` (default: all of ``keep``): the part already
        in the peek is copied, the rest is added to the stream."""
        if view is None:
            view = _writable_view(keep)
        head = max(min(b, peek_end) - a, 0)
        if head:
            view[:head] = memoryview(peek)[a - peek_off:a - peek_off + head]
        if b - a > head:
            stream.add_view(a + head, view[head:], keep=keep, cb=cb)
        elif cb is not None:
            cb(None, view)

    # -------------------------------------------------------------- decoding from memory
    def _copy_from(self, layout: TensorLayout, base: torch.Tensor, base_data_off: int, req: _Req,
                   results: _Results) -> None:
        """Copy what ``req`` needs from the item data in ``base[base_data_off:]`` into its target."""
        src = _src_view(layout, req.item)
        _check_sizes(req.item, req.target, src.size())
        if src.numel() == 0:
            return
        isz = layout.meta.element_size()
        if _direct_ok(src, req.target):
            a = base_data_off + src.storage_offset() * isz
            n = src.numel() * isz
            _writable_view(req.target)[:] = _writable_view(base)[a:a + n]
            results.count(copied_bytes=n)
            return
        lo, hi = _covering(src)
        u8 = base[base_data_off + lo * isz:base_data_off + hi * isz]
        view = _strided(_typed(u8, src.dtype), src, lo)
        req.target.copy_(view)
        results.count(copied_bytes=(hi - lo) * isz)

    def _decode_whole(self, st: _Stored, mv: memoryview, results: _Results, t: torch.Tensor) -> None:
        """Decode a whole stored item held in memory (``mv``; ``t``: the same bytes as a uint8
        tensor)."""
        if st.is_bytes:
            if st.descriptors:
                data = self._transformed(st, mv).read(-1)
            else:
                data = bytes(mv)
            for req in st.reqs:
                results.add_bytes(req.item, data)
            return
        if not st.descriptors:
            try:
                layout = parse_torch_save_header_cached(mv)
                end = layout.data_offset + layout.nbytes
                if end > len(mv) or not _check_trailer(mv[end:], layout):
                    raise _Unsupported("trailer")
            except (_NeedMore, _Unsupported):
                layout = None
            if layout is not None:
                for req in st.reqs:
                    self._copy_from(layout, t, layout.data_offset, req, results)
                return
        self._stock_decode(st, mv, results)

    def _transformed(self, st: _Stored, mv: memoryview) -> Any:
        raw = io.BytesIO(bytes(mv))
        return self.transforms.transform_load_stream(st.reqs[0].item, st.descriptors, raw)

    def _stock_decode(self, st: _Stored, mv: memoryview, results: _Results) -> None:
        """What ``FileSystemReader.read_data`` does with an item, from bytes in memory."""
        results.count(fallback_items=1)
        stream = self._transformed(st, mv)
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
            stream.seek(0)
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        for req in st.reqs:
            view = narrow_tensor_by_index(tensor, req.item.storage_offsets, req.item.lengths)
            _check_sizes(req.item, req.target, view.size())
            req.target.copy_(view)

    def _redo(self, st: _Stored, results: _Results) -> None:
        path = str(Path(self.path) / st.relpath)
        fd = os.open(path, os.O_RDONLY)
        try:
            _buf, mv = self._pread_item(fd, path, st)
        finally:
            os.close(fd)
        self._stock_decode(st, mv, results)

