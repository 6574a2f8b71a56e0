"""The memory tier's snapshot plan: the write items of DCP's local save plan of the state_dict
that a rank snapshots, each replicated tensor kept by one rank per job. The plan is a function of
the state_dict's structure alone, which a training job keeps from step to step, so it is reused
while that structure repeats (as DCP's ``enable_plan_caching`` reuses a save plan). Also what the
training thread takes at the snapshot before the worker thread lays it out: copies of what the
mutation guard does not protect (:func:`take_unguarded`)."""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .._engine.save_planner import plan_key
from .._engine.torch_format.flatten import flatten_state_dict
from .._engine.torch_format.internals import ShardedTensor, local_tensor
from .._state.packing import Packed
from .placement import assign_replicated

__all__ = ["Handover", "SnapshotPlan", "exact_key", "hand_over", "resolve", "take_unguarded"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class SnapshotPlan:
    """The last snapshot's kept write items and the structure they were planned for.

    Args:
        rank, world_size: of the job (the placement of replicated tensors).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.kept: list[WriteItem] = []
        self.key: list[Any] | None = None
        self.blobs: dict[str, tuple[Any, bytes]] = {}  # fqn -> (exact key of a primitive value, its bytes)

    def items(self, planner: DefaultSavePlanner, rank0: frozenset[str] = frozenset()) -> list[WriteItem]:
        """The write items this rank snapshots: DCP's local plan of ``planner``'s state_dict less the
        replicated tensors another rank holds (:func:`~distckpt._memory.placement.assign_replicated`;
        those named in ``rank0``: rank 0). The plan is a function of the state_dict's structure
        alone (keys; each tensor's shape, dtype and DTensor layout), which a training job keeps from
        step to step: it is reused while that structure repeats, as DCP's
        ``enable_plan_caching`` reuses a save plan."""
        key = plan_key(planner.state_dict)
        key = None if key is None else [*key, sorted(rank0)]
        if key is not None and key == self.key:
            return self.kept
        items = planner.create_local_plan().items
        sizes = {
            i.index.fqn: i.tensor_data.size.numel() * i.tensor_data.properties.dtype.itemsize
            for i in items
            if i.type == WriteItemType.TENSOR and i.tensor_data is not None
        }
        owner = assign_replicated(sizes, self.world_size)
        owner.update((fqn, 0) for fqn in rank0 if fqn in owner)
        self.kept = [i for i in items if i.type != WriteItemType.TENSOR or owner[i.index.fqn] == self.rank]
        self.key = key
        return self.kept


def resolve(
    planner: DefaultSavePlanner, item: WriteItem, blobs: dict[str, tuple[Any, bytes]] | None = None
) -> torch.Tensor | io.BytesIO:
    """``planner.resolve_data(item)``, with a plain tensor or a DTensor's local shard looked up
    directly (what DCP's lookup does for them, without its per-item search), and a non-tensor
    value in ``torch.save``'s legacy format: a snapshot lives for minutes, and a small value's
    zip container costs several times its pickling (``torch.load`` reads either format).

    ``blobs``: the bytes of each primitive value (a number, string, bytes, ``None`` or a tuple of
    them: an optimizer's hyperparameters, packed states) serialized before, reused while the value
    is exactly the same (:func:`exact_key`); a step changes few of them (the learning rate)."""
    if item.type == WriteItemType.BYTE_IO:
        obj = planner.lookup_object(item.index)
        if isinstance(obj, Packed):  # taken at the snapshot, serialized here
            obj = obj.bytes()
        key = exact_key(obj) if blobs is not None else None
        known = blobs.get(item.index.fqn) if blobs is not None and key is not None else None
        if known is not None and known[0] == key:
            return io.BytesIO(known[1])
        buf = io.BytesIO()
        torch.save(obj, buf, _use_new_zipfile_serialization=False)
        if blobs is not None and key is not None:
            blobs[item.index.fqn] = (key, buf.getvalue())
        buf.seek(0)
        return buf
    value = planner.state_dict.get(item.index.fqn)
    if isinstance(value, DTensor):
        return local_tensor(value)
    if isinstance(value, torch.Tensor) and type(value) in _PLAIN:
        return value
    return planner.resolve_data(item)


_SCALARS = (bool, int, str, bytes, type(None))


def exact_key(obj: Any) -> Any:
    """A hashable key equal for two values only if they serialize alike: the type with the value
    (a float by its ``hex()``: ``0.0 == -0.0``), recursively for tuples; ``None`` for any other value."""
    kind = type(obj)
    if kind in _SCALARS:
        return (kind, obj)
    if kind is float:
        return (kind, obj.hex())
    if kind is tuple:
        parts = tuple(exact_key(x) for x in obj)
        return None if None in parts else (kind, parts)
    return None


def take_unguarded(flat: dict[str, Any], protected: set[int]) -> bool:
    """Replace, in the flat state_dict ``flat``, each tensor whose data the mutation guard does not
    protect (``protected``: addresses) by a copy, and each value other than a tensor or a primitive
    (:func:`exact_key`) by a deep copy: the next step may change them before
    the worker reads them. Returns whether any tensor is on CUDA."""
    cuda = False
    for fqn, value in flat.items():
        if isinstance(value, ShardedTensor):  # FSDP1's: views into its flat parameters
            for shard in value.local_shards():
                cuda = cuda or shard.tensor.is_cuda
                if shard.tensor.untyped_storage().data_ptr() not in protected:
                    shard.tensor = shard.tensor.detach().clone()  # a state_dict's own ShardedTensor
        elif isinstance(value, torch.Tensor):
            cuda = cuda or value.is_cuda
            data = local_tensor(value)
            if data.numel() and data.data_ptr() not in protected:
                flat[fqn] = value.detach().clone()
        elif not isinstance(value, (bytes, Packed)) and exact_key(value) is None:  # Packed: taken already
            flat[fqn] = copy.deepcopy(value)
    return cuda


@dataclasses.dataclass
class Handover:
    """What the worker gets of a snapshot (:func:`hand_over`).

    Attributes:
        state_dict: the live parts nested, every other part flattened.
        cuda: whether a CUDA tensor may be among them.
        paths: the path in the snapshot's state_dict of each key flattened here (DCP's mapping).
        rank0: the flat keys of replicated tensors that rank 0 stores (DDP's broadcast buffers).
    """

    state_dict: dict[str, Any]
    cuda: bool
    paths: dict[str, tuple[Any, ...]]
    rank0: frozenset[str] = frozenset()


def hand_over(state_dict: dict[str, Any], live: set[str], protected: set[int]) -> Handover:
    """What the worker gets of a snapshot's ``state_dict``: the ``live`` parts as they are, nested
    (``key`` or ``key.subkey``); every other part flattened with copies of what the mutation
    guard does not protect (:func:`take_unguarded`), in the state_dict's
    order (the items' order in the snapshot)."""
    handed: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    cuda = bool(live) and torch.cuda.is_available() and torch.cuda.is_initialized()
    for key, value in state_dict.items():
        if key in live:
            handed[key] = value
            continue
        inner = {path[len(key) + 1 :] for path in live if path.startswith(key + ".")}
        if inner and isinstance(value, dict):
            handed[key] = {k: v for k, v in value.items() if k in inner}
            value = {k: v for k, v in value.items() if k not in inner}
        flat, mapping = flatten_state_dict({key: value})
        cuda = take_unguarded(flat, protected) or cuda
        handed.update(flat)
        paths.update(mapping)
    return Handover(handed, cuda, paths)
