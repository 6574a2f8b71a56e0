"""Non-tensor values in a checkpoint: what distckpt reads with ``torch.load(weights_only=True)``.

torch's own allow-list (containers, primitives, tensors, torch types) plus numpy scalars and
arrays (``np.float64``, ``np.int64``, ``np.ndarray``, ...; any dtype, ``object`` arrays of the
same values), which training state often holds. The numpy constructors are admitted only while
distckpt reads (``torch.serialization.safe_globals``), never added to the process-wide list.
:func:`check_loadable` refuses at save a value that the read would refuse.
"""

from __future__ import annotations

import importlib
import io
from collections import OrderedDict
from collections.abc import Mapping
from typing import IO, Any

import numpy as np
import torch

__all__ = ["load_value", "check_loadable"]

_HINT = (
    "use containers, primitives, tensors and numpy scalars or arrays (convert the value, e.g. "
    "float(x) or x.tolist(), or keep it in an object whose state_dict() holds such values)"
)


def _numpy_globals() -> list[Any]:
    # numpy 2 pickles its constructors as numpy._core.multiarray.*, numpy 1 as numpy.core.*:
    # admit both names, so a checkpoint written under either loads under the other.
    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    out: list[Any] = [np.dtype, np.ndarray]
    # Unpickling a dtype sets the state of an instance of its class (numpy.dtypes.Float64DType, ...).
    kinds = set(np.sctypeDict.values()) | {np.str_, np.bytes_, np.object_, np.void, np.datetime64, np.timedelta64}
    out += sorted({type(np.dtype(kind)) for kind in kinds}, key=lambda t: t.__qualname__)
    for name in ("scalar", "_reconstruct"):
        out += [(getattr(multiarray, name), f"numpy.{package}.multiarray.{name}") for package in ("_core", "core")]
    return out


_NUMPY_GLOBALS = _numpy_globals()


def load_value(stream: IO[bytes]) -> Any:
    """``torch.load(stream, weights_only=True)`` that also admits numpy scalars and arrays.

    Raises:
        pickle.UnpicklingError: the value needs a type outside the allow-list.
    """
    with torch.serialization.safe_globals(_NUMPY_GLOBALS):
        return torch.load(stream, weights_only=True)


def check_loadable(value: Any, what: str) -> None:
    """Raise unless ``value`` survives ``torch.save`` + :func:`load_value` (tensors are not saved:
    they always load, and an EMA of a large model would be copied).

    Args:
        value: the value (containers are walked).
        what: its name in the error, e.g. ``extra_state['x']``.

    Raises:
        TypeError: names the offending key (``what`` plus the path in containers) and its type.
    """
    skeleton = _without_tensors(value)
    shape = _type_tree(skeleton)
    if shape is not None and shape in _LOADABLE:
        return
    if _loads(skeleton):
        if shape is not None:
            if len(_LOADABLE) >= _LOADABLE_MAX:
                _LOADABLE.clear()
            _LOADABLE.add(shape)
        return
    path, culprit = _find_unloadable(skeleton, "")
    kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}"
    raise TypeError(
        f"{what}{path}: a {kind} cannot be saved: load() reads plain values with "
        f"torch.load(weights_only=True), which refuses it; {_HINT}"
    )


# What the weights-only read admits depends on the types a value is made of, not on its values:
# a value with the type tree of one that loaded loads too, with no round trip (a memory-tier
# snapshot checks the data loader's and the scheduler's state at every step).
_LOADABLE: set[Any] = set()
_LOADABLE_MAX = 256
_LEAVES = frozenset((int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size))
_CONTAINERS = frozenset((dict, OrderedDict, list, tuple))


def _type_tree(value: Any) -> Any:
    """The nested types of ``value`` (hashable); ``None`` for any other type than plain
    containers, primitives, torch's dtype/device/Size and numpy scalars or non-object arrays."""
    kind = type(value)
    if kind in _LEAVES or (isinstance(value, np.generic) and not isinstance(value, np.object_)):
        return kind
    if kind is np.ndarray:
        return None if value.dtype.hasobject else (kind, value.dtype.str)
    if kind not in _CONTAINERS:
        return None
    if kind in (dict, OrderedDict):
        members = [(_type_tree(k), _type_tree(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in members):
            return None
    else:
        members = [_type_tree(v) for v in value]
        if None in members:
            return None
    return kind, tuple(members)


def _without_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return None
    if type(value) in (dict, list, tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out = {k: _without_tensors(v) for k, v in items}
        return out if isinstance(value, dict) else type(value)(out.values())
    return value


def _loads(value: Any) -> bool:
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        load_value(buf)
    except Exception:  # noqa: BLE001 - pickling or unpickling refused it: the caller reports where
        return False
    return True


def _find_unloadable(value: Any, path: str) -> tuple[str, Any]:
    """``(path, value)`` of the innermost part that does not load (``value`` itself when none of
    its members fails alone: a container type outside the allow-list)."""
    if isinstance(value, Mapping):
        members: Any = value.items()
    elif isinstance(value, (list, tuple, set, frozenset)):
        members = enumerate(value)
    else:
        return path, value
    for key, member in members:
        if not _loads(member):
            return _find_unloadable(member, f"{path}[{key!r}]")
    return path, value
