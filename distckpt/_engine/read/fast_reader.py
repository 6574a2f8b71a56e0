"""Fast DCP load path: large sequential reads straight into the destination tensors.

:class:`FastFileSystemReader` is a drop-in ``StorageReader`` for ``dcp.load`` (a subclass of
:class:`~distckpt._engine.safe_io.SafeFileSystemReader`: same safe ``.metadata`` unpickler, same
``expected_files`` contract). It reads checkpoints written by distckpt or by plain
``dcp.save`` (``FileSystemWriter``, default ``torch.save`` serialization).

Why the stock reader is slow
    ``FileSystemReader.read_data`` walks the plan item by item: for each item it hands a file
    view to ``torch.load`` (several small reads through Python, a fresh tensor, the storage
    copied into it), then ``copy_`` s that tensor into the destination: every byte is copied
    twice in user space, one item at a time, with one reader, and the CPU work does not
    overlap the I/O. Cold reads want large requests; ``O_DIRECT`` and ``POSIX_FADV_SEQUENTIAL``
    / ``WILLNEED`` hints were slower than plain buffered reads with the kernel's default
    readahead, so the reader stays buffered (figures: ``benchmarks/README.md``).

How this reader reads (one module per part)
    * Per file, the stored items this rank needs are sorted by offset and read front to back
      by a *stream* (its own file descriptor, so the kernel's readahead sees a sequential
      reader). Up to ``thread_count`` streams run in parallel: one per file, and without
      hashes spare threads split the biggest files into contiguous regions (this module; the
      stream itself: :mod:`~distckpt._engine.read.read_stream`).
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
      range is read into a buffer and ``copy_`` d through a strided view of it (the parser:
      :mod:`~distckpt._engine.torch_format.save_format`).
    * The first big item of a stream is located by reading its first ``PEEK_BYTES``; later
      ones are *predicted* (same header length as the previous item, a compact storage of the
      chunk size and dtype that DCP's metadata records -- DCP clones views before saving) and
      checked after the read against their real header and zip data descriptor. So one
      ``preadv`` carries many items: header bytes into the arena, data into the destinations,
      trailers into the arena, small items (up to ``direct_min_bytes``) whole into the arena
      (decoded from memory: a memcpy), bytes other ranks need (gaps up to ``gap_read_bytes``)
      into the arena -- up to ``max_request_bytes`` per request, never re-reading a byte
      (:mod:`~distckpt._engine.read.item_planner`).
    * An item whose header or trailer does not match the prediction or the parsed layout is
      decoded again the stock way (``torch.load`` of the whole item, read apart). Any item the
      parser does not fully understand (an unexpected zip layout, a pickle with more or fewer
      than one storage, big-endian data, transform descriptors / extensions) is decoded from
      its bytes the way ``FileSystemReader`` does (transforms, then
      ``torch.load(weights_only=True)``); ``BYTE_IO`` items go to ``planner.load_bytes``
      (:mod:`~distckpt._engine.read.item_decode`).

Integrity
    * Without hashes: the file size is compared with the manifest (when given) and with the
      end of the last item this rank reads before anything is read; a read that ends early is
      never accepted as data (``CheckpointCorruptError`` naming the file).
    * With hashes (``expected_files`` digests): the xxh3-128 of the file is computed from the
      very bytes the stream reads, in file order, so there is no second pass. With hashes a
      file is one stream.
    * Ranged reads (resharding): when this rank needs less than ``RANGED_MAX_FRACTION`` of a
      file's bytes and the manifest has the file's block digests (``block_digests``: POSIX
      saves record them, :mod:`distckpt._ondisk.integrity`), the stream reads only the blocks that hold
      a byte it reads -- each whole, so it can be verified -- and skips the others; each block is
      verified when its last byte is read (``CheckpointCorruptError`` naming the file, the
      block's byte range and what to do). Blocks start where each stored tensor's data starts,
      so a rank that needs half of a stored shard reads about half of it. Items decoded apart
      from the stream (overlapping or mispredicted ones) are read with their covering blocks
      and verified too (:mod:`~distckpt._engine.read.read_verify`).
    * Otherwise -- the rank needs (nearly) all of the file, or the manifest has no block
      digests (older manifests, object storage, ``async_save.mode: process`` saves) -- the digest
      covers the whole file, so the stream reads the bytes it does not need too, sequentially,
      into a bounded scratch buffer that is only hashed (reading the rest once, in order, is
      cheaper than ``check_file``'s separate pass followed by reads of the needed parts). A
      file is verified whole at most once per reader.
    * ``last_stats`` counts ``read_bytes`` (every byte read from the files) against
      ``needed_bytes`` (the bytes of the items this rank's plan reads: the narrowed shard for a
      tensor, the whole item for bytes), ``ranged_files`` and ``verified_blocks``.
    * Bytes land in the destination tensors as they are read, so a digest mismatch is detected
      after the destination was written: on ``CheckpointCorruptError`` the destination state
      is unspecified (partially loaded), exactly as after any failed ``dcp.load``; callers must
      not use it (the manager raises or falls back to an older checkpoint, which rewrites it).

Planner calls (all in the calling thread; ``load_bytes`` after all reads, in plan order)
    DCP's contract is resolve, copy, commit, one item at a time: a planner may hand out one
    scratch buffer from ``resolve_tensor`` and copy it into the real target in ``commit_tensor``.
    A planner that keeps ``DefaultLoadPlanner``'s two methods (``SafeLoadPlanner``: distckpt's
    own) gets views of its state dict and a no-op commit, so the order cannot be observed: every
    request is resolved up front, streams read into the views in parallel, commits come last.
    Any other planner gets the per-item order: one stream at a time, each stored item read whole
    (one copy out of the arena), then for each of its requests resolve, copy, commit.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..._errors import CheckpointCorruptError, ReaderInvariantError
from ..._ondisk.integrity import BlockDigests, describe_path
from ..safe_io import SafeFileSystemReader
from ..torch_format.internals import StorageReaderTransforms
from ..torch_format.save_format import HeaderCache, TensorLayout, parse_torch_save_header
from .item_decode import ItemDecoder
from .item_planner import PEEK_BYTES, ChunkIndex, ItemPlanner, needed_bytes, resolves_in_place
from .read_stream import (
    WARM_GAP_BYTES,
    ReadRequest,
    ReadResults,
    ReadStream,
    StoredItem,
    fstat_size,
    page_cached,
    read_item,
)
from .read_verify import BlockCheck, WholeFileCheck

__all__ = ["FastFileSystemReader", "parse_torch_save_header", "TensorLayout"]

_MIB = 1 << 20
# A rank that needs at least this fraction of a file's bytes reads it whole in one verified
# stream: skipping the few blocks left would break the sequential read and save little.
RANGED_MAX_FRACTION = 0.9


# ============================================================================ the reader
class FastFileSystemReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` that reads each file front to back in large ``preadv`` calls
    straight into the destination tensors, verifying hashes from the bytes it reads.

    Args:
        path: checkpoint directory.
        expected_files: ``{relative path: (size_bytes, digest or None)}``; sizes are checked
            before reading, digests (xxh3-128) from the bytes read; ``None`` skips both.
        thread_count: read streams per rank (default 2): one per file; without hashes spare
            ones split big files into regions. On a disk with a shallow queue a second stream
            gains little; on storage with deeper queues (NVMe) parallel streams matter more.
            ``thread_count`` is per rank: ``CheckpointManager`` divides
            ``load.streams_per_node`` among a node's ranks.
        chunk_bytes: arena size per stream for small items and read-through gaps (one request).
        direct_min_bytes: stored items larger than this are read into their destination
            directly; smaller ones are read whole (coalesced) and copied out of the arena.
        max_request_bytes: upper bound of one request (hashing interleaves at this granularity).
        gap_read_bytes: bytes this rank does not need (resharding: other ranks' rows of a stored
            shard) are read through, into the arena, when the gap is at most this long, so the
            stream stays one sequential reader; longer gaps are skipped (or, when hashing, read
            in ``chunk_bytes`` pieces only to be hashed). Small holes skipped make each read a
            small random read, which costs several times more per byte on a cold cache; the
            bytes read through are usually read by the rank that needs them at the same time,
            so the disk sees them once (page cache). When a stream's range is already in the
            page cache (``RWF_NOWAIT`` probes), only gaps up to 64 KiB are read through.
        block_digests: ``{relative path: BlockDigests}`` from the manifest (with
            ``expected_files``): files this rank needs only part of are read in verified blocks
            (module docstring, "Integrity"); ``None`` or a file missing: whole-file reads.
        _extension_registry: as ``FileSystemReader``'s (experimental): decodes items saved with
            stream transforms (those items take the stock decode path).

    Attributes:
        last_stats: counters of the last ``read_data`` (bytes read, direct, copied, fallbacks).
        header_cache: this reader's bounded cache of parsed item headers (not shared with
            other readers).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        expected_files: dict[str, tuple[int, str | None]] | None = None,
        thread_count: int = 2,
        *,
        chunk_bytes: int = 32 * _MIB,
        direct_min_bytes: int = 1 * _MIB,
        max_request_bytes: int = 16 * _MIB,
        gap_read_bytes: int = 4 * _MIB,
        block_digests: Mapping[str, BlockDigests] | None = None,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__(path, expected_files=expected_files)
        if _extension_registry is not None:  # as FileSystemReader's experimental argument
            self.transforms = StorageReaderTransforms(_extension_registry)
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.thread_count = int(thread_count)
        self.chunk_bytes = max(int(chunk_bytes), _MIB)
        self.direct_min_bytes = max(int(direct_min_bytes), PEEK_BYTES)
        self.max_request_bytes = max(int(max_request_bytes), _MIB)
        self.gap_read_bytes = max(int(gap_read_bytes), 0)
        self.block_digests = block_digests if block_digests is not None else {}  # looked up lazily
        self._block_checks: dict[str, BlockCheck] = {}  # files of this read_data read in blocks
        self._checks_lock = threading.Lock()
        self._ranged: set[str] = set()
        self.last_stats: dict[str, int] = {}
        self.header_cache = HeaderCache()
        self._chunks = ChunkIndex(None)

    # -------------------------------------------------------------- public StorageReader API
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the tensors ``planner`` resolves (see the module
        docstring for the order of planner calls).

        Raises:
            CheckpointCorruptError: a file is missing, shorter than the metadata or manifest
                says, not listed in the manifest, or its digest does not match.
        """
        stored: dict[Any, StoredItem] = {}
        per_item = not resolves_in_place(planner)
        for item in plan.items:
            md = self.storage_data[item.storage_index]
            key = (md.relative_path, md.offset, md.length)
            st = stored.get(key)
            is_bytes = item.type == LoadItemType.BYTE_IO
            if st is None:
                st = stored[key] = StoredItem(
                    md.relative_path,
                    md.offset,
                    md.length,
                    tuple(getattr(md, "transform_descriptors", None) or ()),
                    is_bytes,
                )
            if is_bytes:
                st.reqs.append(ReadRequest(item, None))
            elif per_item:
                st.reqs.append(ReadRequest(item, None))
            else:
                target = planner.resolve_tensor(item)
                st.reqs.append(ReadRequest(item, target.detach() if target.requires_grad else target))
        per_file: dict[str, list[StoredItem]] = {}
        for st in stored.values():
            per_file.setdefault(st.relpath, []).append(st)

        results = ReadResults()
        needed = {name: sum(needed_bytes(st, self._chunks) for st in items) for name, items in per_file.items()}
        results.count(needed_bytes=sum(needed.values()))
        decoder = ItemDecoder(self.transforms, self.header_cache, results, planner if per_item else None)
        item_planner = ItemPlanner(decoder, self._chunks, self.header_cache, self.direct_min_bytes, results)
        self._block_checks = {}
        jobs = self._make_jobs(per_file, needed)
        self._run_jobs(jobs, item_planner, results, 1 if per_item else self.thread_count)
        for st in results.redo:  # trailer did not match the parsed layout: decode the stock way
            self._redo(st, decoder)
        # Planner callbacks in the calling thread, in plan order.
        bytes_by_item = {id(req): data for req, data in results.bytes_items}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                data = bytes_by_item.get(id(item))
                if data is None:
                    raise ReaderInvariantError(f"{item.storage_index}: bytes item was not read")
                planner.load_bytes(item, io.BytesIO(data))
        # Targets resolved up front: the planner's commit_tensor is DefaultLoadPlanner's no-op
        # (resolves_in_place); per item, the decoder commits each.
        self.last_stats = dict(results.stats)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # -------------------------------------------------------------- jobs
    def _make_jobs(
        self, per_file: dict[str, list[StoredItem]], needed: dict[str, int]
    ) -> list[tuple[str, list[StoredItem], bool]]:
        """``(relpath, items, verify)`` per stream; ``self._ranged``: the files to read in
        verified blocks.

        ``thread_count`` streams in all: one per file, and without hashing the spare threads
        split the biggest files into contiguous regions, one stream each. With hashing a file
        is one stream (the digest needs the bytes in order). A pre-reader filling the page
        cache ahead of a hashed stream was tried and removed: it added a copy and was slower.
        """
        jobs = []
        checks: dict[str, tuple[int, str | None]] = {}
        for name in sorted(per_file):
            if self.expected_files is not None and name not in self._checked:
                if name not in self.expected_files:
                    raise CheckpointCorruptError(
                        f"{Path(self.path) / name}: DCP metadata refers to a file the {self.expected_source} "
                        "does not list",
                        path=str(Path(self.path) / name),
                    )
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
            groups: list[list[StoredItem]] = [[]]
            acc = 0
            for st in items:
                if groups[-1] and len(groups) < parts and acc >= share * len(groups):
                    groups.append([])
                groups[-1].append(st)
                acc += st.length
            jobs += [(name, g, False) for g in groups]
        self._pending_checks = checks
        self._ranged = set()
        for name in checks:
            blocks = self.block_digests.get(name)
            size, digest = checks[name]
            if (
                digest is not None
                and blocks is not None
                and blocks.valid_for(size)
                and needed[name] < RANGED_MAX_FRACTION * size
                and not _overlapping(per_file[name])
            ):
                self._ranged.add(name)
        # Ranks that read parts of the same files (a reshard, replicated DDP state loaded into
        # FSDP2 shards) start at files spread evenly over the list, so the disk serves
        # sequential streams in different files rather than all ranks in one file. Measured
        # (DDP at 2 -> FSDP2 at 2, 1 GiB in 8 files, cold, 3 rounds): 0.361 s vs 0.479 s.
        if dist.is_available() and dist.is_initialized() and jobs:
            k = dist.get_rank() * len(jobs) // dist.get_world_size()
            jobs = jobs[k:] + jobs[:k]
        return jobs

    def _run_jobs(
        self,
        jobs: list[tuple[str, list[StoredItem], bool]],
        planner: ItemPlanner,
        results: ReadResults,
        thread_count: int,
    ) -> None:
        if not jobs:
            return
        verified: list[str] = []
        lock = threading.Lock()

        def run(job: tuple[str, list[StoredItem], bool]) -> None:
            name, items, verify = job
            if self._stream_file(name, items, verify, planner, results):
                with lock:
                    verified.append(name)

        workers = min(thread_count, len(jobs))
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
    def _stream_file(
        self, relpath: str, items: list[StoredItem], verify: bool, planner: ItemPlanner, results: ReadResults
    ) -> bool:
        """Read ``items`` (of one file, in offset order) as one stream; ``True`` when the
        file's digest was checked."""
        path = str(Path(self.path) / relpath)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            what = (
                f"file listed in the {self.expected_source}"
                if relpath in self._pending_checks
                else "checkpoint data file"
            )
            raise CheckpointCorruptError(f"{describe_path(path)}: {what} is missing", path=path) from None
        except OSError as e:
            raise CheckpointCorruptError(f"{describe_path(path)}: cannot open ({e})", path=path) from e
        try:
            file_size = fstat_size(fd)
            expected = self._pending_checks.get(relpath)
            if expected is not None and file_size != expected[0]:
                raise CheckpointCorruptError(
                    f"{describe_path(path)}: size {file_size} bytes, {self.expected_source} expects "
                    f"{expected[0]} bytes (truncated?)",
                    path=path,
                )
            need_end = max(st.end for st in items)
            if file_size < need_end:
                raise CheckpointCorruptError(
                    f"{describe_path(path)}: truncated: the file has {file_size} bytes, but the checkpoint's "
                    f"metadata places data up to byte {need_end}",
                    path=path,
                )
            check: WholeFileCheck | BlockCheck | None = None
            if verify:
                assert expected is not None and expected[1] is not None  # verify: the manifest lists a digest
                if relpath in self._ranged:
                    check = BlockCheck(path, self.block_digests[relpath], self.expected_source)
                    results.count(ranged_files=1)
                else:
                    check = WholeFileCheck(path, file_size, expected[1], self.expected_source)
            stream = ReadStream(
                path,
                fd,
                file_size,
                check,
                results,
                0 if verify else items[0].offset,
                chunk_bytes=self.chunk_bytes,
                max_request_bytes=self.max_request_bytes,
                gap_read_bytes=self.gap_read_bytes,
            )
            if isinstance(check, BlockCheck):
                # Ranged: read through only small gaps, so blocks nobody here needs are skipped.
                stream.gap_read_bytes = min(stream.gap_read_bytes, WARM_GAP_BYTES)
            if not verify and stream.gap_read_bytes > WARM_GAP_BYTES and page_cached(fd, items[0].offset, need_end):
                # Already in the page cache: reading other ranks' bytes through would only
                # cost memcpy; skip all but tiny gaps.
                stream.gap_read_bytes = WARM_GAP_BYTES
            side: list[StoredItem] = []
            run: list[StoredItem] = []  # equal small items back to back: one read, one decode
            last_end = stream.pos
            for st in items:
                if st.offset < last_end:  # overlapping items (not written by DCP): read apart
                    side.append(st)
                    continue
                last_end = st.end
                grows = run and st.offset == run[-1].end and st.length == run[0].length
                if grows and (len(run) + 1) * st.length <= self.chunk_bytes:
                    if planner.joins_run(st):
                        run.append(st)
                        continue
                if run:
                    planner.add_run(stream, run)
                run = [st] if planner.joins_run(st) else []
                if not run:
                    planner.add_item(stream, st)
            if run:
                planner.add_run(stream, run)
            stream.flush()  # first: where the check needs the stream to end depends on what it read
            stream.finish_to(check.end_after(stream.pos) if check is not None else stream.pos)
            if check is not None:
                check.finish()
            for st in side:
                buf, mv = read_item(fd, path, st)
                planner.decoder.decode_whole(st, mv, buf)
            if isinstance(check, BlockCheck):
                results.count(verified_blocks=check.verified)
                with self._checks_lock:
                    self._block_checks[relpath] = check
                return False  # verified in part: a later read_data checks its blocks again
            return verify
        finally:
            os.close(fd)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """As ``FileSystemReader``'s; also indexes the chunks ``metadata`` records (predictions)."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = ChunkIndex(metadata)

    def _redo(self, st: StoredItem, decoder: ItemDecoder) -> None:
        """Read ``st`` again, apart, and decode it the stock way."""
        path = str(Path(self.path) / st.relpath)
        fd = os.open(path, os.O_RDONLY)
        try:
            check = self._block_checks.get(st.relpath)
            if check is not None:  # read in blocks: the item's own blocks may not all have been read
                mv = memoryview(check.read_verified(fd, st.offset, st.length))
            else:
                _buf, mv = read_item(fd, path, st)
        finally:
            os.close(fd)
        decoder.stock_decode(st, mv)


def _overlapping(items: list[StoredItem]) -> bool:
    """Whether stored items overlap (not written by DCP): the stream reads those apart."""
    items = sorted(items, key=lambda s: s.offset)
    return any(b.offset < a.end for a, b in zip(items, items[1:]))
