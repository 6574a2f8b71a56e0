"""The mutation guard holds the loop back before anything else can change what a copy in flight
reads: hooks the user (or PyTorch) registered before the manager, buffers a parent uses
functionally or that appear after the manager was built (issue 34, item 2). Each case restores a
memory snapshot of step 3, made while a slowed copy was still running when the next step began,
and compares it bitwise with the state at step 3. Also: DCP's dummy optimizer step at a load or
at a save before the first step never runs the user's step hooks."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, ConfigError
from distckpt._state.guard import MutationGuard
from tests.distributed.trainer import crash

SLOW_S = 0.3  # a background copy this slow: the next step would overtake it
STEPS = 3

Make = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _forward_backward(model: nn.Module, i: int) -> None:
    x, y = _batch(i)
    nn.functional.mse_loss(model(x), y).backward()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    _forward_backward(model, i)
    optimizer.step()
    optimizer.zero_grad()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()["state"]})


def _assert_equal(got: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), f"{path}: max |diff| {(got - expected).abs().max().item():.3g}"
    elif isinstance(expected, dict):
        assert set(got) == set(expected), path
        for k in expected:
            _assert_equal(got[k], expected[k], f"{path}.{k}")
    else:
        assert got == expected, path


@pytest.fixture
def slow_copy(slow_memory_copy):
    slow_memory_copy(SLOW_S)


def _snapshot_is_the_steps(
    tmp_path,
    make: Make,
    next_step: Callable[[nn.Module, torch.optim.Optimizer], None],
    after_build: Callable[[nn.Module, torch.optim.Optimizer], None] = lambda m, o: None,
) -> None:
    """Train ``STEPS`` steps with a memory snapshot at each, run ``next_step`` (the start of the
    next one) while the last copy is in flight, crash, restore: the state of step ``STEPS``."""
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    torch.manual_seed(0)
    model, optimizer = make()
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    after_build(model, optimizer)
    for i in range(1, STEPS + 1):
        _step(model, optimizer, i)
        manager.maybe_save(i)
    expected = _state(model, optimizer)
    next_step(model, optimizer)
    manager.memory.wait()
    crash(manager)

    torch.manual_seed(1)
    model2, optimizer2 = make()
    after_build(model2, optimizer2)
    restarted = CheckpointManager(config, model=model2, optimizer=optimizer2)
    state = restarted.load()
    got = _state(model2, optimizer2)
    tier = restarted.loader.tier
    restarted.close()
    assert state is not None and state.step == STEPS and tier == "memory"
    _assert_equal(got, expected)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _next_forward(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    _forward_backward(model, 99)


@pytest.mark.parametrize("style", ["hook", "parametrization"])
def test_spectral_norm_power_iteration_waits_for_the_copy(tmp_path, slow_copy, style):
    """``spectral_norm`` updates its ``u``/``v`` buffers in a forward pre-hook (or a
    parametrization) registered before the manager's hooks."""
    norm = nn.utils.spectral_norm if style == "hook" else nn.utils.parametrizations.spectral_norm

    def make():
        model = nn.Sequential(norm(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    _snapshot_is_the_steps(tmp_path, make, _next_forward)


class _FunctionalNorm(nn.Module):
    """The parent normalises with its child's statistics (``F.batch_norm``): the child's forward,
    and any hook on it, never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        h = nn.functional.batch_norm(self.lin(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, training=True)
        return self.out(h)


def test_a_parent_using_a_childs_statistics_waits_for_the_copy(tmp_path, slow_copy):
    def make():
        model = _FunctionalNorm()
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    _snapshot_is_the_steps(tmp_path, make, _next_forward)


def test_a_batchnorm_added_after_the_manager_waits_for_the_copy(tmp_path, slow_copy):
    def make():
        model = nn.Sequential(nn.Linear(4, 8), nn.Identity(), nn.ReLU(), nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    def insert_batchnorm(model, optimizer):  # the model finished after the manager was built
        model[1] = nn.BatchNorm1d(8)
        optimizer.add_param_group({"params": list(model[1].parameters())})

    _snapshot_is_the_steps(tmp_path, make, _next_forward, after_build=insert_batchnorm)


def test_a_user_optimizer_step_pre_hook_registered_first_runs_after_the_copy(tmp_path, slow_copy):
    """A projection of the weights in a step pre-hook registered before the manager's: it runs
    after the copy, and DCP's dummy step at the load does not run it on the restored weights."""

    def make():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

        def project(opt, args, kwargs):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)

        optimizer.register_step_pre_hook(project)
        return model, optimizer

    def next_step(model, optimizer):
        _forward_backward(model, 99)
        optimizer.step()

    _snapshot_is_the_steps(tmp_path, make, next_step)


def test_dcp_dummy_steps_never_run_the_users_step_hooks(tmp_path):
    """A save before the first step and a load into a fresh optimizer make DCP initialise the
    optimizer with a dummy ``step()``: the user's pre- and post-hooks (a projection, an EMA
    counter) must not see it."""
    calls: list[str] = []

    def make():
        torch.manual_seed(0)
        model = _mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        optimizer.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
        optimizer.register_step_post_hook(lambda o, a, k: calls.append("post"))
        return model, optimizer

    model, optimizer = make()
    manager = CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=optimizer)
    manager.save(0)
    assert calls == []
    _step(model, optimizer, 1)
    assert calls == ["pre", "post"]  # the hooks are back after the save
    manager.save(1)
    manager.close()
    calls.clear()

    model2, optimizer2 = make()
    restarted = CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model2, optimizer=optimizer2)
    assert restarted.load().step == 1
    assert calls == []
    _assert_equal(_state(model2, optimizer2), _state(model, optimizer))
    _step(model2, optimizer2, 2)
    assert calls == ["pre", "post"]
    restarted.close()


def test_the_guards_hooks_run_before_hooks_registered_earlier() -> None:
    """The forward pre-hook is the root's, prepended; the step pre-hook is process-wide, which
    torch runs before each optimizer's own, and every optimizer waits (one the manager was not
    given may step the model's parameters)."""
    model = nn.Sequential(nn.Linear(3, 3))
    model.register_buffer("seen", torch.zeros(()))  # the root owns the only buffer
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=1.0)
    order: list[str] = []
    model[0].register_forward_pre_hook(lambda m, a: order.append("user forward"))
    model.register_forward_pre_hook(lambda m, a: order.append("root forward"))
    optimizer.register_step_pre_hook(lambda o, a, k: order.append("user step"))
    guard = MutationGuard(model, optimizer)
    guard.add(lambda: order.append("wait"))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    other.step()
    guard.remove()
    model(torch.randn(4, 3))
    other.step()
    assert order == [
        "wait", "root forward", "user forward", "wait", "user step", "wait", "root forward", "user forward"
    ]  # fmt: skip


class _Wrapped(torch.optim.Optimizer):
    """Like accelerate's ``AcceleratedOptimizer``: never runs ``Optimizer.__init__``, steps the
    optimizer it wraps."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    state = property(lambda self: self.optimizer.state)
    param_groups = property(lambda self: self.optimizer.param_groups)
    defaults = property(lambda self: self.optimizer.defaults)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


class _Delegating(_Wrapped):
    """The same, reading any other attribute from the optimizer it wraps."""

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


@pytest.mark.parametrize("wrapper", [_Wrapped, _Delegating])
def test_the_optimizer_inside_a_wrapper_waits_for_the_copy(tmp_path, slow_copy, wrapper):
    def make():
        model = _mlp()
        return model, wrapper(torch.optim.Adam(model.parameters(), lr=0.1))

    def next_step(model, optimizer):
        _forward_backward(model, 99)
        optimizer.step()

    _snapshot_is_the_steps(tmp_path, make, next_step)


def test_a_wrapper_with_no_optimizer_to_unwrap_is_refused(tmp_path):
    class Bare(torch.optim.Optimizer):
        def __init__(self) -> None:  # never runs Optimizer.__init__
            pass

    with pytest.raises(ConfigError, match="never ran torch.optim.Optimizer.__init__"):
        CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=_mlp(), optimizer=Bare())


def test_an_optimizer_the_manager_was_not_given_waits_for_the_copy(tmp_path, slow_copy):
    """A GAN-like second optimizer over some of the model's parameters (the manager saves the
    model and its first optimizer only)."""
    second: dict[str, torch.optim.Optimizer] = {}

    def make():
        model = _mlp()
        second["optimizer"] = torch.optim.SGD(model[2].parameters(), lr=0.5)
        return model, torch.optim.Adam(model[0].parameters(), lr=0.1)

    def next_step(model, optimizer):
        _forward_backward(model, 99)
        second["optimizer"].step()

    _snapshot_is_the_steps(tmp_path, make, next_step)


def test_a_model_without_buffers_compiles_with_fullgraph(tmp_path):
    """No persistent buffers: no forward hook, so nothing for a fullgraph compile to break on."""
    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for i in (1, 2):
        x, y = _batch(i)
        nn.functional.mse_loss(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.maybe_save(i)
    manager.memory.wait()
    assert manager.memory.snapshots == 2
    manager.close()
