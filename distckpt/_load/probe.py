"""The loss probe: one fixed forward pass whose loss, recorded at each save and measured again
after ``load()``, proves that a resume restored what the model computes with.

The probe is the user's ``probe(model) -> loss`` (a fixed batch; see docs/resume.md, "Resume options").
:func:`run_probe` calls it so that it can never change the training trajectory: every module in
eval mode, no autograd, and every RNG (python, numpy, torch CPU, every CUDA device) restored
afterwards, as is each module's train/eval mode.
"""

from __future__ import annotations

import math
from typing import Callable, Union

import torch
from torch import nn

from .._state.rng import capture_rng, restore_rng

__all__ = ["ProbeFn", "run_probe", "relative_difference"]

ProbeFn = Callable[[nn.Module], Union[float, torch.Tensor]]
"""``probe(model) -> loss``: a float or a one-element tensor, the same on every rank."""


def run_probe(probe: ProbeFn, model: nn.Module) -> float:
    """``probe(model)`` in eval mode under ``torch.no_grad()``, leaving no trace.

    Every module's ``training`` flag and the RNG state of every source are restored after the
    call, also when it raises. Collective when the model is (FSDP): call it on every rank.

    Returns:
        The loss as a Python float.

    Raises:
        TypeError: the probe returned something that is not a number or a one-element tensor.
        Whatever the probe raises.
    """
    modes = [(m, m.training) for m in model.modules()]
    rng = capture_rng(every_device=True)  # restored by this process: every device by index
    try:
        model.eval()
        with torch.no_grad():
            value = probe(model)
    finally:
        for module, training in modes:
            module.training = training
        restore_rng(rng)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float().cpu().item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"the probe returned {type(value).__name__}; expected a float or a one-element tensor (the loss)")


def relative_difference(saved: float, loaded: float) -> float:
    """``|loaded - saved| / |saved|`` (absolute when ``saved`` is 0; ``inf`` when either is
    not finite, unless both are the same value)."""
    if not (math.isfinite(saved) and math.isfinite(loaded)):
        return 0.0 if saved == loaded else math.inf
    return abs(loaded - saved) / (abs(saved) if saved != 0 else 1.0)
