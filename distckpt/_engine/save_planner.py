"""DCP's ``DefaultSavePlanner`` with its local and global steps reused while the structure repeats.

A training job saves the same structure every time, yet DCP rebuilds its local plan (a
``WriteItem`` with its chunk and ``TensorProperties`` per tensor) and, on the coordinator, the
global plan (dedup, ``create_default_global_save_plan``, validation) and the ``Metadata`` of every
item at each save: several Python objects per tensor, most of the planning time of a state of many
small tensors. Both are pure functions of their inputs, so :class:`CachingSavePlanner` keeps them
per process: the local plan while :func:`plan_key` of the flat state_dict repeats (everything
DCP's planning reads of each value), the global plan while every local plan compares equal to the
cached ones (full dataclass equality: keys, chunks, sizes, dtypes, ``requires_grad``, pinning, the
flattening map; an identity check per item when they are the cached local plan's items). Unlike
DCP's own ``enable_plan_caching``, whose comparison skips the tensor properties, a dtype change is
a new plan here.

The cached ``Metadata`` is also compacted once (:func:`compact_metadata`): equal
``TensorProperties`` and ``torch.Size`` values become one shared object each, which ``pickle``
then writes once and refers back to, so ``.metadata`` is smaller and faster to write and to read.
The unpickled ``Metadata`` compares equal to the uncompacted one; stock ``dcp.load`` reads it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor
from typing_extensions import override

from .torch_format.flatten import flatten_state_dict
from .torch_format.internals import ShardedTensor, local_tensor

__all__ = ["CachingSavePlanner", "LeanSavePlanner", "compact_metadata", "plan_key"]

_CACHED = 4  # distinct structures kept per process (a model and its EMA copy, a memory tier)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plan_key(state_dict: dict[str, Any]) -> list[Any] | None:
    """Everything DCP's local save plan of the flat ``state_dict`` depends on (``_create_write_items``
    and ``TensorProperties.create_from_tensor``): each key in order, with its tensor's shape, dtype,
    layout, ``requires_grad`` and pinning, and a DTensor's mesh and placements; a
    non-tensor value by its key alone (planned as bytes, whatever its value). ``None`` (never
    reused) for any other tensor type or an object with its own ``__create_write_items__``
    (FSDP1's ``ShardedTensor``, a DTensor over a tensor subclass)."""
    key: list[Any] = []
    for fqn, value in state_dict.items():
        kind = type(value)
        if kind in _PLAIN:
            key.append((fqn, value.shape, value.dtype, value.layout, value.requires_grad, value.is_pinned()))
        elif kind is DTensor:
            local = local_tensor(value)
            if type(local) not in _PLAIN:
                return None
            key.append(
                (
                    fqn,
                    value.shape,
                    value.dtype,
                    value.requires_grad,
                    value.device_mesh,
                    value.placements,
                    local.is_pinned(),
                )
            )
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            key.append(fqn)
    return key


def compact_metadata(metadata: Metadata) -> Metadata:
    """Make equal ``TensorProperties`` and equal ``torch.Size`` values of ``metadata``'s tensor
    entries one shared object each, in place (see the module docstring); returns ``metadata``.
    Nothing of DCP mutates these after planning."""
    props: dict[Any, Any] = {}
    sizes: dict[Any, Any] = {}
    for md in metadata.state_dict_metadata.values():
        if not isinstance(md, TensorStorageMetadata):
            continue
        p = md.properties
        md.properties = props.setdefault((p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory), p)
        md.size = sizes.setdefault(md.size, md.size)
        for chunk in md.chunks:
            chunk.offsets = sizes.setdefault(chunk.offsets, chunk.offsets)
            chunk.sizes = sizes.setdefault(chunk.sizes, chunk.sizes)
    return metadata


class LeanSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that walks the state_dict once: DCP's second walk, which splits
    FSDP1's nested ``ShardedTensor``s, runs only when the flattened state_dict holds one (a walk
    of a nested state_dict costs microseconds per value; a check of the flat one, a tenth)."""

    @override
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        if not self.flatten_state_dict:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        flat, mappings = flatten_state_dict(state_dict)
        sharded = self.flatten_sharded_tensors
        self.flatten_state_dict = False
        self.flatten_sharded_tensors = sharded and any(isinstance(v, ShardedTensor) for v in flat.values())
        try:
            super().set_up_planner(flat, storage_meta, is_coordinator)
        finally:
            self.flatten_state_dict, self.flatten_sharded_tensors = True, sharded
        self.mappings = mappings


class CachingSavePlanner(LeanSavePlanner):
    """``DefaultSavePlanner`` whose global step (coordinator only) is computed once per distinct
    list of local plans per process and reused after (module docstring). Thread-safe; picklable
    (a process-mode async save plans in its own process, with its own cache)."""

    _lock = threading.Lock()
    _cache: list[tuple[list[SavePlan], list[SavePlan], Metadata]] = []
    _local: list[tuple[list[Any], SavePlan]] = []

    @override
    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, reused while :func:`plan_key` of the flat state_dict repeats (the same
        item objects: the coordinator's comparison of an unchanged plan is then an identity check)."""
        key = plan_key(self.state_dict)
        with CachingSavePlanner._lock:
            hit = next((p for k, p in CachingSavePlanner._local if k == key), None) if key is not None else None
        if hit is None:
            plan = super().create_local_plan()
            if key is not None:
                with CachingSavePlanner._lock:
                    CachingSavePlanner._local[: max(0, len(CachingSavePlanner._local) - _CACHED + 1)] = []
                    CachingSavePlanner._local.append((key, plan))
            return plan
        self.plan = dataclasses.replace(hit, planner_data=self.mappings) if self.flatten_state_dict else hit
        return self.plan

    @override
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with CachingSavePlanner._lock:
            hit = next(((g, m) for plans, g, m in CachingSavePlanner._cache if plans == all_plans), None)
        if hit is None:
            global_plan, metadata = super().create_global_plan(all_plans)
            hit = (global_plan, compact_metadata(metadata))
            with CachingSavePlanner._lock:
                CachingSavePlanner._cache[: max(0, len(CachingSavePlanner._cache) - _CACHED + 1)] = []
                CachingSavePlanner._cache.append((list(all_plans), *hit))
        # A fresh Metadata per save: the writer's finish sets storage_data, storage_meta and
        # version on it, and a background save may still be finishing with the previous one.
        self.global_plan, self.metadata = hit[0], dataclasses.replace(hit[1])
        return self.global_plan, self.metadata
