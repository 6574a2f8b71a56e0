"""Read once, then share: a replicated load reads each stored byte from the root once per job.

Under DDP (and for any tensor every rank loads whole: replicated buffers beside FSDP2 shards, a
FULL checkpoint loaded by every rank) each of W ranks would read the same stored items, so a
W-rank load reads W times the checkpoint from shared storage. :class:`SharingReader` (a
:class:`~distckpt._engine.read.fast_reader.FastFileSystemReader`) instead, inside ``read_data``
(every rank calls it once per load):

1. **Which items are shared**: each rank lists the stored tensor items it reads *whole* into a
   contiguous CPU or CUDA destination, keyed by ``(file, offset, length, dtype, shape)``; the ranks
   compare a digest of their lists (one small all-gather) and exchange the lists only when they
   differ. An item is shared when every rank reads it so; everything else (FSDP2 shards,
   reshard slices, bytes items) is read per rank as before.
2. **Who reads what**: shared items are grouped by file and each file goes to one rank, largest
   first to the rank with the fewest bytes so far (balanced; rank order breaks ties) among the
   ranks that read that file for items of their own anyway (a rank's RNG state, an FSDP2 shard),
   so each stored byte of a shared file is read by one rank of the job.
3. **Read, verified**: each rank runs the fast reader on its own items plus the shared files it
   owns: hashes are checked from the bytes read exactly as before (whole file, or blocks).
4. **Agree, then broadcast**: the ranks all-gather their read outcome first, so a digest mismatch
   on an owner makes every rank raise the same ``CheckpointCorruptError`` naming the file (no rank
   waits in a broadcast for bytes that failed verification). Then each owner broadcasts its
   items over the process group: tensors of at least ``BUCKET_BYTES`` straight from and into the
   destinations, smaller ones packed into buckets of up to ``BUCKET_BYTES`` (a few collectives
   per bucket, not one per tensor). The group is distckpt's gloo group, so CUDA destinations
   (a DDP model on GPU) are shared through CPU: the owner copies its device tensor to a CPU
   buffer, the others receive into one and copy it to their own device.

When it does not apply (one rank, a planner that needs DCP's per-item order, less than
``min_bytes`` shared in all) the reader is the fast reader. Cost model (bytes, not seconds): a
W-rank DDP load reads the checkpoint once from the root instead of W times; every rank receives
the bytes it did not read over the process group (W - 1 broadcasts' worth of network per rank
group), which on a shared file system trades root bandwidth for interconnect bandwidth.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..._errors import CheckpointCorruptError, DistCkptError
from .fast_reader import FastFileSystemReader
from .item_planner import resolves_in_place

__all__ = ["SharingReader", "BUCKET_BYTES", "DEFAULT_MIN_BYTES"]

BUCKET_BYTES = 64 << 20
"""Small shared tensors are broadcast packed in buckets of at most this many bytes; larger ones alone."""
DEFAULT_MIN_BYTES = 16 << 20
"""Below this many shared bytes in all, every rank reads for itself (see ``load.read_once``)."""

_Key = tuple[str, int, int, str, tuple[int, ...]]


class SharingReader(FastFileSystemReader):
    """Fast reader that reads replicated items once per job and broadcasts them (module docstring).

    Args:
        *args, **kwargs: as :class:`FastFileSystemReader`.

    Attributes:
        last_stats: as the fast reader's, plus ``shared_bytes`` (bytes of the items this load
            shared), ``shared_bytes_read`` (of those, read by this rank) and ``shared_files``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self.min_bytes = DEFAULT_MIN_BYTES
        self._metadata: Any = None

    def share_over(self, group: dist.ProcessGroup | None, *, min_bytes: int | None = None) -> None:
        """Share replicated items among the ranks of ``group`` (every rank of it loads the same
        checkpoint with this reader); ``None``: the default group. ``min_bytes``: share only when
        at least this many bytes are shared in all (``None``: :data:`DEFAULT_MIN_BYTES`)."""
        self.group = group if group is not None else dist.group.WORLD
        self.min_bytes = DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)

    def _group(self) -> dist.ProcessGroup:
        assert self.group is not None  # sharing: share_over was called
        return self.group

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """As the fast reader's; keeps ``metadata`` (which stored chunk each item reads)."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``, sharing the items every rank reads whole (module docstring).

        Raises:
            CheckpointCorruptError: on every rank when any rank's read failed verification,
                naming the rank and its file.
        """
        if self.group is None or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return super().read_data(plan, planner)
        if not resolves_in_place(planner):
            return super().read_data(plan, planner)
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        mine = self._whole_reads(plan, planner)
        others = {self.storage_data[i.storage_index].relative_path for i in plan.items if id(i) not in mine}
        shared, reading = self._agree_shared(mine, others, world)
        total = sum(k[2] for k in shared)
        if total < self.min_bytes:
            return super().read_data(plan, planner)
        owner = _owners(shared, reading, world)
        keep = [
            item for item in plan.items if (key := mine.get(id(item))) is None or key not in owner or owner[key] == rank
        ]
        error: BaseException | None = None
        values: dict[_Key, bytes] = {}  # the shared bytes items this rank read, for the others
        load_bytes = planner.load_bytes

        def keep_value(item: Any, value: io.BytesIO) -> None:
            if (key := mine.get(id(item))) is not None and key in owner:
                values[key] = value.getvalue()
            load_bytes(item, value)

        planner.load_bytes = keep_value  # type: ignore[method-assign,assignment]
        try:
            future = super().read_data(dataclasses.replace(plan, items=keep), planner)
        except Exception as e:  # noqa: BLE001 - every rank learns of it before any broadcast
            error = e
        finally:
            del planner.load_bytes  # the class's method again
        self._agree_outcome(error, rank)
        stats = dict(self.last_stats)
        self._broadcast(plan, planner, mine, owner, rank)
        self._broadcast_values(plan, planner, mine, owner, values)
        stats.update(
            shared_bytes=total,
            shared_bytes_read=sum(k[2] for k, r in owner.items() if r == rank),
            shared_files=len({k[0] for k in owner}),
        )
        self.last_stats = stats
        return future

    # -------------------------------------------------------------- which items
    def _whole_reads(self, plan: LoadPlan, planner: LoadPlanner) -> dict[int, _Key]:
        """``{id(read item): key}`` of the items this rank reads whole: bytes items, and tensor
        items read into a contiguous CPU or CUDA destination of the stored shape."""
        out: dict[int, _Key] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                md = self.storage_data[item.storage_index]
                out[id(item)] = (md.relative_path, md.offset, md.length, "bytes", ())
                continue
            if any(item.storage_offsets) or any(item.dest_offsets):
                continue
            chunk = self._chunk(item)
            if chunk is None or tuple(item.lengths) != tuple(chunk.sizes):
                continue
            dest = planner.resolve_tensor(item)
            if (
                dest.device.type not in ("cpu", "cuda")
                or not dest.is_contiguous()
                or tuple(dest.shape) != tuple(chunk.sizes)
            ):
                continue
            md = self.storage_data[item.storage_index]
            out[id(item)] = (md.relative_path, md.offset, md.length, str(dest.dtype), tuple(dest.shape))
        return out

    def _chunk(self, item: Any) -> Any:
        meta = self._metadata.state_dict_metadata.get(item.storage_index.fqn) if self._metadata else None
        for chunk in getattr(meta, "chunks", ()):
            if tuple(chunk.offsets) == tuple(item.storage_index.offset or ()):
                return chunk
        return None

    def _agree_shared(self, mine: dict[int, _Key], others: set[str], world: int) -> tuple[list[_Key], list[set[str]]]:
        """The keys every rank reads whole (sorted; a digest of each rank's list first, the lists
        only if they differ), and per rank the files it reads for items not shared."""
        keys = sorted(set(mine.values()))
        digest = hashlib.sha256(pickle.dumps(keys)).hexdigest()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (digest, sorted(others)), group=self.group)
        reading = [set(files) for _, files in gathered]
        if len({d for d, _ in gathered}) == 1:
            return keys, reading
        lists: list[Any] = [None] * world
        dist.all_gather_object(lists, keys, group=self.group)
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        for r, theirs in enumerate(lists):
            reading[r] |= {k[0] for k in theirs if k not in common}
        return sorted(common), reading

    def _agree_outcome(self, error: BaseException | None, rank: int) -> None:
        """All ranks learn every rank's read outcome; any failure is raised on every rank."""
        mine = None
        if error is not None:
            path = getattr(error, "path", None)
            mine = (type(error).__name__, f"rank {rank}: {error}", path)
        outcomes: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(outcomes, mine, group=self.group)
        failed = [o for o in outcomes if o is not None]
        if error is not None:
            raise error
        if failed:
            kind, message, path = failed[0]
            if kind == CheckpointCorruptError.__name__:
                raise CheckpointCorruptError(message, path=path)
            raise DistCkptError(f"reading a shared checkpoint file failed on {message}; this rank stopped too")

    # -------------------------------------------------------------- broadcast
    def _broadcast(
        self, plan: LoadPlan, planner: LoadPlanner, mine: dict[int, _Key], owner: dict[_Key, int], rank: int
    ) -> None:
        """Each owner's shared items to every rank, in key order, large ones alone, small ones
        in buckets."""
        dests: dict[_Key, list[torch.Tensor]] = {}
        for item in plan.items:
            key = mine.get(id(item))
            if key is not None and key in owner and key[3] != "bytes":  # one stored item may fill several
                dests.setdefault(key, []).append(planner.resolve_tensor(item).detach())
        for src in sorted(set(owner.values())):
            src_global = dist.get_global_rank(self._group(), src)
            bucket: list[_Key] = []
            size = 0
            for key in sorted(k for k, r in owner.items() if r == src and k[3] != "bytes"):
                first, *more = dests[key]
                nbytes = first.numel() * first.element_size()
                if nbytes >= BUCKET_BYTES:
                    _broadcast_via_cpu(first, src_global, self.group, rank == src)
                    for other in more:
                        other.copy_(first)
                    continue
                if size + nbytes > BUCKET_BYTES:
                    self._send_bucket(bucket, dests, size, src_global, rank == src)
                    bucket, size = [], 0
                bucket.append(key)
                size += nbytes
            if bucket:
                self._send_bucket(bucket, dests, size, src_global, rank == src)

    def _broadcast_values(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        mine: dict[int, _Key],
        owner: dict[_Key, int],
        values: dict[_Key, bytes],
    ) -> None:
        """Shared bytes items (training state, small objects): one object broadcast per owner."""
        rank = dist.get_rank(self.group)
        received: dict[_Key, bytes] = {}
        for src in sorted({r for k, r in owner.items() if k[3] == "bytes"}):
            box = [{k: values[k] for k, r in owner.items() if r == src and k[3] == "bytes"} if src == rank else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._group(), src), group=self.group)
            if src != rank:
                received.update(box[0] or {})
        for item in plan.items:
            key = mine.get(id(item))
            if key is not None and key in received:
                planner.load_bytes(item, io.BytesIO(received[key]))

    def _send_bucket(
        self, keys: list[_Key], dests: dict[_Key, list[torch.Tensor]], size: int, src: int, sending: bool
    ) -> None:
        buf = torch.empty(size, dtype=torch.uint8, device="cpu")
        pos = 0
        parts = []
        for key in keys:
            n = dests[key][0].numel() * dests[key][0].element_size()
            parts.append((buf[pos : pos + n], [_bytes_of(t) for t in dests[key]]))
            pos += n
        if sending:
            for part, views in parts:
                part.copy_(views[0])
        dist.broadcast(buf, src=src, group=self.group)
        for part, views in parts:
            for view in views[0 if not sending else 1 :]:
                view.copy_(part)


def _broadcast_via_cpu(tensor: torch.Tensor, src: int, group: Any, sending: bool) -> None:
    """Broadcast ``tensor``'s bytes from global rank ``src`` over ``group`` (gloo): a CPU tensor
    in place, any other through a CPU copy (the owner's) or buffer (the others', then copied to
    their device)."""
    if not _staged(tensor):
        dist.broadcast(_bytes_of(tensor), src=src, group=group)
        return
    staging = tensor.to("cpu", copy=True) if sending else torch.empty_like(tensor, device="cpu")
    dist.broadcast(_bytes_of(staging), src=src, group=group)
    if not sending:
        tensor.copy_(staging)


def _staged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes through a CPU buffer (it is not on the CPU)."""
    return tensor.device.type != "cpu"


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _owners(shared: list[_Key], reading: list[set[str]], world: int) -> dict[_Key, int]:
    """Each shared key's reading rank: whole files, largest first, to the least loaded of the
    ranks that read the file anyway (for items of their own: its digest covers the whole file, so
    a second reader would read it twice), else of all ranks."""
    per_file: dict[str, list[_Key]] = {}
    for key in shared:
        per_file.setdefault(key[0], []).append(key)
    load = [0] * world
    owner: dict[_Key, int] = {}
    for name in sorted(per_file, key=lambda n: (-sum(k[2] for k in per_file[n]), n)):
        candidates = [i for i in range(world) if name in reading[i]] or list(range(world))
        r = min(candidates, key=lambda i: (load[i], i))
        load[r] += sum(k[2] for k in per_file[name])
        for key in per_file[name]:
            owner[key] = r
    return owner
