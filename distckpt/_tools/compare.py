"""Compare two checkpoints item by item, streaming (two batches in memory at a time)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .reader import CheckpointReader

__all__ = ["TensorDiff", "CheckpointDiff", "diff_checkpoints", "max_abs_diff"]

_CHUNK = 1 << 22  # elements per comparison step: bounds the float64 temporaries to ~32 MiB


@dataclass(kw_only=True)
class TensorDiff:
    """One key present in both checkpoints.

    Attributes:
        key: flattened key.
        shape_a, shape_b: global shapes (``None`` for non-tensor items).
        dtype_a, dtype_b: ``str(torch.dtype)`` (``None`` for non-tensor items).
        max_abs_diff: largest ``|a - b|`` over elements, in float64 (``inf`` where exactly one
            side is NaN); ``None`` when shapes differ or for non-tensor items.
        equal: same shape, dtype and values (NaN equals NaN); for objects, equal values.
    """

    key: str
    shape_a: list[int] | None
    shape_b: list[int] | None
    dtype_a: str | None
    dtype_b: str | None
    max_abs_diff: float | None
    equal: bool


@dataclass(kw_only=True)
class CheckpointDiff:
    """Result of :func:`diff_checkpoints`."""

    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    common: list[TensorDiff] = field(default_factory=list)

    @property
    def mismatched(self) -> list[TensorDiff]:
        """Common keys whose shape or dtype differ."""
        return [d for d in self.common if d.shape_a != d.shape_b or d.dtype_a != d.dtype_b]

    @property
    def identical(self) -> bool:
        """Whether both hold the same keys, each with equal values (:attr:`TensorDiff.equal`)."""
        return not self.only_a and not self.only_b and all(d.equal for d in self.common)

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (``distckpt diff --json``); ``mismatched`` lists keys only."""
        return {
            "identical": self.identical,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": [d.key for d in self.mismatched],
            "common": [asdict(d) for d in self.common],
        }


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over same-shaped tensors of any dtypes, in float64 chunks.

    NaN against NaN and equal infinities count as 0; NaN against a number counts as ``inf``.
    Returns 0.0 for empty tensors.
    """
    if a.dtype == b.dtype and torch.equal(a, b):
        return 0.0
    x, y = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, x.numel(), _CHUNK):
        xs, ys = x[start : start + _CHUNK].double(), y[start : start + _CHUNK].double()
        same = (xs == ys) | (xs.isnan() & ys.isnan())
        d = torch.where(same, torch.zeros((), dtype=torch.float64, device=xs.device), (xs - ys).abs())
        d = torch.nan_to_num(d, nan=math.inf)
        worst = max(worst, d.max().item() if d.numel() else 0.0)
    return worst


def _equal_objects(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values whose == is not a bool (arrays)
        return False


def diff_checkpoints(
    a: str | os.PathLike, b: str | os.PathLike, *, group: str | None = None, check_files: bool = True
) -> CheckpointDiff:
    """Keys only in ``a`` / only in ``b``, and for each common key shape, dtype and values.

    Args:
        a, b: checkpoint directories.
        group: compare only this group (see :data:`distckpt._tools.reader.GROUPS`).
        check_files: check data files against each manifest before reading them.

    Raises:
        CheckpointNotFoundError, CheckpointCorruptError: as :class:`CheckpointReader`.
    """
    ra = CheckpointReader(a, check_files=check_files)
    rb = CheckpointReader(b, check_files=check_files)
    ka, kb = set(ra.keys(group)), set(rb.keys(group))
    result = CheckpointDiff(only_a=sorted(ka - kb), only_b=sorted(kb - ka))
    common = sorted(ka & kb)
    readable = []
    for key in common:
        ia, ib = ra.items[key], rb.items[key]
        if ia.kind != ib.kind or ia.shape != ib.shape:
            result.common.append(
                TensorDiff(
                    key=key,
                    shape_a=ia.shape,
                    shape_b=ib.shape,
                    dtype_a=ia.dtype,
                    dtype_b=ib.dtype,
                    max_abs_diff=None,
                    equal=False,
                )
            )
        else:
            readable.append(key)
    for (key, va), (_, vb) in zip(ra.iter_read(readable), rb.iter_read(readable)):
        ia, ib = ra.items[key], rb.items[key]
        if isinstance(va, torch.Tensor):
            worst = max_abs_diff(va, vb)
            equal = worst == 0.0 and va.dtype == vb.dtype
        else:
            worst, equal = None, _equal_objects(va, vb)
        result.common.append(
            TensorDiff(
                key=key,
                shape_a=ia.shape,
                shape_b=ib.shape,
                dtype_a=ia.dtype,
                dtype_b=ib.dtype,
                max_abs_diff=worst,
                equal=equal,
            )
        )
        del va, vb
    result.common.sort(key=lambda d: d.key)
    return result
