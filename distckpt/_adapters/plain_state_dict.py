"""DCP's SHARDED ``get_state_dict`` of a model no parallelism wraps, built without its per-parameter walk.

For a module tree with no DDP, FSDP (1 or 2), ``torch.compile`` or activation-checkpoint wrapper
and no ``_fqn_modifiers``, DCP's ``get_state_dict`` (``torch/distributed/checkpoint/state_dict.py``)
returns:

- model: ``model.state_dict()`` under ``no_grad``; ``_get_fqns`` maps each key to itself (it
  renames keys only across the wrappers above; a module with a state_dict post-hook, which may
  rename keys as activation checkpointing's does, is left to DCP too);
- optimizer: ``optimizer.state_dict()`` with each parameter index, in ``state`` and in each param
  group's ``params``, replaced by the parameter's FQN: its name in ``model.named_parameters()``
  (the first, for a parameter registered twice).

DCP also resolves every parameter's FQN by walking its module path, three times per parameter
(``_verify_options``, the model and the optimizer conversion), which dominates a save or load
of many small tensors. :func:`plain_state_dicts` computes the same result with one
``named_parameters()`` walk (``tests/unit/test_plain_state_dict.py`` compares it with DCP's on
models, optimizers and parameter groups of several kinds) and returns ``None`` wherever DCP's
own call is needed: a wrapper, a tensor-parallel (DTensor) parameter, a module whose class or
instance overrides ``state_dict`` or ``_save_to_state_dict``, an optimizer with state-dict hooks
or without state (DCP's dummy-step initialisation), a parameter the model does not name, an
empty model state_dict (DCP raises).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["default_save", "plain_state_dicts"]

_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"  # activation checkpointing's wrapper attribute
_PARAMS = "params"


def plain_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``get_state_dict(model, [optimizer])`` with DCP's default (SHARDED) options, or ``None``
    where DCP must compute it (module docstring). Values are DCP's: detached views of the
    parameters and buffers, the optimizer's own per-parameter state dicts, copies of its param
    groups. ``optimizer=None``: the model part, and ``{}``."""
    if not _unwrapped(model) or (optimizer is not None and not _plain_optimizer(optimizer)):
        return None
    with torch.no_grad():
        model_sd = model.state_dict()
    if not model_sd or any(_CHECKPOINT_WRAPPED in key for key in model_sd):
        return None
    if optimizer is None:
        return model_sd, {}
    fqns: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) or _CHECKPOINT_WRAPPED in name:
            return None
        fqns.setdefault(param, name)
    try:
        by_index = [fqns[p] for group in optimizer.param_groups for p in group[_PARAMS]]
    except KeyError:  # a parameter the model does not hold: DCP's error
        return None
    packed = optimizer.state_dict()
    if not all(type(k) is int and 0 <= k < len(by_index) for k in packed["state"]):
        return None
    state = {by_index[k]: v for k, v in packed["state"].items()}
    groups = packed["param_groups"]
    for group in groups:
        group[_PARAMS] = [by_index[i] for i in group[_PARAMS]]
    return model_sd, {"state": state, "param_groups": groups}


_OWN_SAVE = ("state_dict", "_save_to_state_dict")
_DEFAULT: dict[tuple[type, tuple[str, ...]], bool] = {}


def default_save(module: nn.Module, also: tuple[str, ...] = ()) -> bool:
    """Whether ``module`` saves its state as ``nn.Module`` does: neither its class nor the instance
    overrides ``state_dict`` or ``_save_to_state_dict`` (nor a name in ``also``), any of which may
    save tensors under other names or other tensors than the registered ones."""
    names = _OWN_SAVE + also
    key = (type(module), also)
    known = _DEFAULT.get(key)
    if known is None:
        known = _DEFAULT[key] = all(getattr(type(module), n) is getattr(nn.Module, n) for n in names)
    return known and not any(n in module.__dict__ for n in names)


def _unwrapped(model: nn.Module) -> bool:
    """No module of the tree is a wrapper whose keys DCP renames, has a state_dict post-hook or
    ``_fqn_modifiers``, or saves its state otherwise than ``nn.Module`` (:func:`default_save`)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    for module in model.modules():
        # a state_dict post-hook may rename keys (activation checkpointing's strips its prefix)
        if isinstance(module, wrappers) or module._state_dict_hooks or hasattr(module, "_fqn_modifiers"):
            return False
        if not default_save(module):  # its keys may not be attribute paths, which DCP requires
            return False
        if "_orig_mod" in module._modules:  # torch.compile's wrapper (its class is private)
            return False
    return True


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Initialised (DCP would run a dummy step otherwise), ``state_dict`` is ``Optimizer``'s,
    unpatched and unhooked."""
    return (
        bool(optimizer.state)
        and type(optimizer).state_dict is torch.optim.Optimizer.state_dict
        and "state_dict" not in vars(optimizer)
        and not optimizer._optimizer_state_dict_pre_hooks
        and not optimizer._optimizer_state_dict_post_hooks
    )
