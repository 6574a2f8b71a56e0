"""Finding, verifying and moving the memory tier's snapshot chunks across ranks: the newest step
whose every shard survives in some node's memory, and its chunks served to DCP at any world size
(docs/memory.md, "How it works"). :mod:`distckpt._memory.source` drives these steps; the read into the
training state is the one every load makes (:func:`~distckpt._load.read.read_checkpoint`).

All collective, on every rank of the new job:

1. **Inventory.** Each rank lists its node's memory directory; the node's ranks split its files
   and each verifies its share (preamble, header and data hashes). A corrupt file is left out
   (a warning names it), so its replica on another node serves instead.
2. **Consistent cut.** From every rank's inventory: the newest ``(step, world size, generation)``
   for which every rank's shard is present on a surviving node, as its own snapshot or a replica.
3. **Plan.** DCP ``Metadata`` built from the cut's headers; each rank plans its load with
   distckpt's load planner, as a durable load does, and so learns which stored chunks it needs.
4. **Move.** A chunk held on the rank's own node is read from there; any other is requested from a
   rank on a node that holds it and arrives over the process group (point-to-point sends), never
   through another node's file system. The files are mapped within the plan's agreement, so the
   moves need none of their own (:func:`map_chunks`, :func:`fetch_chunks`).
5. **Serve.** ``dcp.load`` reads through :class:`MemoryReader`, which serves the chunks from memory.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future
from typing_extensions import override

from .._coord.collective import Collective
from .._engine.safe_io import SafeLoadPlanner
from .._engine.torch_format.internals import narrow_tensor_by_index
from .._errors import CheckpointCorruptError
from .placement import NodeLayout
from .snapfile import parse_name, read_header

__all__ = [
    "Cut",
    "Entry",
    "Fetch",
    "MemoryReader",
    "SnapshotFiles",
    "fetch_chunks",
    "map_chunks",
    "find_cut",
    "inventory",
    "memory_metadata",
    "plan_fetch",
]

logger = logging.getLogger(__name__)

Entry = tuple[int, str, int, int, int, str]  # serving rank, file, step, saved rank, world size, generation


def inventory(directory: str, layout: NodeLayout, rank: int, *, run: str) -> tuple[list[Entry], dict[str, Any]]:
    """This rank's share of its node's snapshot files (the node's ranks split them) that launch
    ``run`` wrote (another launch's are left for reclaiming, never restored); headers checked, data
    not yet (:func:`verify`).

    Returns:
        ``(entries, {file name: header dict})``: the compact entries are what the ranks exchange;
        the headers stay here until a cut needs them (:func:`verify`).
    """
    local = layout.ranks_on(layout.nodes[rank])
    names = sorted(n for n in os.listdir(directory) if parse_name(n)) if os.path.isdir(directory) else []
    out: list[Entry] = []
    headers: dict[str, Any] = {}
    for name in names[local.index(rank) :: len(local)]:
        step, owner, world_size, gen = parse_name(name)  # type: ignore[misc]
        try:
            header = read_header(os.path.join(directory, name), verify=False)
        except CheckpointCorruptError as e:
            logger.warning("memory tier: %s -- not used; a replica or the durable tier serves instead", e)
            continue
        if header.run != run:
            logger.info("memory tier: %s was written by launch %r, not this one (%r); not used", name, header.run, run)
            continue
        if (header.step, header.rank, header.world_size, header.gen) != (step, owner, world_size, gen):
            logger.warning("memory tier: %s: its header disagrees with its name; not used", name)
            continue
        out.append((rank, name, step, owner, world_size, gen))
        headers[name] = header.__dict__
    return out, headers


def verify(
    directory: str, rank: int, cut: Cut, headers: dict[str, Any]
) -> tuple[list[tuple[int, str]], dict[int, dict[str, Any]]]:
    """Hash the files of ``cut`` this rank serves (``headers``: from :func:`inventory`).

    Returns:
        ``([(rank, name)] of each whose data hash does not match (a warning each), {saved rank:
        header}`` of each saved rank whose first holder in ``cut`` is this rank): so the cut's
        headers cross the network once each, not every header of every file to every rank.
    """
    bad, mine = [], {}
    for owner, held in cut.holders.items():
        for i, (server, name) in enumerate(held):
            if server != rank:
                continue
            try:
                read_header(os.path.join(directory, name), verify=True)
            except CheckpointCorruptError as e:
                logger.warning("memory tier: %s -- not used; a replica or the durable tier serves instead", e)
                bad.append((rank, name))
                continue
            if i == 0:
                mine[owner] = headers[name]
    return bad, mine


@dataclass
class Cut:
    """A restorable snapshot: every rank's shard of one step, and where each is held.

    Attributes:
        step, world_size, gen: the snapshot's step, the world size and generation that wrote it.
        holders: ``{saved rank: [(serving rank now, file name)]}`` (own copies and replicas).
        headers: ``{saved rank: header dict}``, once verified.
    """

    step: int
    world_size: int
    gen: str
    holders: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    headers: dict[int, dict[str, Any]] = field(default_factory=dict)


def find_cut(entries: list[Entry]) -> tuple[Cut | None, str]:
    """The newest complete snapshot among all ranks' ``entries``, and why (for the log); its
    ``headers`` are filled once its files are verified (:func:`verify`)."""
    cuts: dict[tuple[int, int, str], Cut] = {}
    for server, name, step, owner, world_size, gen in entries:
        cut = cuts.setdefault((step, world_size, gen), Cut(step, world_size, gen))
        cut.holders.setdefault(owner, []).append((server, name))
    if not cuts:
        return None, "no snapshot in any node's memory"
    complete = [c for c in cuts.values() if len(c.holders) == c.world_size]
    newest = max(cuts.values(), key=lambda c: (c.step, len(c.holders)))
    if not complete:
        missing = sorted(set(range(newest.world_size)) - set(newest.holders))
        return None, f"step {newest.step} lacks the shards of ranks {missing} (lost with their nodes)"
    best = max(complete, key=lambda c: c.step)
    why = f"step {best.step}, all {best.world_size} shards present"
    if newest.step > best.step:
        why += f" (step {newest.step} is incomplete)"
    return best, why


def memory_metadata(cut: Cut) -> tuple[Metadata, dict[MetadataIndex, list[tuple[int, list[Any]]]]]:
    """DCP ``Metadata`` of ``cut``, and ``{storage index: [(saved rank, header item)]}`` (duplicates:
    the same chunk stored by several ranks)."""
    sd_md: dict[str, Any] = {}
    where: dict[MetadataIndex, list[tuple[int, list[Any]]]] = {}
    for owner in sorted(cut.headers):
        for item in cut.headers[owner]["items"]:
            fqn, kind, offsets, sizes, size, dtype = item[:6]
            if kind == "bytes":
                sd_md[fqn] = BytesStorageMetadata()
                key = MetadataIndex(fqn)
            else:
                dt = getattr(torch, dtype.removeprefix("torch."))
                md = sd_md.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size(size), []))
                key = MetadataIndex(fqn, torch.Size(offsets))
                if key not in where:
                    md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            where.setdefault(key, []).append((owner, item))
    paths = {fqn: tuple(path) for owner in cut.headers for fqn, path in cut.headers[owner].get("paths", {}).items()}
    return Metadata(state_dict_metadata=sd_md, planner_data=paths, storage_data=where), where


@dataclass
class Fetch:
    """Where each chunk a rank's load needs comes from (:func:`plan_fetch`).

    Attributes:
        local: ``{storage index: (file, offset, length)}`` held on this rank's node.
        asks: ``{serving rank: [(file, offset, length)]}`` to request from other nodes.
        remote: ``{serving rank: [storage index]}``, in the order of ``asks``.
    """

    local: dict[MetadataIndex, tuple[str, int, int]] = field(default_factory=dict)
    asks: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    remote: dict[int, list[MetadataIndex]] = field(default_factory=dict)


def plan_fetch(
    cut: Cut,
    where: dict[MetadataIndex, list[tuple[int, list[Any]]]],
    needed: list[MetadataIndex],
    *,
    layout: NodeLayout,
    rank: int,
) -> Fetch:
    """Where rank ``rank`` gets each ``needed`` chunk: its node's memory when it holds the chunk, else
    a rank on a node that does (the clients spread over the holders)."""
    node, out = layout.nodes[rank], Fetch()
    for key in needed:
        owner, item = where[key][0]
        held = cut.holders[owner]
        offset, length = item[6], item[7]
        here = next((name for s, name in held if layout.nodes[s] == node), None)
        if here is not None:
            out.local[key] = (here, offset, length)
            continue
        server, name = held[rank % len(held)]
        out.asks.setdefault(server, []).append((name, offset, length))
        out.remote.setdefault(server, []).append(key)
    return out


def map_chunks(
    fetch: Fetch, cut: Cut, *, rank: int, directory: str
) -> tuple[SnapshotFiles, dict[MetadataIndex, torch.Tensor]]:
    """Map the files of ``cut`` this rank serves, and the chunks of ``fetch`` its node holds
    (``uint8`` tensors over the mappings). Runs inside the plan's agreement: a file that cannot be
    mapped fails the restore on every rank there, so no rank ever waits for a send that never comes.

    Raises:
        OSError: a file cannot be opened or mapped.
        CheckpointCorruptError: a chunk lies past the end of its file.
    """
    files = SnapshotFiles(directory)
    for held in cut.holders.values():
        for server, name in held:
            if server == rank:
                files.open(name)
    return files, {key: files(n, o, ln) for key, (n, o, ln) in fetch.local.items()}


def fetch_chunks(
    fetch: Fetch,
    all_asks: list[dict[int, list[tuple[str, int, int]]]],
    files: SnapshotFiles,
    local: dict[MetadataIndex, torch.Tensor],
    *,
    collective: Collective,
) -> tuple[dict[MetadataIndex, torch.Tensor], int, int, Exception | None]:
    """The stored bytes of each chunk of ``fetch`` (``uint8`` tensors): ``local`` (from
    :func:`map_chunks`), and those sent by the rank that serves them, which learnt the requests from
    ``all_asks`` (every rank's ``Fetch.asks``, in rank order, exchanged with the plan). Collective
    (point-to-point only).

    A rank that cannot build what a client asked (its files were mapped in the plan, so only a
    damaged file or no memory left) still sends that many bytes, so no client waits, and returns
    the error: the read raises it (:class:`MemoryReader`), inside the read's agreement.

    Returns:
        ``({storage index: bytes}, bytes this rank received, bytes all ranks moved between nodes,
        the error of a failed send or None)``.
    """
    rank = collective.rank
    error: Exception | None = None
    sends: dict[int, torch.Tensor] = {}
    for client, theirs in enumerate(all_asks):
        asked = theirs.get(rank) if client != rank else None
        if not asked:
            continue
        try:
            sends[client] = torch.cat([files(n, o, ln) for n, o, ln in asked])
        except Exception as e:  # noqa: BLE001 - raised by the read, agreed there
            error = error or e
            sends[client] = torch.zeros(sum(ln for _, _, ln in asked), dtype=torch.uint8, device="cpu")
    works = [dist.isend(blob, group=collective.group, group_dst=client) for client, blob in sends.items()]
    chunks = dict(local)
    received = 0
    for server, keys in sorted(fetch.remote.items()):
        lengths = [ln for _, _, ln in fetch.asks[server]]
        buf = torch.empty(sum(lengths), dtype=torch.uint8, device="cpu")
        dist.recv(buf, group=collective.group, group_src=server)
        received += buf.numel()
        chunks.update(zip(keys, torch.split(buf, lengths)))
    for w in works:
        if w is not None:
            w.wait()
    moved = sum(ln for theirs in all_asks for requests in theirs.values() for _, _, ln in requests)
    return chunks, received, moved, error


class SnapshotFiles:
    """Chunks of snapshot files as ``uint8`` tensors over private (copy-on-write) mappings: no copy
    out of the tmpfs until DCP copies into the destination tensors. A file stays mapped, and so
    readable, even if it is removed after :meth:`open`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.maps: dict[str, mmap.mmap] = {}

    def open(self, name: str) -> mmap.mmap:
        """Map file ``name`` of the directory (once). Raises ``OSError``."""
        if name not in self.maps:
            with open(os.path.join(self.directory, name), "rb") as f:
                self.maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self.maps[name]

    def __call__(self, name: str, offset: int, length: int) -> torch.Tensor:
        """``length`` bytes at ``offset`` of file ``name``.

        Raises:
            OSError: the file cannot be mapped.
            CheckpointCorruptError: the range lies past the file's end.
        """
        mm = self.open(name)
        if offset + length > len(mm):
            path = os.path.join(self.directory, name)
            raise CheckpointCorruptError(f"memory snapshot {path}: {length} bytes at {offset} past its end", path=path)
        if not length:
            return torch.empty(0, dtype=torch.uint8, device="cpu")
        return torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=offset)


def plan_needed(target: dict[str, Any], metadata: Metadata, *, is_coordinator: bool) -> list[MetadataIndex]:
    """The storage indices the load of ``target`` reads, as distckpt's load planner plans it."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(target, metadata, is_coordinator)
    return list(dict.fromkeys(item.storage_index for item in planner.create_local_plan().items))


class MemoryReader(StorageReader):
    """A DCP ``StorageReader`` over chunks already in memory (:func:`fetch_chunks`).

    Args:
        metadata: from :func:`memory_metadata`.
        where: ``{storage index: [(saved rank, header item)]}``, for dtypes and shapes.
        chunks: ``{storage index: uint8 tensor}`` holding every chunk this rank's plan reads.
        error: what failed while this rank served other ranks' chunks (:func:`fetch_chunks`):
            raised by :meth:`read_data` as ``CheckpointCorruptError``, so every rank learns it.
    """

    def __init__(
        self,
        metadata: Metadata,
        where: dict,
        chunks: dict[MetadataIndex, torch.Tensor],
        error: Exception | None = None,
    ) -> None:
        super().__init__()
        self.metadata, self.where, self.chunks, self.error = metadata, where, chunks, error

    @override
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    @override
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @override
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.error is not None:
            raise CheckpointCorruptError(f"serving memory snapshot chunks to other ranks failed: {self.error}")
        for req in plan.items:
            raw = self.chunks[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                continue
            item = self.where[req.storage_index][0][1]
            dtype = getattr(torch, item[5].removeprefix("torch."))
            if raw.data_ptr() % dtype.itemsize:  # received after a small value of odd length: unaligned
                raw = raw.clone()
            tensor = raw.view(dtype).view(item[3]) if raw.numel() else torch.empty(item[3], dtype=dtype, device="cpu")
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    @override
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False
