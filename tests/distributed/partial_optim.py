"""Trainings with a parameter that has no optimizer state at the save (issue 24, item 2).

``late``: a branch ``aux`` joins the loss only from step :data:`JOIN_AT` on, so AdamW has no
state for it at an earlier save. ``frozen``: a LoRA-style model whose frozen base is passed to
``AdamW(model.parameters())`` (``aux`` in the loss from the start), so the base never gets
state. Plain or DDP (``run_ranks``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig

JOIN_AT = 5  # first step whose loss uses the late branch
STEPS = 8
SAVE_AT = 3


class LateNet(nn.Module):
    def __init__(self, join_at: int) -> None:
        super().__init__()
        self.join_at = join_at
        self.base = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.head(torch.relu(self.base(x)))
        return y + self.aux(x) if step >= self.join_at else y


def build(case: str, *, seed: int = 0, ddp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (frozen base for ``frozen``) and ``AdamW(model.parameters())``; ``seed`` sets
    the initial weights (a resume builds with another one: the load must overwrite them)."""
    torch.manual_seed(seed)
    model: nn.Module = LateNet(JOIN_AT if case == "late" else 1)
    if case == "frozen":
        model.base.requires_grad_(False)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=case == "late")
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int = 0) -> dict[int, float]:
    """Train on each step's own batch (seeded by step and rank); ``{step: loss}``."""
    losses = {}
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=g)
        loss = nn.functional.mse_loss(model(x, step), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Params and optimizer state by parameter name (clones)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    names = {id(p): n for n, p in inner.named_parameters()}
    return {
        "params": {n: p.detach().clone() for n, p in inner.named_parameters()},
        "optim": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
    }


def manager(root: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(root=root, schedule=ScheduleConfig(interval_steps=None)), model=model, optimizer=optimizer
    )


def reference_and_save(rank: int, world_size: int, case: str, root: str) -> dict[str, Any]:
    """Uninterrupted run (no manager) of :data:`STEPS` steps; then a fresh run saved at
    :data:`SAVE_AT`. Returns the reference's losses and its state at the save and at the end."""
    ddp = dist.is_initialized()
    model, optimizer = build(case, ddp=ddp)
    losses = train(model, optimizer, range(1, SAVE_AT + 1), rank)
    at_save = snapshot(model, optimizer)
    losses.update(train(model, optimizer, range(SAVE_AT + 1, STEPS + 1), rank))
    end = snapshot(model, optimizer)
    model, optimizer = build(case, ddp=ddp)
    train(model, optimizer, range(1, SAVE_AT + 1), rank)
    with manager(root, model, optimizer) as m:
        m.save(SAVE_AT)
    return {"losses": losses, "at_save": at_save, "end": end}


def resume(rank: int, world_size: int, case: str, root: str) -> dict[str, Any]:
    """Fresh objects (other initial weights), ``load()``, train to :data:`STEPS`."""
    model, optimizer = build(case, seed=1, ddp=dist.is_initialized())
    with manager(root, model, optimizer) as m:
        state = m.load()
    loaded = snapshot(model, optimizer)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    requires_grad = {n: p.requires_grad for n, p in inner.named_parameters()}
    losses = train(model, optimizer, range(state.step + 1, STEPS + 1), rank)
    return {
        "step": state.step,
        "loaded": loaded,
        "losses": losses,
        "end": snapshot(model, optimizer),
        "requires_grad": requires_grad,
    }


def assert_resumed_bitwise(case: str, reference: dict[str, Any], resumed: dict[str, Any]) -> None:
    """The resumed run loaded the state the reference had at the save (the stateless parameters
    without state, ``requires_grad`` as built) and continued with the same losses and state."""
    assert resumed["step"] == SAVE_AT
    _assert_same(reference["at_save"], resumed["loaded"])
    stateless = {"late": {"aux.weight", "aux.bias"}, "frozen": {"base.weight", "base.bias"}}[case]
    assert stateless.isdisjoint(resumed["loaded"]["optim"])
    assert resumed["requires_grad"] == {
        n: not (case == "frozen" and n.startswith("base.")) for n in reference["end"]["params"]
    }
    assert resumed["losses"] == {s: v for s, v in reference["losses"].items() if s > SAVE_AT}  # float equality
    _assert_same(reference["end"], resumed["end"])


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys() and a["optim"].keys() == b["optim"].keys()
    for n, t in a["params"].items():
        assert torch.equal(t, b["params"][n]), n
    for n, s in a["optim"].items():
        assert s.keys() == b["optim"][n].keys(), n
        for k, t in s.items():
            assert torch.equal(t, b["optim"][n][k]), (n, k)
