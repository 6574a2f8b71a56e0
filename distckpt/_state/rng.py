"""Per-rank RNG state of every source: python ``random``, numpy's global RNG, torch CPU and
the rank's CUDA device (when CUDA is available).

CUDA: only the current device's generator is saved (``"cuda_device"``) and it is restored onto
the current device at load, whatever that device's index: a rank's device may have another
index at resume (a per-rank ``CUDA_VISIBLE_DEVICES``, an elastic remap), so states keyed by
visible index would land on the wrong devices. Other devices a process touches are not saved.
Snapshots of distckpt before this layout (``"cuda"``: one state per visible index) are still
restored as they were saved, index by index.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "derive_rng"]


def capture_rng(every_device: bool = False) -> dict[str, Any]:
    """Snapshot of this process's RNG state, made of types ``torch.load(weights_only=True)``
    accepts (tuples, lists, ints, floats, tensors).

    Args:
        every_device: also every visible CUDA device's state by index (``"cuda"``), for a
            snapshot restored by this same process (its indices do not change); a checkpoint
            saves the current device's alone (module docstring).
    """
    legacy = np.random.get_state()
    # The global RNG is numpy's MT19937 RandomState, whose legacy state is always this 5-tuple.
    assert isinstance(legacy, tuple)
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
        if every_device:
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore a :func:`capture_rng` snapshot. Its CUDA state goes to this process's current
    device; per-index states (``"cuda"``: ``every_device``, or an older checkpoint's layout)
    to as many devices as both the snapshot and this process have, by index."""
    random.setstate(_as_python_state(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        n = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:n])
    elif torch.cuda.is_available() and "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], torch.cuda.current_device())


def derive_rng(seed: int, rank: int, step: int) -> int:
    """Seed every RNG source from ``(seed, rank, step)`` for a rank with no saved state.

    Returns:
        The derived 63-bit seed (first 8 bytes of sha256 of ``"seed:rank:step"``), for the log.
    """
    digest = hashlib.sha256(f"{seed}:{rank}:{step}".encode()).digest()
    derived = int.from_bytes(digest[:8], "little") >> 1
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # also seeds every CUDA device
    return derived


def _as_python_state(state: Any) -> tuple:
    # torch.save/load round-trips tuples as tuples, but be lenient with lists.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
