"""Detect how a model is wrapped: plain, DDP, FSDP1, FSDP2, each optionally compiled."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._engine.torch_format.internals import own_persistent_buffers
from .._errors import ConfigError

__all__ = [
    "wrapper_kind",
    "unwrap",
    "ddp_rebuilds_buckets",
    "ddp_resume_not_bitwise",
    "check_model_and_optimizer",
    "inner_optimizer",
    "broadcast_buffers_of",
]


def _compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module under a ``torch.compile`` wrapper, or None when ``module`` is not compiled."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under ``torch.compile`` and DDP wrappers (FSDP modules stay as is)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        inner = _compiled_inner(module)
        if inner is not None:
            module = inner
        elif isinstance(module, DistributedDataParallel):
            module = module.module
        else:
            return module


def wrapper_kind(module: nn.Module) -> str:
    """Wrapper kind string recorded in the manifest.

    Returns:
        One of ``plain``, ``ddp``, ``fsdp1``, ``fsdp2``, with ``+compile`` appended when a
        ``torch.compile`` wrapper sits anywhere on the outer chain.
    """
    from torch.nn.parallel import DistributedDataParallel

    compiled = False
    m = module
    kind = "plain"
    while True:
        inner = _compiled_inner(m)
        if inner is not None:
            compiled = True
            m = inner
        elif isinstance(m, DistributedDataParallel):
            kind = "ddp"
            m = m.module
        else:
            break
    if kind == "plain":
        kind = _fsdp_kind(m)
    return kind + ("+compile" if compiled else "")


def ddp_rebuilds_buckets(module: nn.Module) -> bool:
    """Whether ``module`` is (or compiles) a DDP module that will rebuild its gradient buckets.

    DDP reassigns parameters to buckets once, after a process's first iteration, in the order
    their gradients became ready (``Reducer::should_rebuild_buckets``: unless
    ``find_unused_parameters=True`` without ``static_graph``). A resumed process therefore
    reduces its first step with a layout the uninterrupted run used only at its own first step;
    with 3+ ranks the summation order of an element depends on its offset in the bucket, so
    the gradients differ in the last bits and a same-world resume is not bitwise.
    """
    from torch.nn.parallel import DistributedDataParallel

    m = module
    while (inner := _compiled_inner(m)) is not None:
        m = inner
    if not isinstance(m, DistributedDataParallel):
        return False
    return bool(getattr(m, "static_graph", False)) or not m.find_unused_parameters


def ddp_resume_not_bitwise(module: nn.Module, world_size: int) -> str | None:
    """Why a same-world resume of ``module`` on ``world_size`` ranks will not be bitwise
    (:func:`ddp_rebuilds_buckets` with 3+ ranks), or ``None``. With 2 ranks the bucket layout
    does not matter: ``a + b == b + a``."""
    if world_size < 3 or not ddp_rebuilds_buckets(module):
        return None
    return (
        f"DDP on {world_size} ranks rebuilds its gradient buckets after each process's first step, "
        "so a same-world resume matches the uninterrupted run to float rounding, not bitwise. For "
        "bitwise resumes build DDP with find_unused_parameters=True (no rebuild; README: Exactness)."
    )


def broadcast_buffers_of(module: nn.Module) -> list[Any]:
    """The persistent buffers that a DDP wrapper (possibly under ``torch.compile``) with
    ``broadcast_buffers=True`` overwrites with rank 0's at each forward: of the training state,
    rank 0's copy is the one the next step uses. ``[]`` for any other model."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = _compiled_inner(module) or module
    if not isinstance(ddp, DistributedDataParallel) or ddp.broadcast_buffers is not True:
        return []
    return [b for m in ddp.module.modules() for b in own_persistent_buffers(m)]


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer whose state ``optimizer`` holds: the one it wraps as ``optimizer.optimizer``
    when it is a ``torch.optim.Optimizer`` that never ran ``Optimizer.__init__`` (accelerate's
    ``AcceleratedOptimizer``: it has none of the hook tables DCP and distckpt read, and its
    ``step`` steps the wrapped one); else ``optimizer`` itself.

    Raises:
        ConfigError: such a wrapper with no ``optimizer`` attribute to unwrap.
    """
    if not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner_optimizer(inner)
    raise ConfigError(
        f"CheckpointManager: the optimizer ({type(optimizer).__name__}) never ran torch.optim.Optimizer.__init__ "
        "and wraps no optimizer as .optimizer; pass the torch optimizer it wraps"
    )


def check_model_and_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuse a model that is not a module, and an optimizer that holds parameters the model does not
    have (built for another model, or before the model was sharded): its first save would fail, deep
    in DCP, with a ``KeyError``.

    Compared by identity (a set of ids: O(parameters)) with ``model.parameters()`` of the object
    passed, which for DDP, ``torch.compile`` and FSDP2 yields the very Parameter objects the
    optimizer holds. An FSDP1 model is not checked (its flat parameters are not the original ones).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (names the type received).
        ConfigError: names how many of the optimizer's parameters are not the model's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"CheckpointManager: model must be a torch.nn.Module (plain, or wrapped by DDP, FSDP or "
            f"torch.compile), got {type(model).__name__}; pass the model itself, not its state_dict or parameters"
        )
    groups = getattr(optimizer, "param_groups", None)
    if not groups or wrapper_kind(model).startswith("fsdp1"):
        return
    own = {id(p) for p in model.parameters()}
    params = [p for group in groups for p in group["params"]]
    foreign = sum(id(p) not in own for p in params)
    if foreign:
        raise ConfigError(
            f"CheckpointManager: {foreign} of the optimizer's {len(params)} parameters are not parameters of "
            f"the model ({type(model).__name__}): the optimizer was built for another model (or before the model "
            "was sharded). Pass the optimizer built from this model's parameters, e.g. "
            "torch.optim.AdamW(model.parameters()) after wrapping the model."
        )


def _fsdp_kind(module: nn.Module) -> str:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return "plain"
    for sub in module.modules():
        if isinstance(sub, FullyShardedDataParallel):
            return "fsdp1"
        if isinstance(sub, FSDPModule):
            return "fsdp2"
    return "plain"
