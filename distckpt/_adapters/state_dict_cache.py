"""DCP's SHARDED ``get_state_dict`` result, reused while the model and optimizer keep their structure.

A training job asks for the same state_dict at every save and memory-tier snapshot, and DCP
rebuilds it each time: the FQN of every parameter (``_get_fqns`` walks the module path of each
name), the model's state_dict with its key cleaning, and the optimizer's id-to-FQN conversion.
That is tens of microseconds per tensor on the training thread, while the result's *values* are
live objects: in SHARDED mode DCP returns detached views of the parameters and buffers (the
DTensors themselves under FSDP2) and the optimizer's own per-parameter state dicts.

So :class:`StateDictCache` keeps one result and hands it out again (fresh containers over the
same live values, the param groups' hyperparameters read anew) while a *fingerprint* of
everything the result is derived from is unchanged:

- every module of the tree (identity, class, child names), every parameter and persistent
  buffer it registers (name, identity, and the address, shape, strides and dtype of its data, or
  of a DTensor's local shard: ``p.data = x`` is a change);
- the optimizer's ``state`` mapping (identity, and each parameter's state dict, in order) and
  its param groups (the parameters of each, the keys of each).

It is never used, and DCP is called every time, where the result is not such a pure function:
a module with a state_dict post-hook (FSDP1's), a module whose class or instance overrides
``state_dict``, ``_save_to_state_dict`` or ``get_extra_state``,
an optimizer with state_dict hooks, an optimizer without state (DCP's dummy-step
initialisation). State-dict pre-hooks run before the fingerprint is taken, as
``Module.state_dict`` runs them (FSDP2's reshards its parameters: a module left unsharded then
registers other parameters, a miss). A miss calls DCP and caches its result.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .._engine.torch_format.internals import data_addresses, local_tensor
from .plain_state_dict import default_save

__all__ = ["StateDictCache"]

_PARAMS = "params"


class StateDictCache:
    """One cached ``(model_state_dict, optim_state_dict)`` of a model and its optimizer.

    Args:
        model: the (possibly wrapped) model.
        optimizer: its optimizer, or ``None``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self._key: list[Any] | None = None
        self._keep: list[Any] = []  # the fingerprinted objects, kept alive so their ids stay theirs
        self._model_sd: dict[str, Any] = {}
        self._state_fqns: list[str] = []  # FQN of each optimizer.state entry, in its order
        self._group_fqns: list[list[str]] = []
        self.hits = 0
        self.guarded: set[int] | None = None
        """The data addresses of the parameters and persistent buffers found by the last
        :meth:`get`'s walk (``None`` when it walked nothing or stopped: an uncacheable model):
        what the memory tier's mutation guard protects, without a second walk of the model
        (:func:`~distckpt._state.guard.deferrable`)."""
        self.buffered = False
        """Whether that walk found a persistent buffer (with :attr:`guarded`; ``False`` when it is
        ``None``): the mutation guard then holds the model's forward too."""
        self.live = False
        """Whether the last :meth:`get` handed out a result of the cache's (a hit, or a miss it
        kept): every tensor of its model part is a parameter's or persistent buffer's data (at
        :attr:`guarded`) and its optimizer part holds the optimizer's own per-parameter state
        dicts, which only ``optimizer.step()`` changes."""

    def get(
        self, compute: Callable[[], tuple[dict[str, Any], dict[str, Any]]]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``compute()`` (DCP's SHARDED ``get_state_dict`` of the model and optimizer), or the cached
        result while the fingerprint (module docstring) is unchanged: new dicts and lists over the
        same live tensors and per-parameter state dicts, param groups with their current values."""
        if self._key is not None:  # nothing cached yet: no fingerprint to compare
            key, _ = self._fingerprint()
            if key == self._key:
                self.hits += 1
                self.live = True
                return dict(self._model_sd), self._optim_sd()
        model_sd, optim_sd = compute()
        self._key = None
        after, keep = self._fingerprint()  # compute may run pre-hooks or initialise state
        if after is not None and self._remember(model_sd, optim_sd):
            self._key, self._keep = after, keep
        self.live = self._key is not None
        return model_sd, optim_sd

    def _remember(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> bool:
        """Keep ``model_sd`` and what rebuilds ``optim_sd`` from the live optimizer; False (nothing
        kept) where ``optim_sd`` is not DCP's plain conversion of ``optimizer.state_dict()`` or a
        model tensor is not a parameter's or persistent buffer's data (:attr:`guarded`)."""
        guarded = self.guarded or set()
        if not all(data_addresses(v)[0] in guarded for v in model_sd.values() if isinstance(v, torch.Tensor)):
            return False
        self._model_sd = dict(model_sd)
        if self.optimizer is None:
            self._state_fqns, self._group_fqns = [], []
            return True
        state, groups = optim_sd.get("state", {}), optim_sd.get("param_groups", [])
        live = self.optimizer.state
        if len(state) != len(live) or any(a is not b for a, b in zip(state.values(), live.values())):
            return False  # not the live per-parameter dicts (e.g. the undone dummy step)
        if len(groups) != len(self.optimizer.param_groups):
            return False
        self._state_fqns = list(state)
        self._group_fqns = [list(g[_PARAMS]) for g in groups]
        rebuilt = self._optim_sd()
        return rebuilt == optim_sd and [list(g) for g in rebuilt["param_groups"]] == [list(g) for g in groups]

    def _optim_sd(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        groups = []
        for group, fqns in zip(self.optimizer.param_groups, self._group_fqns):
            packed = {k: v for k, v in group.items() if k != _PARAMS}
            packed[_PARAMS] = list(fqns)
            groups.append(packed)
        return {"state": dict(zip(self._state_fqns, self.optimizer.state.values())), "param_groups": groups}

    def _fingerprint(self) -> tuple[list[Any] | None, list[Any]]:
        """``(key, objects it names by id)``; key ``None``: the result must not be cached. Sets
        :attr:`guarded` when the key is not ``None``."""
        self.guarded, self.buffered = None, False
        key: list[Any] = []
        keep: list[Any] = []
        guarded: set[int] = set()
        buffered = False
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            if module._state_dict_hooks or not default_save(module, ("get_extra_state",)):
                return None, []
            for hook in list(module._state_dict_pre_hooks.values()):
                hook(module, prefix + "." if prefix else "", False)
            key += (id(module), type(module), tuple(module._modules))
            keep.append(module)
            skip = module._non_persistent_buffers_set
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None or name in skip:
                        continue
                    data = local_tensor(tensor)
                    key += (name, id(tensor), data.data_ptr(), tensor.shape, data.stride(), tensor.dtype)
                    keep.append(tensor)
                    guarded.update(data_addresses(data))
                    buffered = buffered or table is module._buffers
        optimizer = self.optimizer
        if optimizer is not None:
            if (
                not optimizer.state
                or optimizer._optimizer_state_dict_pre_hooks
                or optimizer._optimizer_state_dict_post_hooks
            ):
                return None, []
            key += (id(optimizer.state), len(optimizer.state))
            keep.append(optimizer.state)
            for param, state in optimizer.state.items():
                key += (id(param), id(state))
                keep.append(state)
            for group in optimizer.param_groups:
                key += (tuple(group), *map(id, group[_PARAMS]))
        self.guarded, self.buffered = guarded, buffered
        return key, keep
