"""Data loading whose position is part of a checkpoint (docs/usage.md, "Iterators and the data
position"): a torchdata ``StatefulDataLoader`` over a sampler that reshards its position when
the world size changes."""

from ._data import ReshardableSampler, SigtermSafeWorkerInit, make_stateful_dataloader

__all__ = ["ReshardableSampler", "SigtermSafeWorkerInit", "make_stateful_dataloader"]
