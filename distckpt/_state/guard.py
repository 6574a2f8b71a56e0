"""Copies of the training state that run while the next step computes, made safe without the
user's help: the loop is held back only at the first instruction that would change what is still
being copied.

Two kinds of change are hooked, each by a public PyTorch hook that runs before any the user
registered, whenever it was registered:

- ``optimizer.step()`` changes the parameters and the optimizer state: a process-wide optimizer
  step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``), as such hooks run
  before each optimizer's own (``Optimizer.profile_hook_step``), such as a projection of the
  weights a user hooked in. Every optimizer of the process waits: the one inside a wrapper
  (accelerate's), or a second one over some of the model's parameters;
- the model's forward may change its persistent buffers (BatchNorm's running statistics, spectral
  norm's power iteration in a forward pre-hook, a parent's ``F.batch_norm`` on a child's
  statistics, DDP's broadcast of rank 0's buffers): a forward pre-hook on the root module,
  registered with ``prepend=True``, runs before all of these; each module that owns persistent
  buffers when the guard is installed waits too (a loop may call it outside the root's forward).
  The forward waits only while the state last built for a copy had persistent buffers
  (:attr:`MutationGuard.hold_forward`, set at each build, so a buffer added after the manager was
  built counts); a model without them (most transformers) has no forward hook at all.

Anything else in a state_dict (bytes items, tensors that are neither parameters, optimizer state
nor persistent buffers, such as a tensor-valued learning rate) is copied before the copy is
started, on the training thread (:func:`deferrable`). A change the hooks cannot see needs
:meth:`MutationGuard.wait` first (``CheckpointManager.wait_staged``): a parameter, buffer or
optimizer state edited in the loop itself, or a module's forward that bypasses the hooks
(``model.forward(x)``, or a submodule called directly that updates another module's buffers,
such as ``F.batch_norm`` on a child's statistics). A wait inside a ``torch.compile(fullgraph=True)``
graph is refused by dynamo: compile a model with persistent buffers without ``fullgraph``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._engine.torch_format.internals import data_addresses, own_persistent_buffers

__all__ = ["MutationGuard", "deferrable"]

logger = logging.getLogger(__name__)


class MutationGuard:
    """Holds the training loop back, at every ``optimizer.step()`` of the process and at the
    model's forward, until every registered wait returns.

    Args:
        model: the (possibly wrapped) model.
        optimizer: its optimizer, or ``None``.

    A wait must return at once when nothing is in flight: the hooks run at every step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.waits: list[Callable[[], None]] = []
        self._hold_forward = any(map(own_persistent_buffers, model.modules()))
        self._step_handle: Any = None
        self._forward_handles: list[Any] = []

    @property
    def hold_forward(self) -> bool:
        """Whether the model's forward waits too: the state last built for a copy has persistent
        buffers (set by whoever builds it; until then, whether the model has them now). Without
        them the forward is not hooked at all (nothing in a ``fullgraph`` compile to break on)."""
        return self._hold_forward

    @hold_forward.setter
    def hold_forward(self, hold: bool) -> None:
        self._hold_forward = hold
        if self.waits:
            self._hook_forward(hold)

    def add(self, *waits: object) -> None:
        """Call each callable ``wait()`` of ``waits`` (anything else, e.g. ``None``: skipped) before
        every guarded change; the hooks are installed with the first one (a job with nothing copied
        in the background pays nothing)."""
        self.waits += [w for w in waits if callable(w)]
        if self.waits and self._step_handle is None:
            # every optimizer: a wrapper's inner one, or one the manager was not given (a GAN's
            # second), may step the model's parameters
            self._step_handle = register_optimizer_step_pre_hook(_waiting_hook(weakref.ref(self)))
            self._hook_forward(self._hold_forward)

    def _hook_forward(self, hold: bool) -> None:
        if hold and not self._forward_handles:
            # the root's forward runs first; a buffer's owner also waits when called on its own
            owners = [m for m in self.model.modules() if m is self.model or own_persistent_buffers(m)]
            hook = _waiting_hook(weakref.ref(self))
            self._forward_handles = [m.register_forward_pre_hook(hook, prepend=True) for m in owners]
        elif not hold:
            self._remove(self._forward_handles)

    def wait(self) -> None:
        """Block until every copy in flight is done (at once when none is)."""
        for wait in self.waits:
            wait()

    def remove(self) -> None:
        """Remove the hooks (``close``). Idempotent."""
        self._remove(self._forward_handles)
        if self._step_handle is not None:
            self._step_handle.remove()
        self.waits, self._step_handle = [], None

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        while handles:
            handles.pop().remove()


def _waiting_hook(guard: weakref.ref[MutationGuard]) -> Callable[..., None]:
    """A hook (optimizer step or forward pre-hook) that waits for ``guard``'s copies; it holds the
    guard weakly, so a manager dropped without ``close()`` is freed and its hooks do nothing."""

    @torch.compiler.disable  # a wait on another thread: never traced into a compiled graph
    def hook(*args: Any) -> None:
        live = guard()
        if live is not None:
            live.wait()

    return hook


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
