"""DCP's ``DefaultSavePlanner`` with its global step reused while the local plans repeat.

A training job saves the same structure every time, yet DCP's coordinator rebuilds the global
plan (dedup, ``create_default_global_save_plan``, validation) and the ``Metadata`` of every item
at each save: several Python objects per tensor, most of the planning time of a state of many
small tensors. That step is a pure function of the ranks' local plans, so
:class:`CachingSavePlanner` keeps its result per process and reuses it when every local plan
compares equal to the cached ones (full dataclass equality: keys, chunks, sizes, dtypes,
``requires_grad``, pinning, the flattening map). Unlike DCP's own ``enable_plan_caching``, whose
comparison skips the tensor properties, a dtype change is a new plan here.

The cached ``Metadata`` is also compacted once (:func:`compact_metadata`): equal
``TensorProperties`` and ``torch.Size`` values become one shared object each, which ``pickle``
then writes once and refers back to, so ``.metadata`` is smaller and faster to write and to read.
The unpickled ``Metadata`` compares equal to the uncompacted one; stock ``dcp.load`` reads it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from typing_extensions import override

from .torch_format.internals import ShardedTensor, flatten_state_dict

__all__ = ["CachingSavePlanner", "LeanSavePlanner", "compact_metadata"]

_CACHED = 4  # distinct structures kept per process (a model and its EMA copy, a memory tier)


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
