"""Load targets of the ``Stateful`` objects in ``extra_state``, completed from the checkpoint.

DCP reads only the keys of the target it is given, and the target of a ``Stateful`` is the
fresh object's ``state_dict()``: an EMA whose ``shadow`` fills at its first update offers no
shadow keys, so the saved ones would never be read. :func:`with_saved_keys` adds every key the
checkpoint's DCP metadata lists under the object's name (``planner_data``: each flattened key's
path in the saved nested dict).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._engine.torch_format.flatten import flatten_state_dict

__all__ = ["with_saved_keys", "with_saved_optim_keys", "as_saved", "without_empty_dicts", "put_empty_dicts"]


def with_saved_keys(
    target: dict[str, Any], prefix: tuple[str, ...], metadata: Any, device: torch.device
) -> dict[str, Any]:
    """``target`` with a placeholder for each item the checkpoint holds under ``prefix`` and
    ``target`` lacks: an empty tensor of the saved (global) shape and dtype on ``device``, ``b""``
    for another value. Containers are copied first: the live object's own stay as they are.

    Args:
        target: a ``Stateful``'s fresh ``state_dict()``.
        prefix: its path in the checkpoint's state_dict, e.g. ``("extra", "ema")``.
        metadata: the checkpoint's DCP ``Metadata``; without ``planner_data`` nothing is added
            (the caller reports the saved keys left unread).
        device: where the added tensors are allocated.

    Returns:
        ``target`` itself when nothing is missing, else a completed copy.
    """
    have = {".".join(prefix + (k,)) for k in flatten_state_dict(target)[0]}
    saved = {
        k: path
        for k, path in (metadata.planner_data or {}).items()
        if tuple(path[: len(prefix)]) == prefix and k not in have and len(path) > len(prefix)
    }
    if not saved:
        return target
    return _add_saved(_copy_containers(target), saved, len(prefix), metadata, device)


def with_saved_optim_keys(optim_sd: dict[str, Any], metadata: Any, device: torch.device) -> None:
    """Complete DCP's optimizer load target in place with the items the checkpoint holds under
    its param groups and under the state of the target's parameters that the target lacks: keys
    added to a group during training (a layer-wise ``lr_scale``), state a fresh initialisation
    does not set (LBFGS's history). Groups and parameters the target lacks get nothing (the
    caller reports them). Changed containers are copied: the live optimizer's stay as they are.

    Args:
        optim_sd: ``{"state": {fqn: {...}}, "param_groups": [{...}]}`` saved under ``optim``.
        metadata: the checkpoint's DCP ``Metadata``; without ``planner_data`` nothing is added.
        device: where the added tensors are allocated.
    """
    have = set(flatten_state_dict({"optim": optim_sd})[0])
    state, groups = optim_sd.get("state", {}), optim_sd.get("param_groups", [])
    missing: dict[tuple[str, Any], dict[str, Any]] = {}
    for key, path in (metadata.planner_data or {}).items():  # one pass: a large model has many keys
        if key in have or len(path) < 4 or path[0] != "optim":
            continue
        if path[1] == "param_groups" and isinstance(path[2], int) and path[2] < len(groups):
            missing.setdefault(("param_groups", path[2]), {})[key] = path
        elif path[1] == "state" and path[2] in state:
            missing.setdefault(("state", path[2]), {})[key] = path
    for (part, name), saved in missing.items():
        owner: Any = optim_sd[part]
        owner[name] = _add_saved(_copy_containers(owner[name]), saved, 3, metadata, device)


def as_saved(live: Any, prefix: tuple[str, ...], metadata: Any, device: torch.device) -> Any:
    """A load target shaped as the value the checkpoint holds under ``prefix`` (a module's
    ``_extra_state``: its tensors may have grown, its dict gained or lost keys since the fresh
    module was built): placeholders as in :func:`with_saved_keys`, none of ``live``'s own.

    Args:
        live: the live value (a tensor, a dict, another value); returned when the checkpoint
            holds nothing under ``prefix`` or its paths are unknown (no ``planner_data``): the
            caller's key check then names what is missing.
        prefix: the value's path, e.g. ``("model", "0._extra_state")``.
        metadata: the checkpoint's DCP ``Metadata``.
        device: where tensors are allocated when ``live`` is not a tensor.
    """
    md = metadata.state_dict_metadata.get(".".join(prefix))
    if md is not None:  # saved as one item
        if isinstance(live, torch.Tensor):
            device = live.device
        return _placeholder(md, device)
    saved = {
        k: path
        for k, path in (metadata.planner_data or {}).items()
        if tuple(path[: len(prefix)]) == prefix and len(path) > len(prefix)
    }
    if not saved:
        return live
    root: Any = [] if isinstance(next(iter(saved.values()))[len(prefix)], int) else {}
    return _add_saved(root, saved, len(prefix), metadata, device)


def _add_saved(target: Any, saved: dict[str, Any], start: int, metadata: Any, device: torch.device) -> Any:
    """``target`` with a placeholder at each saved ``{key: path}``, ``path[start:]`` below it."""
    for key, path in saved.items():
        node: Any = target
        for part, after in zip(path[start:-1], path[start + 1 :]):
            node = _child(node, part, [] if isinstance(after, int) else {})
        _child(node, path[-1], _placeholder(metadata.state_dict_metadata[key], device))
    return target


def _placeholder(md: Any, device: torch.device) -> Any:
    """An empty tensor of the saved global shape and dtype, or ``b""`` for another value."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype, device=device)
    return b""


def _child(node: Any, part: str | int, default: Any) -> Any:
    """``node[part]``, set to ``default`` first when absent or an empty dict (a list grows);
    ``None`` when ``node`` is not a container of that kind: the key stays unread and is reported."""
    if isinstance(node, list) and isinstance(part, int):
        node.extend([None] * (part + 1 - len(node)))
        if node[part] is None:
            node[part] = default
        return node[part]
    if isinstance(node, dict) and isinstance(part, str):
        if isinstance(node.get(part), Mapping) and not node[part] and not isinstance(default, (dict, list)):
            node[part] = default  # a leaf saved where the live state has an empty dict
        return node.setdefault(part, default)
    return None


def _copy_containers(value: Any) -> Any:
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps an OrderedDict's class and _metadata (nn.Module.state_dict)
        out.update((k, _copy_containers(v)) for k, v in value.items())
        return out
    return [_copy_containers(v) for v in value] if isinstance(value, list) else value


def without_empty_dicts(state: Any, what: str) -> tuple[Any, list[tuple[str | int, ...]]]:
    """A ``Stateful``'s state with ``None`` in place of each empty dict DCP's flattening would
    drop (it saves leaves only: ``{"shadow": {}}`` would come back as ``{}``, ``[1, {}, t]`` as
    ``[1, t]``), and their paths; :func:`put_empty_dicts` puts them back after the load. Walks
    as DCP's ``traverse_state_dict`` does: every mapping, and a list only when it holds a tensor,
    a mapping or such a list (others are saved whole).

    Args:
        state: the ``state_dict()`` of a ``Stateful``.
        what: its name in the error, e.g. ``extra_state['ema'].state_dict()``.

    Returns:
        ``(state, [])`` when it has none, else a copy (containers only) and the paths.

    Raises:
        TypeError: a dict key that is not a ``str`` (DCP saves it as ``str(key)``: an ``int`` key
            would come back as a string), named by its path.
    """
    paths: list[tuple[str | int, ...]] = []

    def walk(value: Any, path: tuple[str | int, ...]) -> None:
        if isinstance(value, Mapping):
            if not value and path:
                paths.append(path)
            for key, member in value.items():
                if not isinstance(key, str):
                    where = "".join(f"[{p!r}]" for p in path)
                    raise TypeError(
                        f"{what}{where}: dict key {key!r} ({type(key).__name__}) cannot be saved: DCP stores "
                        "dict keys as strings, so it would load as a str key; use str keys, or keep the dict "
                        "inside a tuple (saved whole)"
                    )
                walk(member, path + (key,))
        elif isinstance(value, list) and not _saved_whole(value):
            for index, member in enumerate(value):
                walk(member, path + (index,))

    walk(state, ())
    if not paths:
        return state, paths
    state = _copy_containers(state)
    for path in paths:  # a leaf DCP saves, so the containers above it and list positions stay
        _set(state, path, None)
    return state, paths


def _saved_whole(value: list) -> bool:
    """DCP's ``_is_terminal`` for a list: no tensor, no mapping, no list that is not saved whole."""
    return not any(
        isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and not _saved_whole(v)) for v in value
    )


def put_empty_dicts(state: Any, paths: list[tuple[str | int, ...]]) -> None:
    """Put an empty dict back at each of ``paths`` (from :func:`without_empty_dicts`) of a
    loaded ``state``."""
    for path in paths:
        _set(state, path, {})


def _set(state: Any, path: tuple[str | int, ...], value: Any) -> None:
    """``state[path[0]][path[1]]... = value`` where that place exists (else nothing)."""
    node: Any = state
    parent: Any = None
    for part in path:
        if isinstance(node, dict) and isinstance(part, str):
            parent, node = node, node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            parent, node = node, node[part]
        else:
            return
    parent[path[-1]] = value
