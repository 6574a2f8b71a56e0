"""Every private torch name distckpt uses, in one place.

These have no public equivalent in torch 2.13; when torch renames one, this module is the only
one to change. Each is used for the reason given beside it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Iterator

import torch

# Weights-only unpickler over a raw stream (the fast reader decodes torch.save records itself).
from torch import _weights_only_unpickler as weights_only_unpickler

# Fake tensors: a torch.save layout of tensors that are never allocated (single-file export).
from torch._subclasses.fake_tensor import FakeTensorMode

# A view of a shard's bytes at DCP's storage offsets, exactly as DCP's own reader narrows them.
from torch.distributed._shard._utils import narrow_tensor_by_index

# FSDP1's sharded tensor type (no public alias): DCP flattens nested ones in a second walk.
from torch.distributed._shard.sharded_tensor import ShardedTensor

# DCP's flattening of nested state_dicts (the keys its metadata holds) and the setter its
# planner uses to put a loaded non-tensor value back in place.
# (and which traversal it uses: torch 2.3's for checkpoints of that version, _derived_version).
from torch.distributed.checkpoint import _version as dcp_version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

# FileSystemWriter/Reader's per-item storage record (incremental saves refer to earlier files
# with it) and the reader's stream transforms (_extensions of items saved with them).
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms as StorageReaderTransforms

__all__ = [
    "FORMAT_TESTED_TORCH",
    "FakeTensorMode",
    "own_persistent_buffers",
    "ShardedTensor",
    "StorageInfo",
    "StorageReaderTransforms",
    "data_addresses",
    "dcp_version",
    "default_store",
    "flatten_state_dict",
    "format_tested",
    "local_tensor",
    "narrow_tensor_by_index",
    "set_element",
    "weights_only_unpickler",
    "without_step_hooks",
]


def default_store() -> Any:
    """The default process group's store (``new_group`` uses the same one).

    Raises:
        RuntimeError, ValueError: the default group has no store.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


FORMAT_TESTED_TORCH: tuple[tuple[int, int], ...] = ((2, 13), (2, 14))
"""torch releases (major, minor) on which tests/unit/test_torch_format_contract.py passed (2.13.0
in CI, 2.14.1 with ``make test-compat TORCH=2.14.1``). distckpt's fast reader reproduces
``torch.save``'s private byte format and its record writer ``torch.save``'s bytes; on any other
torch both step aside for torch's stock reader and writer (:func:`format_tested`). A torch whose
contract test passes is added here."""

_log = logging.getLogger(__name__)
_untested_logged: list[str] = []


def format_tested(version: str | None = None) -> bool:
    """Whether distckpt's fast reader and record writer may run on this torch (``version``:
    ``torch.__version__`` unless given): its (major, minor) is in :data:`FORMAT_TESTED_TORCH`.
    When not, logs one INFO line per process saying that the stock paths are used."""
    text = torch.__version__ if version is None else version
    try:
        major, minor = (int(part) for part in str(text).split("+")[0].split(".")[:2])
    except ValueError:
        major = minor = -1
    if (major, minor) in FORMAT_TESTED_TORCH:
        return True
    if text not in _untested_logged:
        _untested_logged.append(text)
        tested = ", ".join(f"{a}.{b}" for a, b in FORMAT_TESTED_TORCH)
        _log.info(
            "torch %s: distckpt's fast reader and record writer are tested on torch %s only; using torch's "
            "stock DCP reader and writer (`make test-compat TORCH=%s` runs the format contract test)",
            text,
            tested,
            str(text).split("+")[0],
        )
    return False


def own_persistent_buffers(module: Any) -> list[Any]:
    """The buffers ``module`` registers itself (not its children's) that its state_dict holds:
    torch keeps the names registered with ``persistent=False`` in the private
    ``_non_persistent_buffers_set`` and has no public query for it."""
    skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
    return [b for n, b in module._buffers.items() if b is not None and n not in skip]


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def data_addresses(tensor: Any) -> tuple[int, int]:
    """``(first element, storage start)`` addresses of a tensor's data (a DTensor's local shard's):
    what identifies a parameter's memory in a state_dict that holds it or views of it (FSDP1's
    shards are views into its flat parameters, found by their storage start)."""
    data = local_tensor(tensor)
    start = data.data_ptr()
    return start, start - data.storage_offset() * data.element_size()


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard (``DTensor._local_tensor``: what ``to_local()`` returns a view of,
    without its autograd call, a few microseconds per tensor on a path that visits every tensor
    of the state at each memory-tier snapshot); any other tensor itself."""
    if type(tensor) in _PLAIN_TENSORS:  # no attribute lookup that misses: a microsecond per tensor
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def without_step_hooks(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """While the block runs, ``optimizer`` has no step pre- or post-hooks of its own.

    Why: DCP initialises a stateless optimizer with a dummy ``step()`` (lr=0), at a load (after
    the model's weights are in) and at a save before the first step, and ``step()`` runs the
    optimizer's hooks: a hook that projects the weights, or an EMA updated after each step, would
    change the state just loaded or about to be saved. torch keeps the hooks in the private
    ``_optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks`` dicts and has no public way to
    suspend them; a process-wide hook (``register_optimizer_step_pre_hook``) still runs.
    """
    names = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    held = [getattr(optimizer, n, None) for n in names]
    if optimizer is None or not any(held):
        yield
        return
    for n in names:
        setattr(optimizer, n, collections.OrderedDict())
    try:
        yield
    finally:
        for n, hooks in zip(names, held):
            setattr(optimizer, n, hooks)
