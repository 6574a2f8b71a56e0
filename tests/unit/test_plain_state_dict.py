"""plain_state_dicts: DCP's SHARDED get_state_dict of an unwrapped model, and None wherever DCP is needed."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from distckpt._adapters.plain_state_dict import plain_state_dicts


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.ModuleDict({"a": nn.Linear(4, 4), "norm": nn.BatchNorm1d(4)})
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(3)])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # registered twice: DCP names it by its first name
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body["norm"](self.body["a"](self.emb(x)))
        return self.head(h).sum() + sum(p.sum() for p in self.extra)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 10, (6,))).backward()
    optimizer.step()
    optimizer.zero_grad()


def _adamw_two_groups(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2)


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw_two_groups": _adamw_two_groups,
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), amsgrad=True),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters()),
}


def _assert_equal_to_dcps(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (gm, go), (wm, wo) = got, want
    assert list(gm) == list(wm)
    for key, value in wm.items():
        mine = gm[key]
        assert mine.data_ptr() == value.data_ptr() and mine.shape == value.shape, key
        assert mine.stride() == value.stride() and mine.dtype == value.dtype, key
        assert mine.requires_grad == value.requires_grad and torch.equal(mine, value), key
    assert list(go) == list(wo) == ["state", "param_groups"]
    assert list(go["state"]) == list(wo["state"])
    assert all(go["state"][k] is wo["state"][k] for k in wo["state"])  # the live per-parameter dicts
    assert go["param_groups"] == wo["param_groups"]
    assert [list(g) for g in go["param_groups"]] == [list(g) for g in wo["param_groups"]]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("frozen", [False, True])
def test_the_result_is_dcps(optimizer: str, frozen: bool) -> None:
    torch.manual_seed(0)
    model = _Tied()
    if frozen:
        model.body["a"].bias.requires_grad_(False)
    opt = OPTIMIZERS[optimizer](model)
    _train(model, opt)
    got = plain_state_dicts(model, opt)
    assert got is not None
    _assert_equal_to_dcps(got, get_state_dict(model, [opt]))


def test_without_an_optimizer_the_model_part_is_dcps() -> None:
    model = _Tied()
    got = plain_state_dicts(model, None)
    assert got is not None and got[1] == {}
    want, want_optim = get_state_dict(model, [])
    assert want_optim == {}
    assert list(got[0]) == list(want) and all(torch.equal(got[0][k], want[k]) for k in want)


def _compiled(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    return torch.compile(model), opt


def _checkpoint_wrapped(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.body["a"] = checkpoint_wrapper(model.body["a"])
    return model, opt


def _fqn_modifiers(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    model.body["a"]._fqn_modifiers = lambda: {}
    return model, opt


def _fresh_optimizer(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    return model, torch.optim.AdamW(model.parameters())


def _hooked_optimizer(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    opt.register_state_dict_post_hook(lambda o, sd: sd)
    return model, opt


def _state_dict_override(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    model.state_dict = lambda *a, **k: {}  # patched on the instance
    return model, opt


def _foreign_parameter(model: nn.Module, opt: Any) -> tuple[nn.Module, Any]:
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    return model, opt


@pytest.mark.parametrize(
    "setup",
    [
        _compiled,
        _checkpoint_wrapped,
        _fqn_modifiers,
        _fresh_optimizer,
        _hooked_optimizer,
        _state_dict_override,
        _foreign_parameter,
    ],
)
def test_dcp_is_needed(setup: Callable[[nn.Module, Any], tuple[nn.Module, Any]]) -> None:
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    model, opt = setup(model, opt)
    assert plain_state_dicts(model, opt) is None


def test_a_model_without_state_is_left_to_dcp() -> None:
    assert plain_state_dicts(nn.ReLU(), None) is None


def test_a_state_dict_post_hook_is_left_to_dcp() -> None:
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    model.body["a"].register_state_dict_post_hook(lambda module, sd, prefix, local: None)
    assert plain_state_dicts(model, opt) is None


class _Renamed(nn.Linear):
    """Saves its parameters under names that are not attributes: DCP's get_state_dict raises."""

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "w"], destination[prefix + "b"] = self.weight.detach(), self.bias.detach()


def test_a_module_that_saves_its_own_way_is_left_to_dcp() -> None:
    model = nn.Sequential(_Renamed(3, 3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert plain_state_dicts(model, opt) is None
    with pytest.raises(AttributeError):
        get_state_dict(model, [opt])  # DCP's error reaches the save, which commits nothing


def test_an_instance_override_is_left_to_dcp() -> None:
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    save = model.body["a"]._save_to_state_dict
    model.body["a"]._save_to_state_dict = save  # set on the instance: Module.state_dict calls it
    assert plain_state_dicts(model, opt) is None
