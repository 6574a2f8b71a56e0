"""SafeLoadPlanner's whole-tensor load plan: DCP's own plan, built without its chunk-overlap search."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

from distckpt._engine.safe_io import SafeLoadPlanner, whole_tensor_load_plan


def _saved(tmp_path: Any, state: dict[str, Any]) -> Any:
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return dcp.FileSystemReader(str(tmp_path)).read_metadata()


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(3, 4),
        "b": torch.randn(4),
        "step": torch.tensor(5.0),
        "cube": torch.randn(2, 2, 2),
        "lr": 0.1,
        "empty": torch.zeros(0, 3),
    }


def test_the_whole_tensor_plan_is_dcps_plan(tmp_path: Any) -> None:
    metadata = _saved(tmp_path, _state())
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in _state().items()}
    plan = whole_tensor_load_plan(target, metadata)
    assert plan is not None and plan == create_default_local_load_plan(target, metadata)


def test_anything_but_whole_plain_tensors_under_the_same_keys_is_left_to_dcp(tmp_path: Any) -> None:
    metadata = _saved(tmp_path, _state())
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in _state().items()}
    assert whole_tensor_load_plan({k: v for k, v in target.items() if k != "b"}, metadata) is None  # partial
    assert whole_tensor_load_plan({**target, "extra": torch.zeros(1)}, metadata) is None
    assert whole_tensor_load_plan({**target, "w": torch.zeros(4, 3)}, metadata) is None  # size mismatch
    assert whole_tensor_load_plan({**target, "lr": torch.zeros(1)}, metadata) is None  # bytes saved, tensor asked


def test_a_load_through_the_planner_restores_every_value(tmp_path: Any) -> None:
    _saved(tmp_path, _state())
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in _state().items()}
    dcp.load(target, checkpoint_id=str(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    want = _state()
    assert target["lr"] == 0.1
    assert all(torch.equal(target[k], want[k]) for k in want if k != "lr")


def test_the_planner_set_up_is_dcps_and_a_meta_target_is_left_to_dcp(tmp_path: Any, monkeypatch: Any) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    metadata = _saved(tmp_path, {"model": _state()})
    target = {"model": {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in _state().items()}}
    lean, stock = SafeLoadPlanner(), DefaultLoadPlanner()
    lean.set_up_planner(target, metadata)
    stock.set_up_planner(target, metadata)
    assert lean.mappings == stock.mappings and lean.original_state_dict is stock.original_state_dict
    assert lean.state_dict.keys() == stock.state_dict.keys()
    assert all(lean.state_dict[k] is stock.state_dict[k] for k in lean.state_dict)
    assert lean.metadata is metadata and lean.is_coordinator is stock.is_coordinator is False
    assert lean.create_local_plan() == stock.create_local_plan()
    # DCP's own set-up runs where it would change something: a meta tensor to materialise.
    calls: list[int] = []
    monkeypatch.setattr(DefaultLoadPlanner, "set_up_planner", lambda self, *a, **k: calls.append(1))
    SafeLoadPlanner().set_up_planner(target, metadata)
    assert calls == []
    SafeLoadPlanner().set_up_planner({"model": dict(target["model"], w=torch.empty(3, 4, device="meta"))}, metadata)
    assert calls == [1]
