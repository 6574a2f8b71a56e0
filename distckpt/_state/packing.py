"""Small non-tensor values of the training state as ``bytes`` leaves of the DCP state_dict.

:func:`pack` serializes a value with ``torch.save`` (DCP then writes it as an opaque item, whatever
its inner structure) and :func:`unpack` reads it back with ``torch.load(weights_only=True)``.

A memory-tier snapshot takes these values on the training thread, where the next step would
change them, but packs them on its worker thread while that step runs (:class:`Packed`): the
``torch.save`` of the RNG state alone is a fifth of a millisecond.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch

from .._ondisk.safe_values import check_loadable, load_value

__all__ = ["Packed", "pack", "unpack", "take"]


def pack(obj: Any, what: str = "value", *, check: bool = True) -> bytes:
    """Serialize a value made of containers, primitives, tensors and numpy scalars or arrays
    (``torch.save``).

    Args:
        what: the value's name in the error.
        check: refuse what :func:`unpack` would refuse (``False`` for distckpt's own values).

    Raises:
        TypeError: a part :func:`unpack` would refuse (named by ``what`` and its path, with its type).
    """
    if check:
        check_loadable(obj, what)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`; never runs code (``weights_only=True``, numpy types admitted)."""
    return load_value(io.BytesIO(data))


class Packed:
    """A value taken now and packed later (:meth:`bytes`, equal to :func:`pack` of it): a state_dict
    leaf that the memory tier's worker thread turns into :func:`pack`'s bytes."""

    __slots__ = ("value", "what")

    def __init__(self, value: Any, what: str) -> None:
        self.value, self.what = value, what

    def bytes(self) -> bytes:
        """:func:`pack` of the value taken."""
        return pack(self.value, self.what, check=False)


def take(obj: Any, what: str = "value", *, check: bool = True, fresh: bool = False) -> Packed:
    """:func:`pack`'s check now, its serialization later: a :class:`Packed` of ``obj``, deep-copied
    unless ``fresh`` (an object built for this call and referenced by nothing else, such as the
    RNG state: a state_dict() of the caller's object may share its lists and dicts, which the next
    step changes).

    Raises:
        TypeError: as :func:`pack` with ``check``.
    """
    if check:
        check_loadable(obj, what)
    return Packed(obj if fresh else copy.deepcopy(obj), what)
