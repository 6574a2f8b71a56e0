"""MutationGuard: the loop waits before the first instruction that changes what a copy in flight reads."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from distckpt._state.guard import MutationGuard


class _BroadcastingWrapper(nn.Module):
    """Like DDP with ``broadcast_buffers``: its forward overwrites the inner module's buffers in
    place (with rank 0's) before the inner module's forward runs."""

    broadcast_buffers = True

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.module.buffers():
            b.fill_(7)
        return self.module(x)


def test_a_wrapper_that_overwrites_buffers_waits_before_its_forward() -> None:
    model = _BroadcastingWrapper(nn.BatchNorm1d(3))
    seen: list[torch.Tensor] = []
    guard = MutationGuard(model, None)
    guard.add(lambda: seen.append(model.module.running_mean.clone()))
    model(torch.randn(4, 3))
    assert seen and torch.equal(seen[0], torch.zeros(3))  # the first wait came before the overwrite
    guard.remove()


def test_a_model_without_buffers_never_waits_in_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    calls: list[int] = []
    guard = MutationGuard(model, None)
    guard.add(lambda: calls.append(1))
    model(torch.randn(2, 3))
    assert calls == []
    guard.remove()


def test_a_guard_never_removed_keeps_no_model_alive() -> None:
    """The step pre-hook is process-wide: it holds the guard weakly, so a manager dropped without
    ``close()`` leaves no model or optimizer (GPU memory) behind."""
    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    guard = MutationGuard(model, optimizer)
    guard.add(lambda: None)
    dead = weakref.ref(model)
    del model, optimizer, guard
    gc.collect()
    assert dead() is None
    other = nn.Linear(2, 2)
    torch.optim.SGD(other.parameters(), lr=1.0).step()  # the orphaned hook does nothing


def test_a_model_the_user_keeps_does_not_keep_a_dropped_guard() -> None:
    """The forward hooks on a model with buffers hold the guard weakly too: the guard of a manager
    dropped without ``close()`` is freed, and its hooks wait for nothing."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    calls: list[int] = []
    guard = MutationGuard(model, None)
    guard.add(lambda: calls.append(1))
    model(torch.randn(4, 3))
    assert calls == [1, 1]  # the root's hook and the BatchNorm's
    dead = weakref.ref(guard)
    del guard
    gc.collect()
    assert dead() is None
    model(torch.randn(4, 3))
    assert calls == [1, 1]
