"""Data-loading pieces whose position is part of a checkpoint."""

from distckpt.data.sampler import (
    ReshardableSampler,
    check_world_size,
    epoch_seed,
    global_state_from_loader_state,
    make_stateful_dataloader,
)
from distckpt.data.workers import SigtermSafeWorkerInit, ignore_sigterm_in_worker

__all__ = [
    "SigtermSafeWorkerInit",
    "ignore_sigterm_in_worker",
    "ReshardableSampler",
    "check_world_size",
    "epoch_seed",
    "global_state_from_loader_state",
    "make_stateful_dataloader",
]
