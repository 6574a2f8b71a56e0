"""Copies of the training state that run while the next step computes, made safe without the
user's help: the loop is held back only at the first instruction that would change what is still
being copied.

Two kinds of change are hooked (``torch.optim.Optimizer.register_step_pre_hook`` and
``torch.nn.Module.register_forward_pre_hook``, both public PyTorch hooks):

- ``optimizer.step()`` changes the parameters and the optimizer state;
- the forward of a module that owns persistent buffers may change them (BatchNorm's running
  statistics), so each such module waits before its forward, and so does a DDP wrapper that
  broadcasts rank 0's buffers at its forward; a model without such buffers (most transformers)
  never waits in forward.

Anything else in a state_dict (bytes items, tensors that are neither parameters, optimizer state
nor persistent buffers, such as a tensor-valued learning rate) is copied before the copy is
started, on the training thread (:func:`deferrable`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .._engine.torch_format.internals import data_addresses, own_persistent_buffers

__all__ = ["MutationGuard", "deferrable"]

logger = logging.getLogger(__name__)


class MutationGuard:
    """Holds the training loop back, at ``optimizer.step()`` and at the forward of each module that
    owns persistent buffers, until every registered wait returns.

    Args:
        model: the (possibly wrapped) model.
        optimizer: its optimizer, or ``None``.

    A wait must return at once when nothing is in flight: the hooks run at every step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.waits: list[Callable[[], None]] = []
        self._handles: list[Any] = []

    def add(self, *waits: object) -> None:
        """Call each callable ``wait()`` of ``waits`` (anything else, e.g. ``None``: skipped) before
        every guarded change; the hooks are installed with the first one (a job with nothing copied
        in the background pays nothing)."""
        waits_given: list[Callable[[], None]] = [w for w in waits if callable(w)]
        if waits_given and not self._handles:
            if self.optimizer is not None:
                self._handles.append(self.optimizer.register_step_pre_hook(self._hook))
            for module in self.model.modules():
                # DDP's forward overwrites every buffer with rank 0's (broadcast_buffers) before
                # the forward of the module that owns it
                broadcasts = getattr(module, "broadcast_buffers", False) is True and any(True for _ in module.buffers())
                if own_persistent_buffers(module) or broadcasts:
                    self._handles.append(module.register_forward_pre_hook(self._hook))
        self.waits += waits_given

    def _hook(self, *args: Any, **kwargs: Any) -> None:
        for wait in self.waits:
            wait()

    _hook = torch.compiler.disable(_hook)  # a wait on another thread: never traced into a compiled graph

    def remove(self) -> None:
        """Remove the hooks (``close``). Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def deferrable(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_addresses: set[int] | None = None
) -> set[int]:
    """The data addresses (:func:`~distckpt._engine.torch_format.internals.data_addresses`: the
    first element's and the storage's start) of the tensors a :class:`MutationGuard` protects: the
    parameters, the optimizer state's tensors and the persistent buffers. A state_dict tensor
    starting at one of them (DCP's SHARDED state_dict holds these tensors or views of them), or an
    FSDP1 shard whose storage starts at one, may be copied while the next step runs; any other is
    copied before the step goes on.

    Args:
        model_addresses: those of the parameters and persistent buffers, when the caller has just
            walked them (:attr:`~distckpt._adapters.state_dict_cache.StateDictCache.guarded`); the
            optimizer's state is read here in any case (a step may replace its tensors).
    """
    tensors: list[torch.Tensor] = []
    if model_addresses is None:
        tensors += model.parameters()
        tensors += [b for module in model.modules() for b in own_persistent_buffers(module)]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    addresses = set(model_addresses or ())
    for t in tensors:
        addresses.update(data_addresses(t))
    return addresses
