"""A load whose model target is the live model's own tensors: DCP's set_state_dict is skipped for
the model (the read already put every value in place), and only there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, CoordinationConfig, ScheduleConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Halving(nn.Module):
    """Its loader halves ``w``: load_state_dict must run for it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        state_dict[prefix + "w"] = state_dict[prefix + "w"] / 2
        super()._load_from_state_dict(state_dict, prefix, *args)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    if kind == "hooked":
        model.register_load_state_dict_pre_hook(lambda *args, **kwargs: None)
    if kind == "loader":
        model.append(_Halving())
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 6)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    state.update({f"optim.{i}.{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()})
    return state


def _manager(root: Any, model: nn.Module, opt: torch.optim.Optimizer) -> CheckpointManager:
    config = CheckpointConfig(
        root=str(root), schedule=ScheduleConfig(interval_steps=None), coordination=CoordinationConfig(lock=False)
    )
    return CheckpointManager(config, model=model, optimizer=opt)


@pytest.mark.parametrize("kind", ["plain", "hooked", "loader"])
def test_the_model_is_loaded_in_place_only_where_load_state_dict_would_only_copy(
    tmp_path: Any, monkeypatch: Any, kind: str
) -> None:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=0.25)
    _train(model, opt, 3)
    with _manager(tmp_path, model, opt) as manager:
        manager.save(3)
    want, lr = _state(model, opt), opt.param_groups[0]["lr"]
    _train(model, opt, 2)
    opt.param_groups[0]["lr"] = 0.5
    calls: list[nn.Module] = []
    original = nn.Module.load_state_dict

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "load_state_dict", counted)
    with _manager(tmp_path, model, opt) as manager:
        assert manager.load() is not None
    assert (calls == []) == (kind == "plain")
    got = _state(model, opt)
    if kind == "loader":  # its loader ran: the saved w, halved
        want["3.w"] = want["3.w"] / 2
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert opt.param_groups[0]["lr"] == lr  # the groups' hyperparameters restored too
