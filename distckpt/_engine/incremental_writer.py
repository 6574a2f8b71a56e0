"""The write side of incremental checkpoints: skip tensors whose bytes did not change.

:class:`IncrementalFileSystemWriter` hashes (xxh3-128) the bytes of every tensor item of this
rank's plan before writing. An item whose key -- fully qualified name, chunk offsets, chunk
sizes and dtype -- and hash equal those of an item of the previous committed checkpoint is not
written: its ``WriteResult`` points at the stored bytes of that item, in the file that first
stored them, through a path relative to the new checkpoint (``../step-000000100/__0_0.distcp``,
offset and length as recorded), which DCP's stock ``FileSystemReader`` follows. Everything else
is written by :class:`~distckpt._engine.writer.CheckedFileSystemWriter` as usual. Each rank then
records its items (key, hash, file, offset, length) in ``__<rank>_items.json`` in the new
checkpoint, written (and hashed) through the same file system, which is what the next save
compares with.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._ondisk.integrity import new_hasher
from .torch_format.internals import StorageInfo
from .writer import CheckedFileSystemWriter

__all__ = [
    "ITEMS_SUFFIX",
    "ItemRecord",
    "ReuseIndex",
    "IncrementalFileSystemWriter",
    "item_key",
    "tensor_digest",
    "read_item_records",
]

ITEMS_SUFFIX = "items.json"
"""Per rank ``__<rank>_items.json``: the item records of an incremental checkpoint."""


@dataclasses.dataclass(frozen=True)
class ItemRecord:
    """Where one stored tensor item's bytes are, and their hash.

    Attributes:
        hash: xxh3-128 hex of the tensor chunk's raw bytes (not of the stored record).
        file: the file holding it, relative to the checkpoint that records it (``__0_0.distcp``,
            or ``../step-000000100/__0_0.distcp`` for a reference).
        offset, length: the stored record's byte range in ``file`` (as DCP's metadata).
    """

    hash: str
    file: str
    offset: int
    length: int


@dataclasses.dataclass
class ReuseIndex:
    """What an incremental save may reuse.

    Attributes:
        base: name of the previous committed checkpoint (``step-000000100``), or ``None`` for
            a full save (nothing reused; items are still hashed and recorded).
        records: ``{item key: ItemRecord}`` of every rank of ``base``, files relative to it.
        since_full: saves since the last full one, counting this one (0: this is full).
    """

    base: str | None
    records: dict[str, ItemRecord]
    since_full: int

    def reference(self, record: ItemRecord) -> str:
        """``record``'s file relative to a sibling of ``base``: always the file that first
        stored the bytes (a reference of ``base`` is kept as it is, never chained)."""
        if record.file.startswith("../"):
            return record.file
        return f"../{self.base}/{record.file}"


def item_key(item: WriteItem) -> str | None:
    """``fqn|chunk offsets|chunk sizes|dtype`` of a tensor item; ``None`` for a bytes item.
    A changed shard layout (another world size, FULL vs SHARDED) gives another key."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return None
    chunk = item.tensor_data.chunk
    return f"{item.index.fqn}|{list(chunk.offsets)}|{list(chunk.sizes)}|{item.tensor_data.properties.dtype}"


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 hex of a tensor's values as raw bytes, in row-major order (any strides)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    hasher = new_hasher()
    if t.numel():
        hasher.update(t.view(torch.uint8).numpy())
    return hasher.hexdigest()


def read_item_records(checkpoint_dir: str | os.PathLike) -> tuple[dict[str, ItemRecord], int] | None:
    """Every rank's item records of a checkpoint and its ``since_full``; ``None`` when it has
    none (not written incrementally).

    Raises:
        OSError, ValueError, KeyError: an unreadable or malformed records file.
    """
    files = sorted(Path(checkpoint_dir).glob(f"__*_{ITEMS_SUFFIX}"))
    if not files:
        return None
    records: dict[str, ItemRecord] = {}
    since_full = 0
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        since_full = max(since_full, int(data["since_full"]))
        for key, r in data["items"].items():
            records[key] = ItemRecord(hash=r["hash"], file=r["file"], offset=int(r["offset"]), length=int(r["length"]))
    return records, since_full


class IncrementalFileSystemWriter(CheckedFileSystemWriter):
    """:class:`CheckedFileSystemWriter` that writes only tensor items whose bytes changed since
    ``reuse.base`` (see the module docstring) and records every item's hash.

    Args:
        path, thread_count, write_timeout_s: as :class:`CheckedFileSystemWriter`.
        reuse: the previous checkpoint's records (``reuse.base`` ``None``: write everything),
            or a picklable callable returning them, called at the start of ``write_data`` (so an
            async save reads the previous records in the background, not in the stall).

    Attributes:
        reused_bytes: stored bytes of this rank's items that were referenced, not written
            (after ``write_data``).

    Raises:
        As :class:`CheckedFileSystemWriter`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int,
        reuse: ReuseIndex | Callable[[], ReuseIndex],
        write_timeout_s: float | None = None,
    ) -> None:
        super().__init__(path, thread_count=thread_count, write_timeout_s=write_timeout_s)
        self._source = reuse
        self.reused_bytes = 0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        """Hash every tensor item, reference the unchanged ones, write the rest and this rank's
        ``__<rank>_items.json``; returns DCP's future of every item's ``WriteResult``."""
        reuse = self._source if isinstance(self._source, ReuseIndex) else self._source()
        fresh: list[WriteItem] = []
        reused: list[WriteResult] = []
        records: dict[str, ItemRecord] = {}
        digests: dict[Any, tuple[str, str]] = {}  # index of a written item -> (key, hash)
        for item in plan.items:
            key = item_key(item)
            if key is None:
                fresh.append(item)
                continue
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)  # a tensor item resolves to a tensor
            digest = tensor_digest(data)
            prev = reuse.records.get(key) if reuse.base is not None else None
            if prev is not None and prev.hash == digest:
                ref = reuse.reference(prev)
                reused.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=prev.length,
                        storage_data=StorageInfo(ref, prev.offset, prev.length),
                    )
                )
                records[key] = ItemRecord(digest, ref, prev.offset, prev.length)
                self.reused_bytes += prev.length
            else:
                fresh.append(item)
                digests[item.index] = (key, digest)
        results: list[WriteResult] = super().write_data(dataclasses.replace(plan, items=fresh), planner).wait()
        for wr in results:
            if wr.index in digests:
                key, digest = digests[wr.index]
                info = wr.storage_data
                records[key] = ItemRecord(digest, info.relative_path, info.offset, info.length)
        self._write_records(plan, reuse, records)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results + reused)
        return future

    def _write_records(self, plan: SavePlan, reuse: ReuseIndex, records: dict[str, ItemRecord]) -> None:
        prefix = plan.storage_data.prefix  # "__<rank>_" (FileSystemWriter's _StoragePrefix)
        payload = {
            "version": 1,
            "hash_algorithm": "xxh3_128",
            "since_full": reuse.since_full,
            "base": reuse.base,
            "items": {k: dataclasses.asdict(r) for k, r in sorted(records.items())},
        }
        path = self.fs.concat_path(self.path, f"{prefix}{ITEMS_SUFFIX}")
        with self.fs.create_stream(path, "wb") as stream:
            stream.write(json.dumps(payload, indent=0).encode())
            stream.flush()
            os.fsync(stream.fileno())
