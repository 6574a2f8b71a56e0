"""ReusingStager: later saves copy into the first save's staged tensors, and stay exact."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import StagingOptions

from distckpt._engine.staging import ReusingStager

pytestmark = pytest.mark.timeout(60)


def _options(background: bool = False) -> StagingOptions:
    return StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=background, use_non_blocking_copy=False
    )


def _source() -> dict:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "model": {"w": w, "tied": w, "b": torch.ones(4, dtype=torch.bfloat16)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.full((3, 4), 0.5)}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
        "rng": torch.get_rng_state(),
        "step": 3,
        "tag": "x",
        "pair": (1, torch.zeros(2)),
    }


def _fresh_view(sd: dict) -> dict:
    """What the next ``get_state_dict`` hands over: new containers around the same tensors."""
    return {k: (_fresh_view(v) if isinstance(v, dict) else v) for k, v in sd.items()}


def _stage(stager: ReusingStager, sd: dict) -> dict:
    out = stager.stage(sd)
    return out.result() if hasattr(out, "result") else out


def _assert_equal(staged, source) -> None:
    if isinstance(source, torch.Tensor):
        assert staged.dtype == source.dtype and torch.equal(staged, source)
        assert staged.data_ptr() != source.data_ptr()  # a copy, never the training tensor
    elif isinstance(source, dict):
        assert staged.keys() == source.keys()
        for k in source:
            _assert_equal(staged[k], source[k])
    elif isinstance(source, (list, tuple)):
        assert type(staged) is type(source) and len(staged) == len(source)
        for a, b in zip(staged, source):
            _assert_equal(a, b)
    else:
        assert staged == source


@pytest.mark.parametrize("background", [False, True])
def test_second_save_copies_into_the_first_saves_tensors(background):
    stager = ReusingStager(_options(background))
    src = _source()
    first = _stage(stager, src)
    _assert_equal(first, src)
    with torch.no_grad():  # the optimizer step between two saves
        src["model"]["w"].mul_(2)
        src["optim"]["state"]["w"]["exp_avg"].add_(1)
    src["step"], src["rng"] = 4, torch.get_rng_state()
    second = _stage(stager, _fresh_view(src))
    _assert_equal(second, src)
    assert stager.reused_saves == 1
    assert second["model"]["w"] is first["model"]["w"]
    assert second["optim"]["state"]["w"]["exp_avg"] is first["optim"]["state"]["w"]["exp_avg"]
    assert second["model"]["tied"].data_ptr() == second["model"]["w"].data_ptr()  # still one buffer
    stager.close()


def test_staged_copy_is_isolated_from_later_updates():
    stager = ReusingStager(_options())
    src = _source()
    _stage(stager, src)
    staged = _stage(stager, _fresh_view(src))
    before = staged["model"]["w"].clone()
    with torch.no_grad():
        src["model"]["w"].add_(100)
    src["optim"]["param_groups"][0]["lr"] = 0.5
    assert torch.equal(staged["model"]["w"], before)
    assert staged["optim"]["param_groups"][0]["lr"] == 0.1  # non-tensor leaves are copies too
    stager.close()


@pytest.mark.parametrize("change", ["new_key", "new_shape", "new_dtype"])
def test_a_changed_structure_is_staged_again_exactly(change):
    stager = ReusingStager(_options())
    src = _source()
    _stage(stager, src)
    src = _fresh_view(src)
    if change == "new_key":
        src["model"]["extra"] = torch.randn(5)
    elif change == "new_shape":
        src["model"]["w"] = torch.randn(4, 4)
    else:
        src["model"]["b"] = torch.ones(4, dtype=torch.float32)
    staged = _stage(stager, src)
    _assert_equal(staged, src)
    assert stager.reused_saves == 0
    again = _stage(stager, _fresh_view(src))  # the new structure is remembered
    _assert_equal(again, src)
    assert stager.reused_saves == 1
    stager.close()


def test_an_object_holding_tensors_is_left_to_default_stager():
    class Box:
        def __init__(self) -> None:
            self.t = torch.arange(3.0)

    stager = ReusingStager(_options())
    src = {"w": torch.ones(2), "box": Box()}
    _stage(stager, src)
    src["box"].t.add_(1)
    staged = _stage(stager, dict(src))
    assert torch.equal(staged["box"].t, torch.arange(3.0) + 1) and staged["box"].t is not src["box"].t
    assert stager.reused_saves == 0
    stager.close()


def test_ordered_dicts_keep_their_type_and_named_tuples_are_staged_by_dcp():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    stager = ReusingStager(_options())
    src = {"model": OrderedDict(w=torch.ones(3)), "pair": Pair(1, torch.zeros(2))}
    _stage(stager, src)
    src = {"model": OrderedDict(w=src["model"]["w"] * 2), "pair": src["pair"]}
    staged = _stage(stager, src)
    assert type(staged["model"]) is OrderedDict and torch.equal(staged["model"]["w"], torch.full((3,), 2.0))
    assert type(staged["pair"]) is Pair and torch.equal(staged["pair"].b, torch.zeros(2))


@pytest.mark.parametrize("background", [False, True])
def test_weights_tied_at_the_first_save_and_untied_later_keep_their_own_values(background):
    stager = ReusingStager(_options(background))
    shared = torch.arange(6.0)
    _stage(stager, {"emb": shared, "head": shared})  # one staged buffer for both keys
    for offset in (10.0, 30.0):  # untied: two sources; the second save of them may reuse
        src = {"emb": torch.arange(6.0) + offset, "head": torch.arange(6.0) - offset}
        staged = _stage(stager, src)
        _assert_equal(staged, src)
        assert staged["emb"].data_ptr() != staged["head"].data_ptr()
    stager.close()


def test_a_key_removed_then_added_back_is_staged_with_its_values():
    stager = ReusingStager(_options())
    _stage(stager, {"w": torch.ones(3), "scale": torch.ones(4)})
    _stage(stager, {"w": torch.ones(3) * 2})  # the buffer goes (reused: the rest is unchanged)
    assert stager.reused_saves == 1
    src = {"w": torch.ones(3) * 3, "scale": torch.full((4,), 7.0)}
    staged = _stage(stager, src)
    _assert_equal(staged, src)
    stager.close()
