"""What is saved is what load() restores (issue 24, items 2-4), in one process."""

import fractions
import re

import numpy as np
import pytest
import torch
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, CheckpointSaveError, IncompatibleCheckpointError
from tests.distributed import partial_optim

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("case", ["late", "frozen"])
def test_parameter_without_optimizer_state_at_save_resumes_bitwise(tmp_path, case):
    # late: `aux` joins the loss at step 5, saved at 3; frozen: the base frozen, AdamW(model.parameters()).
    reference = partial_optim.reference_and_save(0, 1, case, str(tmp_path))
    resumed = partial_optim.resume(0, 1, case, str(tmp_path))
    partial_optim.assert_resumed_bitwise(case, reference, resumed)


class EMA:
    """An exponential moving average whose shadow (and its log) appear at the first update."""

    def __init__(self, model, decay=0.75):
        self.model, self.decay, self.updates, self.shadow, self.log = model, decay, 0, {}, {}

    def update(self, step):
        self.updates += 1
        for name, p in self.model.named_parameters():
            old = self.shadow.get(name)
            self.shadow[name] = p.detach().clone() if old is None else old * self.decay + p.detach() * (1 - self.decay)
        self.log = {"steps": [*self.log.get("steps", []), step], "last": [torch.tensor(step)]}

    def state_dict(self):
        return {"updates": self.updates, "shadow": self.shadow, "log": self.log}

    def load_state_dict(self, sd):
        self.updates, self.shadow, self.log = sd["updates"], dict(sd["shadow"]), sd["log"]


def _trained_model(steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema, swa = EMA(model), torch.optim.swa_utils.AveragedModel(model)
    for step in range(1, steps + 1):
        model(torch.full((2, 4), float(step))).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update(step)
        swa.update_parameters(model)
    return model, ema, swa


def test_stateful_extra_state_is_restored_with_keys_its_fresh_object_lacks(tmp_path):
    model, ema, swa = _trained_model()
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None, extra_state={"ema": ema, "swa": swa}
    ) as m:
        m.save(3)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    ema2, swa2 = EMA(fresh), torch.optim.swa_utils.AveragedModel(fresh)
    live_shadow = ema2.shadow
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=fresh, optimizer=None, extra_state={"ema": ema2, "swa": swa2}
    ) as m:
        m.load()
    assert ema2.shadow.keys() == ema.shadow.keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert ema2.updates == 3 and ema2.log.get("steps") == [1, 2, 3]
    assert torch.equal(ema2.log["last"][0], torch.tensor(3))
    for name, value in ema.shadow.items():
        assert torch.equal(ema2.shadow[name], value) and ema2.shadow[name].dtype == value.dtype, name
    assert live_shadow == {}  # the load target was a copy; load_state_dict set the new shadow
    # AveragedModel: its fresh state_dict has every key (n_averaged and the averaged copy).
    assert swa2.state_dict().keys() == swa.state_dict().keys()
    for key, value in swa.state_dict().items():
        assert torch.equal(swa2.state_dict()[key], value), key
    assert int(swa2.n_averaged) == 3


def test_saved_stateful_keys_that_cannot_be_read_are_named(tmp_path, monkeypatch):
    # Without DCP's planner_data (a checkpoint saved by another planner) the saved paths are
    # unknown: the load refuses, naming the keys, instead of restoring the EMA in part.
    import distckpt._storage.generic as generic

    model, ema, _swa = _trained_model()
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None, extra_state={"ema": ema}
    ) as m:
        m.save(3)
    parse = generic.parse_dcp_metadata

    def without_paths(f, path):
        metadata = parse(f, path)
        metadata.planner_data = None
        return metadata

    monkeypatch.setattr(generic, "parse_dcp_metadata", without_paths)
    ema2 = EMA(model)
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None, extra_state={"ema": ema2}
    ) as m:
        with pytest.raises(IncompatibleCheckpointError) as err:
            m.load()
    assert "in checkpoint, not in the extra_state object's state_dict(): extra.ema.shadow.0.weight" in str(err.value)
    assert "extra.ema.shadow.1.bias" in err.value.unexpected and ema2.updates == 0


class NumpyStats:
    """A Stateful whose state_dict holds numpy values (DCP saves each as its own item)."""

    def __init__(self):
        self.mean, self.hist = np.float64(0.0), np.zeros(3, dtype=np.int32)

    def state_dict(self):
        return {"mean": self.mean, "hist": self.hist}

    def load_state_dict(self, sd):
        self.mean, self.hist = sd["mean"], sd["hist"]


NUMPY_VALUES = {
    "x": np.float64(0.25),
    "n": np.int64(-7),
    "f": np.float32(1.5),
    "flag": np.bool_(True),
    "a": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "nested": {"ids": np.array([3, 1], np.int64)},
}


def _assert_same_numpy(got, want):
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same_numpy(got[k], want[k])
    else:
        assert got.dtype == want.dtype and np.shape(got) == np.shape(want) and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("holder", ["plain", "stateful"])
def test_numpy_values_in_extra_state_round_trip_exactly(tmp_path, holder):
    # plain: values of extra_state (packed by distckpt); stateful: in a state_dict (DCP's items).
    stats = NumpyStats()
    stats.mean, stats.hist = np.float64(1 / 3), np.array([4, 0, 9], dtype=np.int32)
    saved = dict(NUMPY_VALUES) if holder == "plain" else {"stats": stats}
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=nn.Linear(2, 2), optimizer=None, extra_state=saved
    ) as m:
        m.save(1)
    fresh = NumpyStats()
    live = dict.fromkeys(NUMPY_VALUES) if holder == "plain" else {"stats": fresh}
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=nn.Linear(2, 2), optimizer=None, extra_state=live
    ) as m:
        m.load()
        if holder == "plain":
            _assert_same_numpy(m.extra_state, NUMPY_VALUES)
        else:
            _assert_same_numpy(fresh.state_dict(), stats.state_dict())


class _Opaque:
    pass


@pytest.mark.parametrize(
    "extra,where,kind",
    [
        ({"frac": {"lr": [1, fractions.Fraction(1, 3)]}}, "extra_state['frac']['lr'][1]", "fractions.Fraction"),
        ({"obj": _Opaque()}, "extra_state['obj']", f"{__name__}._Opaque"),
        ({"stats": NumpyStats()}, "extra_state['stats'].state_dict()['mean']", "fractions.Fraction"),
    ],
)
def test_value_load_would_refuse_is_refused_at_save_and_nothing_is_committed(tmp_path, extra, where, kind):
    if "stats" in extra:
        extra["stats"].mean = fractions.Fraction(1, 3)
    model = nn.Linear(2, 2)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None) as m:
        m.save(1)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None, extra_state=extra) as m:
        with pytest.raises(CheckpointSaveError) as err:
            m.save(2)
    assert f"{where}: a {kind} cannot be saved" in str(err.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no step-2, no staging left
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=nn.Linear(2, 2), optimizer=None) as m:
        assert m.load().step == 1


def test_a_value_of_a_checked_type_tree_skips_the_round_trip_and_other_types_are_still_refused(monkeypatch):
    from distckpt._ondisk import safe_values

    trips = []
    real = safe_values._loads
    monkeypatch.setattr(safe_values, "_loads", lambda v: trips.append(v) or real(v))
    monkeypatch.setattr(safe_values, "_LOADABLE", set())
    state = {"epoch": 1, "order": [3, 1, 2], "mean": np.float64(0.5), "hist": np.zeros(3)}
    safe_values.check_loadable(state, "dataloader")
    safe_values.check_loadable({**state, "epoch": 2, "order": [4, 5, 6], "mean": np.float64(0.7)}, "dataloader")
    assert len(trips) == 1  # the second value has the first's type tree: no torch.save + torch.load
    for bad, where in [
        ({**state, "mean": fractions.Fraction(1, 3)}, "['mean']"),
        ({**state, "hist": np.array([_Opaque()], dtype=object)}, "['hist']"),
    ]:
        with pytest.raises(TypeError, match=re.escape(f"dataloader{where}")):
            safe_values.check_loadable(bad, "dataloader")
