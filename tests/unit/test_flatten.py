"""distckpt's flatten_state_dict: DCP's keys, order, paths and errors, in one walk."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

from distckpt._engine.torch_format.flatten import flatten_state_dict


def _optimizer_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


CASES = {
    "model and optimizer": _optimizer_state,
    "nesting": lambda: {
        "a": {"b": {"c": torch.ones(2)}, 3: torch.zeros(1), "n": None},
        "lists": [torch.ones(1), [1, 2], [torch.zeros(2), {"x": 1}], (torch.ones(3), 4)],
        "plain list": [1, 2.5, "s", None, (1, 2)],
        "nested plain": [[1, 2], [3, [4]]],
        "dicts in list": [{"k": 1}, {"k": torch.ones(1)}],
        "empty": {},
        "empty list": [],
        "bytes": b"\x00\x01",
        "tuple": (torch.ones(2), torch.zeros(2)),
        "ordered": OrderedDict(z=1, a=torch.ones(1)),
        7: "an int key",
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_equal_to_dcps_flattening(name: str) -> None:
    state = CASES[name]()
    flat, mappings = flatten_state_dict(state)
    want_flat, want_mappings = dcp_flatten(state)
    assert list(flat) == list(want_flat) and mappings == want_mappings
    assert all(flat[k] is want_flat[k] for k in flat)


def test_a_duplicated_key_is_refused_as_dcp_does() -> None:
    state = {"a.b": 1, "a": {"b": 2}}
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        dcp_flatten(state)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_state_dict(state)


def test_the_flat_state_dict_is_freed_without_the_cyclic_gc() -> None:
    # Loads pause the GC: a reference cycle would keep every loaded batch's tensors alive.
    import gc
    import weakref

    tensor = torch.ones(4)
    ref = weakref.ref(tensor)
    state = {"a": {"b": [tensor, 1]}}
    gc.disable()
    try:
        flat, mappings = flatten_state_dict(state)
        assert flat == {"a.b.0": tensor, "a.b.1": 1}
        del flat, mappings, state, tensor
        assert ref() is None
    finally:
        gc.enable()
