"""What is saved is what load() restores, exactly (issue 35, items 1-4), in one process."""

import json
import pickle

import pytest
import torch
from torch import nn

from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointSaveError,
    IncompatibleCheckpointError,
    LoadConfig,
)
from distckpt._ondisk.manifest import TensorSpec, model_fingerprint
from distckpt._tools.audit import audit_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def assert_same(got, want, path="value"):
    """Equal values of equal types; tensors bitwise (dtype, shape, bytes)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        bits = [t.detach().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*bits), path
    elif isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


# ----------------------------------------------------------------- item 1: LBFGS


def _lbfgs_steps(model, opt, first, last):
    for step in range(first, last + 1):
        x, y = _batch(step)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)


@pytest.mark.parametrize("tier", ["durable", "memory"])
@pytest.mark.parametrize("saved_at", [0, 3])
def test_lbfgs_resumes_bitwise(tmp_path, saved_at, tier):
    # 0: saved before the first step (no state); 3: with its history (old_dirs, ro, d, H_diag, ...).
    # memory: a snapshot, the job crashed; a fresh LBFGS lacks the history keys the restore adds.
    def make(seed):
        model = _net(seed)
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)

    memory = {"enabled": tier == "memory", "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    model, opt = make(0)
    _lbfgs_steps(model, opt, 1, saved_at)
    m = CheckpointManager(config, model=model, optimizer=opt)
    if tier == "memory":
        m.maybe_save(saved_at)
        m.memory.wait()
        m.__exit__(RuntimeError, RuntimeError("crashed"), None)  # the snapshot stays for the restart
    else:
        m.save(saved_at)
        m.close()
    saved_state = pickle.loads(pickle.dumps(opt.state_dict()))
    model2, opt2 = make(1)
    with CheckpointManager(config, model=model2, optimizer=opt2) as m:
        assert m.load().step == saved_at
        assert m.loader.tier == tier
    assert_same(opt2.state_dict(), saved_state, "optimizer")
    assert_same(model2.state_dict(), model.state_dict(), "model")
    _lbfgs_steps(model, opt, saved_at + 1, saved_at + 2)
    _lbfgs_steps(model2, opt2, saved_at + 1, saved_at + 2)
    assert_same(model2.state_dict(), model.state_dict(), "model after two more steps")
    assert_same(opt2.state_dict(), opt.state_dict(), "optimizer after two more steps")


OPTIMIZERS = {  # every torch.optim optimizer but LBFGS (above) and SparseAdam (sparse gradients only)
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=1),
    "Muon": lambda p: torch.optim.Muon([q for q in p if q.dim() == 2], lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_other_torch_optimizer_resumes_bitwise(tmp_path, name):
    model = _net(0)
    opt = OPTIMIZERS[name](list(model.parameters()))
    _plain_steps(model, opt, 1, 3)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=opt) as m:
        m.save(3)
    model2 = _net(1)
    opt2 = OPTIMIZERS[name](list(model2.parameters()))
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model2, optimizer=opt2) as m:
        m.load()
    assert_same(opt2.state_dict(), opt.state_dict(), "optimizer")
    _plain_steps(model, opt, 4, 5)
    _plain_steps(model2, opt2, 4, 5)
    assert_same(model2.state_dict(), model.state_dict(), "model after two more steps")


def _plain_steps(model, opt, first, last):
    for step in range(first, last + 1):
        x, y = _batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()


# ------------------------------------------------- item 2: param-group keys added in training


def _adamw(model):
    groups = [
        {"params": [model[0].weight]},
        {"params": [model[0].bias], "weight_decay": 0.0},
        {"params": list(model[2].parameters()), "lr": torch.tensor(0.01)},
    ]
    return torch.optim.AdamW(groups, lr=1e-3)


def _adam_steps(model, opt, first, last):
    for step in range(first, last + 1):
        x, y = _batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        if step == 1:  # layer-wise decay: a key the optimizer was built without
            for depth, group in enumerate(opt.param_groups[1:], start=1):
                group["lr_scale"] = 0.5**depth
        opt.param_groups[0]["lr"] *= 0.9
        opt.param_groups[2]["lr"].mul_(0.8)  # a tensor lr (capturable/compiled schedules)


def test_param_group_keys_added_during_training_are_restored(tmp_path):
    model, opt = _net(0), None
    opt = _adamw(model)
    _adam_steps(model, opt, 1, 3)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=opt) as m:
        m.save(3)
    model2 = _net(1)
    opt2 = _adamw(model2)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model2, optimizer=opt2) as m:
        m.load()
    assert [g.get("lr_scale") for g in opt2.param_groups] == [None, 0.5, 0.25]
    assert_same(opt2.state_dict(), opt.state_dict(), "optimizer")
    _adam_steps(model, opt, 4, 5)
    _adam_steps(model2, opt2, 4, 5)
    assert_same(model2.state_dict(), model.state_dict(), "model after two more steps")


# -------------------------------------------------------- item 3: module extra state that grows


class Fp8Linear(nn.Linear):
    """TransformerEngine-style: FP8 scaling history as extra state, longer after every step."""

    def __init__(self, kind):
        super().__init__(4, 3)
        self.kind, self.amax = kind, [0.5]

    def record(self):
        self.amax.append(float(self.weight.abs().max()))

    def get_extra_state(self):
        if self.kind == "bytes":  # TE: pickled bytes as a uint8 tensor
            return torch.frombuffer(bytearray(pickle.dumps(self.amax)), dtype=torch.uint8)
        return {"amax_history": torch.tensor(self.amax, dtype=torch.float64), "recipe": {"len": len(self.amax)}}

    def set_extra_state(self, state):
        if self.kind == "bytes":
            self.amax = pickle.loads(state.numpy().tobytes())
        else:
            self.amax = state["amax_history"].tolist()
            assert state["recipe"] == {"len": len(self.amax)}


def _fp8_net(kind, seed):
    torch.manual_seed(seed)
    return nn.Sequential(Fp8Linear(kind), nn.Tanh(), nn.Linear(3, 1))


def _fp8_steps(model, opt, first, last):
    for step in range(first, last + 1):
        _plain_steps(model, opt, step, step)
        model[0].record()


@pytest.mark.parametrize("kind", ["bytes", "dict"])
def test_growing_module_extra_state_resumes_exactly(tmp_path, kind):
    model = _fp8_net(kind, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = CheckpointConfig(root=str(tmp_path), load=LoadConfig(fallback_to_older=True))
    with CheckpointManager(cfg, model=model, optimizer=opt) as m:
        _fp8_steps(model, opt, 1, 2)
        m.save(2)
        _fp8_steps(model, opt, 3, 5)
        m.save(5)  # a longer history than at step 2 and than the fresh module's
    model2 = _fp8_net(kind, 1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    with CheckpointManager(cfg, model=model2, optimizer=opt2) as m:
        assert m.load().step == 5  # not set aside as corrupt for an older one
    assert sorted(p.name for p in tmp_path.glob("*step-*")) == ["step-000000002", "step-000000005"]
    for step in (2, 5):  # `distckpt verify` agrees
        assert audit_checkpoint(tmp_path / f"step-{step:09d}").problems == []
    assert model2[0].amax == model[0].amax and len(model[0].amax) == 6
    assert_same(model2.state_dict(), model.state_dict(), "model")
    assert_same(opt2.state_dict(), opt.state_dict(), "optimizer")


def test_module_extra_state_the_other_side_lacks_is_incompatible(tmp_path):
    model = _fp8_net("bytes", 0)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None) as m:
        model[0].record()
        m.save(1)
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))  # same parameters, no extra state
    with CheckpointManager(CheckpointConfig(root=str(tmp_path / "x")), model=plain, optimizer=None) as m:
        m.save(1)
    for root, live, line in [
        (tmp_path, plain, "in checkpoint, not in the live model (a module's get_extra_state()): model.0._extra_state"),
        (tmp_path / "x", _fp8_net("bytes", 1), "missing in checkpoint: model.0._extra_state"),
    ]:
        with CheckpointManager(CheckpointConfig(root=str(root)), model=live, optimizer=None) as m:
            with pytest.raises(IncompatibleCheckpointError) as err:
                m.load()
        assert line in str(err.value)


def test_manifest_listing_extra_state_as_older_distckpt_wrote_still_loads(tmp_path):
    # distckpt before issue 35 put a tensor-valued _extra_state in the manifest's model.
    model = _fp8_net("bytes", 0)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None) as m:
        m.save(1)
    (path,) = tmp_path.glob("step-*/distckpt.json")
    data = json.loads(path.read_text())
    data["model"]["0._extra_state"] = {"shape": [len(pickle.dumps([0.5]))], "dtype": "torch.uint8"}
    data["model_fingerprint"] = model_fingerprint({k: TensorSpec(**v) for k, v in data["model"].items()})
    path.write_text(json.dumps(data))
    model2 = _fp8_net("bytes", 1)
    model2[0].amax = [9.0, 9.0]
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model2, optimizer=None) as m:
        m.load()
    assert model2[0].amax == [0.5]
    assert_same(model2.state_dict(), model.state_dict(), "model")


# --------------------------------------------------- item 4: values in a Stateful's state_dict


class Holder:
    """A Stateful whose state is what it was given (a fresh one holds ``{}``)."""

    def __init__(self, state=None):
        self.state = {} if state is None else state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


ROUND_TRIPS = {
    "nested empty dict": {"n": {"empty_d": {}}, "x": 1},
    "dict of empty dicts": {"a": {"b": {}, "c": {"d": {}}}},
    "empty dict in a list with tensors": {"l": [1, {}, torch.ones(2), {}]},
    "empty shadow": {"updates": 0, "shadow": {}, "t": torch.zeros(0)},
    "empty list": {"e": [], "f": [[], {}], "g": [1, {}]},
    "big int": {"b": 2**70, "neg": -(2**65)},
    "bytes": {"b": b"\x00\xffab", "ba": bytearray(b"xy")},
    "set": {"s": {1, 2, "a"}, "in list": [torch.ones(1), {3}]},
    "tuple": {"t": (1, "a", (2.5, None)), "tt": (1, torch.arange(3))},
    "int keys inside a tuple": {"t": ({1: "a", 2: torch.ones(1)},)},
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_stateful_values_round_trip_exactly(tmp_path, case):
    state = ROUND_TRIPS[case]
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=nn.Linear(2, 2), optimizer=None, extra_state={"h": Holder(state)}
    ) as m:
        m.save(1)
    fresh = Holder()
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=nn.Linear(2, 2), optimizer=None, extra_state={"h": fresh}
    ) as m:
        m.load()
    assert_same(fresh.state, state, "state")


@pytest.mark.parametrize(
    "state,where",
    [
        ({"d": {1: "a", 2: "b"}}, "['d']: dict key 1 (int)"),
        ({"l": [torch.ones(1), {"x": {(1, 2): 3}}]}, "['l'][1]['x']: dict key (1, 2) (tuple)"),
        ({"d": {1: "a", "1": "b"}}, "['d']: dict key 1 (int)"),
        ({"fs": frozenset({3})}, "['fs']: a builtins.frozenset"),  # torch.load(weights_only=True) refuses it
    ],
)
def test_stateful_dict_keys_dcp_would_stringify_are_refused_at_save(tmp_path, state, where):
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=nn.Linear(2, 2), optimizer=None, extra_state={"h": Holder(state)}
    ) as m:
        with pytest.raises(CheckpointSaveError) as err:
            m.save(1)
    assert f"extra_state['h'].state_dict(){where} cannot be saved" in str(err.value)
    assert not list(tmp_path.glob("step-*"))
