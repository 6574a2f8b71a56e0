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

from .._errors import DistCkptError
from .._ondisk.safe_values import check_loadable, load_value

__all__ = ["PackError", "Packed", "pack", "unpack", "take"]


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


class PackError(DistCkptError, TypeError):
    """A value taken at a memory-tier snapshot could not be serialized on the worker thread (it
    passed :func:`pack`'s check but ``torch.save`` refused it); the tier raises it on the training
    thread at the next snapshot. The message names the value (its state_dict path)."""


class Packed:
    """A value taken now and packed later (:meth:`bytes`, equal to :func:`pack` of it): a state_dict
    leaf that the memory tier's worker thread turns into :func:`pack`'s bytes."""

    __slots__ = ("value", "what")

    def __init__(self, value: Any, what: str) -> None:
        self.value, self.what = value, what

    def bytes(self) -> bytes:
        """:func:`pack` of the value taken.

        Raises:
            PackError: ``torch.save`` refused it (names the value).
        """
        try:
            return pack(self.value, self.what, check=False)
        except Exception as e:
            raise PackError(f"{self.what}: cannot be saved: {type(e).__name__}: {e}") from e


def take(obj: Any, what: str = "value", *, check: bool = True, fresh: bool = False) -> Packed | bytes:
    """:func:`pack`'s check now, its serialization later: a :class:`Packed` of ``obj``, deep-copied
    unless ``fresh`` (an object built for this call and referenced by nothing else, such as the
    RNG state: a state_dict() of the caller's object may share its lists and dicts, which the next
    step changes). A value ``copy.deepcopy`` refuses (a tensor with a ``grad_fn``) is packed now.

    Raises:
        TypeError: as :func:`pack` with ``check``.
    """
    if check:
        check_loadable(obj, what)
    if fresh:
        return Packed(obj, what)
    try:
        return Packed(copy.deepcopy(obj), what)
    except Exception:  # noqa: BLE001 - torch.save may still take it, and raises if not
        return pack(obj, what, check=False)
