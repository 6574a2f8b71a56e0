"""Data-loading pieces whose position is part of a checkpoint."""

from .sampler import (
    ReshardableSampler,
    check_world_size,
    epoch_seed,
    global_state_from_loader_state,
    make_stateful_dataloader,
)
from .workers import SigtermSafeWorkerInit

__all__ = [
    "SigtermSafeWorkerInit",
    "ReshardableSampler",
    "check_world_size",
    "epoch_seed",
    "global_state_from_loader_state",
    "make_stateful_dataloader",
]
