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


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
    if kind == "adamw groups":
        return torch.optim.AdamW([{"params": first, "lr": 0.1, "lr_scale": 0.5}, {"params": rest, "weight_decay": 0}])
    if kind == "sgd nesterov":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    if kind == "adam amsgrad":
        return torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    return torch.optim.RMSprop(model.parameters(), lr=0.01, centered=True)


def _packed(opt: torch.optim.Optimizer) -> dict[str, Any]:
    sd = opt.state_dict()
    return {
        "state": {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
            for k, s in sd["state"].items()
        },
        "param_groups": sd["param_groups"],
    }


@pytest.mark.parametrize("kind", ["adamw groups", "sgd nesterov", "adam amsgrad", "rmsprop"])
@pytest.mark.parametrize("frozen", [False, True])
def test_the_optimizer_loaded_directly_equals_dcps_set_optimizer_state_dict(
    tmp_path: Any, monkeypatch: Any, kind: str, frozen: bool
) -> None:
    from distckpt._adapters.model_optim import ModelOptimState

    model = _model("plain")
    if frozen:  # listed in the optimizer without state, as at the save
        model[2].bias.requires_grad_(False)
    opt = _optimizer(kind, model)
    _train(model, opt, 3)
    with _manager(tmp_path, model, opt) as manager:
        manager.save(3)
    loaded, taken = [], []
    real = ModelOptimState._load_optimizer
    monkeypatch.setattr(ModelOptimState, "_load_optimizer", lambda *args: taken.append(real(*args)) or taken[-1])
    for direct in (True, False):
        _train(model, opt, 2)
        opt.param_groups[0]["lr"] = 0.5
        if not direct:
            monkeypatch.setattr(ModelOptimState, "_load_optimizer", lambda *args: False)
        with _manager(tmp_path, model, opt) as manager:
            assert manager.load() is not None
        loaded.append(_packed(opt))
    fast, dcp = loaded
    assert taken == [True]  # the first load went the direct way
    assert fast["param_groups"] == dcp["param_groups"] and fast["state"].keys() == dcp["state"].keys()
    for k, s in fast["state"].items():
        assert s.keys() == dcp["state"][k].keys()
        assert all(
            torch.equal(v, dcp["state"][k][n]) if isinstance(v, torch.Tensor) else v == dcp["state"][k][n]
            for n, v in s.items()
        )
    assert (1 if frozen else 0) == sum(1 for g in opt.param_groups for p in g["params"] if p not in opt.state)


class _CloneSave(nn.Module):
    """Its state_dict holds a copy of ``w``, not ``w`` itself: a read into it is not a load."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "w"] = self.w.detach().clone()


def test_a_module_whose_state_dict_holds_copies_is_loaded_through_set_state_dict(tmp_path: Any) -> None:
    model = _CloneSave()
    with torch.no_grad():
        model.w.fill_(7.0)
    with _manager(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1)) as manager:
        manager.save(1)
    fresh = _CloneSave()
    with _manager(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)) as manager:
        assert manager.load() is not None
    assert torch.equal(fresh.w.detach(), torch.full((3,), 7.0))


def test_a_load_into_a_model_that_does_not_fit_leaves_a_fresh_optimizer_without_state(tmp_path: Any) -> None:
    from distckpt import IncompatibleCheckpointError

    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    _train(nn.Sequential(nn.Linear(6, 4), model), opt, 1)
    with _manager(tmp_path, model, opt) as manager:
        manager.save(1)
    other = nn.Linear(4, 5)
    fresh = torch.optim.Adam(other.parameters())
    with _manager(tmp_path, other, fresh) as manager:
        with pytest.raises(IncompatibleCheckpointError, match="shape mismatch for weight"):
            manager.load()
    assert fresh.state == {}  # DCP's load target stepped it (lr 0): undone


@pytest.mark.parametrize("frozen", [False, True])
def test_the_parameters_without_saved_state_are_looked_up_only_when_the_checkpoint_has_some(
    tmp_path: Any, monkeypatch: Any, frozen: bool
) -> None:
    import distckpt._adapters.model_optim as model_optim

    model = _model("plain")
    if frozen:  # listed in the optimizer without state
        model[2].bias.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    with _manager(tmp_path, model, opt) as manager:
        manager.save(2)
    expected = _state(model, opt)
    _train(model, opt, 1)
    lookups = []
    real = model_optim._clean_names
    with _manager(tmp_path, model, opt) as manager:
        monkeypatch.setattr(model_optim, "_clean_names", lambda m: lookups.append(1) or real(m))
        assert manager.load() is not None
    assert len(lookups) == (1 if frozen else 0)  # every listed parameter with state: no name map built
    got = _state(model, opt)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert model[2].bias.requires_grad is not frozen and (model[2].bias in opt.state) is not frozen
