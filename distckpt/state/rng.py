"""Per-rank RNG state of every source: python ``random``, numpy's global RNG, torch CPU and
every CUDA device (when CUDA is available)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "derive_rng"]


def capture_rng() -> dict[str, Any]:
    """Snapshot of this process's RNG state, made of types ``torch.load(weights_only=True)``
    accepts (tuples, lists, ints, floats, tensors)."""
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
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore a :func:`capture_rng` snapshot. CUDA states are restored for as many devices as
    both the snapshot and this process have."""
    random.setstate(_as_python_state(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        n = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:n])


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
