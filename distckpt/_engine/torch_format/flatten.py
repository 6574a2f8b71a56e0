"""DCP's flattening of a nested state_dict, in one walk with the common case first.

``torch.distributed.checkpoint``'s ``flatten_state_dict`` turns ``{"optim": {"state": {fqn:
{"exp_avg": t}}}}`` into ``{"optim.state.<fqn>.exp_avg": t}`` (the keys its metadata holds) and
records each key's object path. Its generic traversal costs microseconds per value (abstract
``Mapping`` checks, a terminal test of every value, a path join), which a load or save of many
small tensors pays several times (the load target's key check, the planner's set-up).
:func:`flatten_state_dict` gives the same result -- keys, order, paths, the duplicate-key
``ValueError`` -- testing for a tensor first; under DCP's torch 2.3 traversal (set while a
checkpoint of that version loads) it calls DCP's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .internals import dcp_version
from .internals import flatten_state_dict as dcp_flatten_state_dict

__all__ = ["flatten_state_dict"]


def _terminal_list(values: list[Any]) -> bool:
    """DCP's ``_is_terminal`` of a list: no tensor, mapping or non-terminal list inside."""
    for entry in values:
        if isinstance(entry, torch.Tensor) or isinstance(entry, Mapping):
            return False
        if isinstance(entry, list) and not _terminal_list(entry):
            return False
    return True


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """``(flat state_dict, {flat key: object path})``, equal to DCP's ``flatten_state_dict``.

    Raises:
        ValueError: two paths give the same flat key (as DCP).
    """
    if dcp_version._derived_version == "2_3":
        return dcp_flatten_state_dict(state_dict)
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}
    for k, v in state_dict.items():
        name = str(k)
        _walk(flat, mappings, (name,), name, v)
    return flat, mappings


def _walk(flat: dict[str, Any], mappings: dict[str, Any], path: tuple[str | int, ...], key: str, value: Any) -> None:
    # A module-level function, not a closure: a recursive closure is a reference cycle that would
    # keep ``flat`` (and its tensors) alive until the cyclic GC runs, which loads pause.
    if not isinstance(value, torch.Tensor):
        if isinstance(value, Mapping):
            for k, v in value.items():
                name = str(k)
                _walk(flat, mappings, path + (name,), f"{key}.{name}", v)
            return
        if isinstance(value, list) and not _terminal_list(value):
            for i, v in enumerate(value):
                _walk(flat, mappings, path + (i,), f"{key}.{i}", v)
            return
    if key in flat:
        raise ValueError(f"duplicated flatten key {key}")
    flat[key] = value
    mappings[key] = path
