"""distckpt/_engine/save_planner.py: DCP's global save plan reused while the local plans repeat,
and a compacted ``.metadata`` that stock ``dcp.load`` reads."""

from __future__ import annotations

import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from distckpt._engine.save_planner import CachingSavePlanner, compact_metadata


@pytest.fixture
def global_plans(monkeypatch):
    """Counts the global plans DCP's DefaultSavePlanner actually builds."""
    built: list[int] = []
    original = DefaultSavePlanner._create_global_plan

    def counting(self, all_plans):
        built.append(len(all_plans))
        return original(self, all_plans)

    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", counting)
    return built


def _state(dtype: torch.dtype) -> dict[str, object]:
    key = f"w{uuid.uuid4().hex}"  # a structure no other test cached
    torch.manual_seed(0)
    return {key: {f"t{i}": torch.randn(3, i + 1).to(dtype) for i in range(5)}, "step": 7}


def _save(state: dict[str, object], path) -> object:
    return dcp.save(state, checkpoint_id=str(path), planner=CachingSavePlanner(), no_dist=True)


def _stock_load(state: dict[str, object], path) -> dict[str, object]:
    key = next(k for k in state if k != "step")
    target = {key: {k: torch.zeros_like(v) for k, v in state[key].items()}, "step": 0}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def test_a_repeated_structure_reuses_the_global_plan_and_stock_dcp_reads_every_save(tmp_path, global_plans):
    state = _state(torch.float32)
    first = _save(state, tmp_path / "a")
    key = next(k for k in state if k != "step")
    state[key]["t0"].add_(1.0)  # new values, same structure
    second = _save(state, tmp_path / "b")
    assert global_plans == [1], "the second save reused the first one's global plan"
    # Each save's Metadata is its own: the second did not overwrite the first's storage_meta.
    assert str(first.storage_meta.checkpoint_id) == str(tmp_path / "a")
    assert str(second.storage_meta.checkpoint_id) == str(tmp_path / "b")
    assert first.state_dict_metadata == second.state_dict_metadata
    loaded = _stock_load(state, tmp_path / "b")
    assert loaded["step"] == 7
    for name, tensor in state[key].items():
        assert torch.equal(loaded[key][name], tensor)
    assert not torch.equal(_stock_load(state, tmp_path / "a")[key]["t0"], state[key]["t0"])


def test_a_dtype_change_with_the_same_keys_and_shapes_is_a_new_plan(tmp_path, global_plans):
    state = _state(torch.float32)
    _save(state, tmp_path / "a")
    key = next(k for k in state if k != "step")
    state[key] = {k: v.to(torch.bfloat16) for k, v in state[key].items()}
    metadata = _save(state, tmp_path / "b")
    assert global_plans == [1, 1]
    assert {md.properties.dtype for k, md in metadata.state_dict_metadata.items() if k != "step"} == {torch.bfloat16}
    loaded = _stock_load(state, tmp_path / "b")
    for name, tensor in state[key].items():
        assert loaded[key][name].dtype == torch.bfloat16 and torch.equal(loaded[key][name], tensor)


def test_compacted_metadata_pickles_smaller_and_unpickles_equal(tmp_path):
    state = {f"t{i}": torch.randn(4) for i in range(50)}
    metadata = dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)  # DCP's own planner
    plain = pickle.dumps(metadata)
    compact = pickle.dumps(compact_metadata(metadata))
    assert len(compact) < 0.8 * len(plain)
    assert pickle.loads(compact) == pickle.loads(plain)
    entries = list(metadata.state_dict_metadata.values())
    assert all(e.properties is entries[0].properties and e.size is entries[0].size for e in entries)


def _local_plan(state: dict[str, object]) -> object:
    planner = CachingSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return planner.create_local_plan()


def _dcp_local_plan(state: dict[str, object]) -> object:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return planner.create_local_plan()


def test_a_repeated_structure_reuses_the_local_plans_items_and_any_change_of_what_dcp_plans_from_is_a_miss():
    state = _state(torch.float32)
    key = next(k for k in state if k != "step")
    first = _local_plan(state)
    assert first == _dcp_local_plan(state)
    state[key]["t1"].mul_(3.0)  # values only
    state["step"] = 8  # a bytes item's value: not planned from
    again = _local_plan(state)
    assert again == _dcp_local_plan(state)
    assert all(a is b for a, b in zip(again.items, first.items)), (
        "the same items, so the coordinator compares identities"
    )
    changes = {
        "dtype": lambda t: t.double(),
        "shape": lambda t: t.reshape(-1),
        "requires_grad": lambda t: t.clone().requires_grad_(True),
    }
    for what, change in changes.items():
        changed = {key: dict(state[key], t2=change(state[key]["t2"])), "step": 8}
        plan = _local_plan(changed)
        assert plan == _dcp_local_plan(changed), what
        assert plan.items[2] is not first.items[2], what
    renamed = {key: {("u" + k if k == "t3" else k): v for k, v in state[key].items()}, "step": 8}
    assert _local_plan(renamed) == _dcp_local_plan(renamed)
    moved = {"other": state[key], "step": 8}  # the same flat keys under another nesting: new mappings
    plan = _local_plan(moved)
    assert plan == _dcp_local_plan(moved) and plan.planner_data == _dcp_local_plan(moved).planner_data
