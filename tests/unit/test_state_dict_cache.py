"""StateDictCache: DCP's SHARDED get_state_dict reused only while nothing it derives from changed."""

from __future__ import annotations

import io
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from distckpt._adapters.state_dict_cache import StateDictCache
from distckpt._engine.save_planner import LeanSavePlanner
from distckpt._memory.plan import exact_key, resolve
from distckpt._state.guard import deferrable


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
    model(torch.randn(6, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()


def _fresh(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    return get_state_dict(model, [optimizer])


def _assert_same(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    """Same keys in the same order, model tensors aliasing the same data with equal values, the
    optimizer's per-parameter state the same live dicts, equal param groups (key order too)."""
    (gm, go), (wm, wo) = got, want
    assert list(gm) == list(wm)
    for key in wm:
        assert gm[key].data_ptr() == wm[key].data_ptr() and gm[key].shape == wm[key].shape, key
        assert torch.equal(gm[key], wm[key]), key
    assert list(go) == list(wo) and list(go["state"]) == list(wo["state"])
    assert all(go["state"][k] is wo["state"][k] for k in wo["state"])
    assert go["param_groups"] == wo["param_groups"]
    assert [list(g) for g in go["param_groups"]] == [list(g) for g in wo["param_groups"]]


def test_the_cached_state_dict_is_dcps_at_every_step_with_the_current_learning_rate() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    cache = StateDictCache(model, optimizer)
    _train(model, optimizer, scheduler)
    lrs = []
    for _ in range(4):
        got = cache.get(lambda: _fresh(model, optimizer))
        _assert_same(got, _fresh(model, optimizer))
        lrs.append(got[1]["param_groups"][0]["lr"])
        _train(model, optimizer, scheduler)
    assert cache.hits == 3
    assert lrs == pytest.approx([1e-2 / 2, 1e-2 / 3, 1e-2 / 4, 1e-2 / 5], rel=1e-12)  # read anew at each hit


def test_a_hit_hands_out_new_containers() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optimizer)
    cache = StateDictCache(model, optimizer)
    first = cache.get(lambda: _fresh(model, optimizer))
    first[0].pop("0.weight")
    first[1]["param_groups"][0]["lr"] = 5.0
    second = cache.get(lambda: _fresh(model, optimizer))
    assert cache.hits == 1 and "0.weight" in second[0] and second[1]["param_groups"][0]["lr"] == 0.1


def _replace_param(model: nn.Module, optimizer: Any) -> None:
    old, new = model[0].bias, nn.Parameter(torch.zeros(8))
    model[0].bias = new
    group = optimizer.param_groups[0]["params"]
    group[next(i for i, p in enumerate(group) if p is old)] = new
    optimizer.state[new] = optimizer.state.pop(old)


def _replace_buffer(model: nn.Module, optimizer: Any) -> None:
    model[1].running_mean = torch.zeros(8)


def _reassign_data(model: nn.Module, optimizer: Any) -> None:
    model[0].weight.data = torch.ones(8, 4)


def _transposed_view(model: nn.Module, optimizer: Any) -> None:
    weight = model[0].weight
    weight.data = torch.zeros(4, 8).t()  # same shape, other strides and storage


def _new_buffer(model: nn.Module, optimizer: Any) -> None:
    model[3].register_buffer("scale", torch.ones(2))


def _buffer_made_non_persistent(model: nn.Module, optimizer: Any) -> None:
    model[1]._non_persistent_buffers_set.add("running_mean")


def _swap_child(model: nn.Module, optimizer: Any) -> None:
    model[2] = nn.GELU()


def _reloaded_optimizer(model: nn.Module, optimizer: Any) -> None:
    optimizer.load_state_dict(optimizer.state_dict())  # new per-parameter state dicts


def _new_param_group(model: nn.Module, optimizer: Any) -> None:
    extra = nn.Linear(2, 2)
    model.append(extra)
    _train_once = extra(torch.randn(1, 2)).sum()
    _train_once.backward()
    optimizer.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    optimizer.step()


def _new_group_key(model: nn.Module, optimizer: Any) -> None:
    optimizer.param_groups[0]["custom"] = 1


@pytest.mark.parametrize(
    "change",
    [
        _replace_param,
        _replace_buffer,
        _reassign_data,
        _transposed_view,
        _new_buffer,
        _buffer_made_non_persistent,
        _swap_child,
        _reloaded_optimizer,
        _new_param_group,
        _new_group_key,
    ],
)
def test_a_change_of_what_the_state_dict_derives_from_is_a_miss(change: Callable[[nn.Module, Any], None]) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    cache = StateDictCache(model, optimizer)
    cache.get(lambda: _fresh(model, optimizer))
    cache.get(lambda: _fresh(model, optimizer))
    assert cache.hits == 1
    assert deferrable(model, optimizer, cache.guarded) == deferrable(model, optimizer)  # a hit's walk
    assert cache.live
    change(model, optimizer)
    _assert_same(cache.get(lambda: _fresh(model, optimizer)), _fresh(model, optimizer))
    assert cache.hits == 1  # the change was a miss
    assert deferrable(model, optimizer, cache.guarded) == deferrable(model, optimizer)  # the walk after DCP's
    _assert_same(cache.get(lambda: _fresh(model, optimizer)), _fresh(model, optimizer))
    assert cache.hits == 2  # and the new structure is cached


class _WithExtraState(nn.Linear):
    def get_extra_state(self) -> Any:
        return {"calls": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


def _post_hooked(model: nn.Module) -> None:
    model[3].register_state_dict_post_hook(lambda module, sd, prefix, local: None)


def _stateful_module(model: nn.Module) -> None:
    model[3] = _WithExtraState(8, 2)


class _SavesAnAttribute(nn.Linear):
    """Saves a tensor attribute the loop replaces at each step (not a parameter or buffer)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.count = torch.zeros(1)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "count"] = self.count

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        self.count = state_dict.pop(prefix + "count").clone()
        super()._load_from_state_dict(state_dict, prefix, *args)


class _StateDictOverride(nn.Linear):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return super().state_dict(*args, **kwargs)


@pytest.mark.parametrize(
    "setup",
    ["post_hook", "extra_state", "optimizer_hook", "save_override", "state_dict_override", "instance_override"],
)
def test_a_result_that_is_not_a_pure_function_of_the_structure_is_never_cached(setup: str) -> None:
    model = _model()
    if setup == "post_hook":
        _post_hooked(model)
    if setup == "extra_state":
        _stateful_module(model)
    if setup == "save_override":
        model[3] = _SavesAnAttribute(8, 2)
    if setup == "state_dict_override":
        model[3] = _StateDictOverride(8, 2)
    if setup == "instance_override":
        model[3]._save_to_state_dict = model[3]._save_to_state_dict  # Module.state_dict calls the instance's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if setup == "optimizer_hook":
        optimizer.register_state_dict_post_hook(lambda opt, sd: sd)
    _train(model, optimizer)
    cache = StateDictCache(model, optimizer)
    calls = []

    def compute() -> tuple[dict[str, Any], dict[str, Any]]:
        calls.append(1)
        return _fresh(model, optimizer)

    for _ in range(3):
        cache.get(compute)
    assert cache.hits == 0 and len(calls) == 3
    assert cache.guarded is None and not cache.live  # the walk stopped: the guard walks the model itself


def test_a_state_dict_pre_hook_runs_at_every_hit() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    seen: list[str] = []
    model[3].register_state_dict_pre_hook(lambda module, prefix, keep_vars: seen.append(prefix))
    cache = StateDictCache(model, optimizer)
    for _ in range(3):
        cache.get(lambda: _fresh(model, optimizer))
    assert cache.hits == 2
    assert seen.count("3.") >= 3 and set(seen) == {"3."}


def test_exact_key_tells_apart_values_that_compare_equal_but_serialize_differently() -> None:
    assert exact_key(0.0) != exact_key(-0.0)
    assert exact_key(1) != exact_key(True) and exact_key(1) != exact_key(1.0)
    assert exact_key((0.9, 0.999)) == exact_key((0.9, 0.999)) != exact_key((0.9, 0.99))
    assert exact_key([0.9]) is None and exact_key((0.9, [1])) is None and exact_key(torch.ones(1)) is None


def test_a_snapshot_blob_is_reused_only_while_its_value_is_exactly_the_same() -> None:
    planner = LeanSavePlanner()
    blobs: dict[str, Any] = {}

    def blob(lr: float) -> Any:
        planner.set_up_planner({"optim": {"param_groups": [{"lr": lr, "betas": (0.9, 0.999)}]}})
        item = next(i for i in planner.create_local_plan().items if i.index.fqn.endswith("lr"))
        return torch.load(io.BytesIO(resolve(planner, item, blobs).getvalue()), weights_only=True)

    assert blob(0.5) == 0.5 and blob(0.25) == 0.25 and blob(0.25) == 0.25
    assert str(blob(-0.0)) == "-0.0" and str(blob(0.0)) == "0.0"


def test_the_lean_planner_plans_what_dcps_default_planner_plans() -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {
        "model": {"w": torch.ones(3)},
        "optim": {"state": {"w": {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
    }
    lean, default = LeanSavePlanner(), DefaultSavePlanner()
    lean.set_up_planner(state, is_coordinator=True)
    default.set_up_planner(state, is_coordinator=True)
    assert lean.create_local_plan() == default.create_local_plan()
    assert lean.mappings == default.mappings and lean.flatten_sharded_tensors and lean.flatten_state_dict


def test_the_loaded_param_groups_reach_dcps_split_with_constant_time_membership(monkeypatch: Any) -> None:
    # DCP's _split_optim_state_dict runs `fqn in group["params"]` per parameter and group: with
    # plain lists that is quadratic in the parameter count.
    import distckpt._adapters.model_optim as model_optim

    model = _model()
    model.register_load_state_dict_pre_hook(lambda *args, **kwargs: None)  # DCP's set_state_dict path
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    state = model_optim.ModelOptimState(model, optimizer)
    model_sd, optim_sd = state.target_for_load()
    seen: list[Any] = []

    def spy(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.extend(g["params"] for g in kwargs["optim_state_dict"]["param_groups"])
            return real(*args, **kwargs)

        return call

    # The model loaded in place: only the optimizer's state_dict is set.
    for name in ("set_state_dict", "set_optimizer_state_dict"):
        monkeypatch.setattr(model_optim, name, spy(getattr(model_optim, name)))
    with state.load_context():
        state.apply(model_sd, optim_sd)
    assert seen and all(type(p).__contains__ is not list.__contains__ for p in seen)
    assert all(list(p) == list(g["params"]) for p, g in zip(seen, optim_sd["param_groups"]))


def test_a_save_after_the_model_changed_records_the_new_layout_and_loads(tmp_path: Any) -> None:
    # The manifest's model layout is the saved state_dict's, not the first save's.
    from distckpt import CheckpointConfig, CheckpointManager, IncompatibleCheckpointError

    config = CheckpointConfig(root=str(tmp_path), schedule={"interval_steps": None})
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
        manager.save(1)
        manager.save(2)  # a cache hit: the same layout
        model[3].register_buffer("scale", torch.full((2,), 3.0))
        manager.save(3)
    changed = _model()
    changed[3].register_buffer("scale", torch.zeros(2))
    with CheckpointManager(config, model=changed, optimizer=torch.optim.AdamW(changed.parameters())) as manager:
        assert manager.load().step == 3
    assert torch.equal(changed[3].scale, torch.full((2,), 3.0))
    assert all(torch.equal(a, b) for a, b in zip(changed.parameters(), model.parameters()))
    old = _model()
    with CheckpointManager(config, model=old, optimizer=torch.optim.AdamW(old.parameters())) as manager:
        with pytest.raises(IncompatibleCheckpointError, match="scale"):
            manager.load()


def test_a_tensor_attribute_a_module_saves_itself_is_saved_as_it_is_at_each_save(tmp_path: Any) -> None:
    # The attribute is replaced at each step: a reused state_dict would save step 1's value.
    from distckpt import CheckpointConfig, CheckpointManager

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(_SavesAnAttribute(2, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = build()
    config = CheckpointConfig(root=str(tmp_path), schedule={"interval_steps": 1})
    with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
        for step in (1, 2, 3):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            model[0].count = model[0].count + 1
            manager.maybe_save(step)
    model2, optimizer2 = build()
    with CheckpointManager(config, model=model2, optimizer=optimizer2) as manager:
        assert manager.load().step == 3
    assert torch.equal(model2[0].count, torch.tensor([3.0]))
