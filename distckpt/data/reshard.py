"""Per-rank dataloader state, and its reconstruction on a world-size change (DESIGN section 6).

Same world size: each rank saves and restores its own ``StatefulDataLoader.state_dict()``.
Different world size: the old per-rank states are not used; the position is rebuilt from the
global sampler state ``(seed, epoch, global samples consumed, global batch size)`` saved by
rank 0, which :class:`~distckpt.data.ReshardableSampler` can load at any world size.
"""

from __future__ import annotations

from typing import Any

from ..errors import IncompatibleCheckpointError
from .sampler import ReshardableSampler, global_state_from_loader_state

__all__ = ["DataLoaderState"]


class DataLoaderState:
    """Adapter between a ``StatefulDataLoader`` (or anything with ``state_dict`` /
    ``load_state_dict``) and the checkpoint."""

    def __init__(self, dataloader: Any) -> None:
        for name in ("state_dict", "load_state_dict"):
            if not callable(getattr(dataloader, name, None)):
                raise TypeError(
                    f"dataloader of type {type(dataloader).__name__} has no {name}(); use "
                    "torchdata.stateful_dataloader.StatefulDataLoader")
        self.dataloader = dataloader

    def sampler(self) -> ReshardableSampler | None:
        """The loader's :class:`ReshardableSampler`, if it uses one."""
        for candidate in (getattr(self.dataloader, "sampler", None),
                          getattr(getattr(self.dataloader, "batch_sampler", None), "sampler", None)):
            if isinstance(candidate, ReshardableSampler):
                return candidate
        return None

    def local_state(self) -> dict[str, Any]:
        """This rank's loader state (``StatefulDataLoader.state_dict()``)."""
        return self.dataloader.state_dict()

    def load_local_state(self, state: dict[str, Any]) -> None:
        self.dataloader.load_state_dict(state)
        self._materialize_iterator()

    def _materialize_iterator(self) -> None:
        # Creating a StatefulDataLoader iterator draws its base seed from the global torch RNG.
        # Create it now, before the RNG state is restored, so the draw does not shift dropout
        # masks after the resume; state_dict() caches it for the next iter(loader).
        self.dataloader.state_dict()

    def global_state(self) -> dict[str, Any] | None:
        """World-size independent position, or ``None`` if the sampler is not reshardable."""
        sampler = self.sampler()
        if sampler is None:
            return None
        return global_state_from_loader_state(self.dataloader.state_dict())

    def load_global_state(self, state: dict[str, Any] | None, *, rank: int, world_size: int) -> None:
        """Position this rank's loader from the global state after a world-size change.

        Raises:
            IncompatibleCheckpointError: the loader has no ReshardableSampler or none was saved.
            ValueError: the global batch size is not divisible by the new world size.
        """
        sampler = self.sampler()
        if sampler is None or state is None:
            raise IncompatibleCheckpointError(
                f"rank {rank}: the world size changed but the dataloader position cannot be "
                "resharded: build the loader on distckpt.data.ReshardableSampler (in the saving "
                "and in the resuming run), or pass dataloader=None and reposition it yourself")
        self.dataloader.load_state_dict({})  # drop any iterator made at the old position
        sampler.load_state_dict(state)
        self._materialize_iterator()
