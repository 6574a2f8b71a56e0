"""Load targets of the ``Stateful`` objects in ``extra_state``, completed from the checkpoint.

DCP reads only the keys of the target it is given, and the target of a ``Stateful`` is the
fresh object's ``state_dict()``: an EMA whose ``shadow`` fills at its first update offers no
shadow keys, so the saved ones would never be read. :func:`with_saved_keys` adds every key the
checkpoint's DCP metadata lists under the object's name (``planner_data``: each flattened key's
path in the saved nested dict).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..engine.torch_internals import flatten_state_dict

__all__ = ["with_saved_keys"]


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
    target = _copy_containers(target)
    for key, path in saved.items():
        node: Any = target
        for part, after in zip(path[len(prefix) : -1], path[len(prefix) + 1 :]):
            node = _child(node, part, [] if isinstance(after, int) else {})
        md = metadata.state_dict_metadata[key]
        _child(
            node,
            path[-1],
            torch.empty(md.size, dtype=md.properties.dtype, device=device)
            if isinstance(md, TensorStorageMetadata)
            else b"",
        )
    return target


def _child(node: Any, part: str | int, default: Any) -> Any:
    """``node[part]``, set to ``default`` first when absent (a list grows); ``None`` when
    ``node`` is not a container of that kind: the key stays unread and is reported."""
    if isinstance(node, list) and isinstance(part, int):
        node.extend([None] * (part + 1 - len(node)))
        if node[part] is None:
            node[part] = default
        return node[part]
    if isinstance(node, dict) and isinstance(part, str):
        return node.setdefault(part, default)
    return None


def _copy_containers(value: Any) -> Any:
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps an OrderedDict's class and _metadata (nn.Module.state_dict)
        out.update((k, _copy_containers(v)) for k, v in value.items())
        return out
    return [_copy_containers(v) for v in value] if isinstance(value, list) else value
