"""Per-rank dataloader state, and its reconstruction on a world-size change (docs/design.md, section 6).

Same world size and ``num_workers``: each rank saves and restores its own
``StatefulDataLoader.state_dict()``. Different world size or ``num_workers``: the old per-rank
state is not used; the position is rebuilt from the global sampler state ``(seed, epoch, global
samples consumed, global batch size)`` saved by rank 0, which
:class:`~distckpt.data.ReshardableSampler` can load at any world size.

RNG. Every new ``StatefulDataLoader`` iterator (torchdata 0.11, ``_BaseDataLoaderIter.__init__``)
draws its workers' base seed from the global torch RNG. A README-style loop (``for batch in
loader`` inside ``while step < total``) creates one when an epoch ends, right after the save at
the epoch's last step. The resume reproduces that: mid-epoch the restored iterator is created
before the RNG is restored (no draw after it), at an epoch end it is left for the next
``iter(loader)``, which then draws from the restored RNG as the uninterrupted run did.
"""

from __future__ import annotations

import logging
from typing import Any

from .._errors import ConfigError, IncompatibleCheckpointError
from .sampler import ReshardableSampler, global_state_from_loader_state
from .workers import protect_workers

__all__ = ["DataLoaderState"]

logger = logging.getLogger(__name__)


class DataLoaderState:
    """Adapter between a ``StatefulDataLoader`` (or anything with ``state_dict`` /
    ``load_state_dict``) and the checkpoint.

    It takes the loader over for the checkpoint: its workers outlive a launcher's SIGTERM
    (:func:`~distckpt._data.workers.protect_workers`) and a :class:`ReshardableSampler` is
    attached to it, so that a new iterator goes on from the last batch returned
    (:meth:`ReshardableSampler.attach_loader`).

    Args:
        dataloader: the training loader.
        rank: this rank, for error messages.

    Raises:
        TypeError: the loader has no ``state_dict``/``load_state_dict``.
        ConfigError: its worker processes already run unprotected (see ``protect_workers``).
    """

    def __init__(self, dataloader: Any, *, rank: int = 0) -> None:
        for name in ("state_dict", "load_state_dict"):
            if not callable(getattr(dataloader, name, None)):
                raise TypeError(
                    f"dataloader of type {type(dataloader).__name__} has no {name}(); use "
                    "torchdata.stateful_dataloader.StatefulDataLoader"
                )
        self.dataloader = dataloader
        protect_workers(dataloader, rank=rank)
        if (sampler := self.sampler()) is not None:
            sampler.attach_loader(dataloader)

    def sampler(self) -> ReshardableSampler | None:
        """The loader's :class:`ReshardableSampler`, if it uses one."""
        for candidate in (
            getattr(self.dataloader, "sampler", None),
            getattr(getattr(self.dataloader, "batch_sampler", None), "sampler", None),
        ):
            if isinstance(candidate, ReshardableSampler):
                return candidate
        return None

    def local_state(self) -> dict[str, Any]:
        """This rank's loader state (``StatefulDataLoader.state_dict()``)."""
        return self.dataloader.state_dict()

    def check_no_live_iterator(self, rank: int) -> None:
        """Refuse to load while an iterator handed out by ``iter(loader)`` is unfinished.

        ``load_state_dict`` only reaches iterators created after it: one the caller already
        holds would go on from where it was (epoch 0, batch 0 in a fresh process) and the next
        checkpoint would record that position. An iterator made by ``state_dict()`` and not yet
        handed out, or a finished one, is replaced by the load and is harmless.

        Raises:
            ConfigError: such an iterator exists.
        """
        it = getattr(self.dataloader, "_iterator", None)  # torchdata 0.11 StatefulDataLoader
        if (
            it is None
            or getattr(self.dataloader, "_initial_iter_for_state_dict", False)
            or getattr(it, "_finished", False)
        ):
            return
        raise ConfigError(
            f"rank {rank}: an iterator of the dataloader was created (iter(loader), next(iter(loader)) "
            "or a `for` loop over it) before CheckpointManager.load() and has not finished: it would "
            "not see the restored position and would yield from where it stood (epoch 0, batch 0 in "
            "a fresh process). Create iterators after load(): call manager.load() first, then "
            "iterate over the loader."
        )

    def restore(
        self,
        local: dict[str, Any] | None,
        global_: dict[str, Any] | None,
        *,
        rank: int,
        world_size: int,
        saved_world_size: int,
        batch_policy: str = "keep_global_batch",
    ) -> tuple[int, int] | None:
        """Position the loader from a checkpoint, before the RNG is restored.

        Args:
            local: this rank's saved loader state (``None``: the world size changed).
            global_: the global sampler state saved by rank 0 (``None`` if none was saved).
            batch_policy: ``CheckpointConfig.elastic.batch_policy``; ``"keep_local_batch"`` lets the
                global batch size differ from the saved one (position carried over in samples).

        Returns:
            ``(saved global batch, live global batch)`` when they differ, else ``None``.

        Raises:
            IncompatibleCheckpointError: the position must be rebuilt from the global state
                (world size or ``num_workers`` changed) and the loader has no
                ReshardableSampler or no global state was saved; or the global batch size
                changed and ``batch_policy`` is ``"keep_global_batch"``.
        """
        sampler = self.sampler()
        if sampler is not None and global_ is not None and global_["global_batch_size"] != sampler.global_batch_size:
            before, after = global_["global_batch_size"], sampler.global_batch_size
            if batch_policy != "keep_local_batch":
                raise IncompatibleCheckpointError(
                    f"rank {rank}: the checkpoint was saved with global batch {before} ({saved_world_size} "
                    f"ranks) and this run's ReshardableSampler has global batch {after} ({world_size} ranks). "
                    "Set batch_policy: keep_local_batch to carry the data position over in samples (and "
                    f"step_rule: keep | rescale for the step counter), or build the sampler with "
                    f"global_batch_size={before}"
                )
            self.load_global_state(global_, rank=rank, world_size=world_size, batch_policy=batch_policy)
            return before, after
        if local is not None:
            saved_workers = _saved_num_workers(local)
            workers = getattr(self.dataloader, "num_workers", None)
            if saved_workers is None or workers is None or saved_workers == workers:
                self.load_local_state(local)
                return None
            if self.sampler() is None or global_ is None:
                raise IncompatibleCheckpointError(
                    f"rank {rank}: the dataloader state was saved with num_workers={saved_workers} and "
                    f"this loader has num_workers={workers}; torchdata's StatefulDataLoader cannot load "
                    f"it. Resume with num_workers={saved_workers}, or build the loader on "
                    "distckpt.data.ReshardableSampler in the saving and the resuming run (the position "
                    "is then rebuilt exactly), or pass dataloader=None and reposition it yourself"
                )
            self.load_global_state(global_, rank=rank, world_size=world_size)
            logger.info(
                "rank %d: num_workers %d -> %d: dataloader position rebuilt from the global sampler state",
                rank,
                saved_workers,
                workers,
            )
            return None
        self.load_global_state(global_, rank=rank, world_size=world_size)
        logger.info(
            "rank %d: world size %d -> %d: dataloader position rebuilt from the global sampler state",
            rank,
            saved_world_size,
            world_size,
        )
        return None

    def load_local_state(self, state: dict[str, Any]) -> None:
        """Load this rank's saved loader state (same world size and ``num_workers``)."""
        sampler = self.sampler()
        position = _epoch_end_position(state) if sampler is not None else None
        if position is not None:
            # Saved at an epoch's last step: the uninterrupted loop's next iter(loader) makes a
            # new iterator (one RNG draw). Restore the ended one as finished so that the next
            # iter(loader) does the same, after the RNG restore.
            state = dict(state, _iterator_finished=True)
        self._shut_down_iterator()
        self.dataloader.load_state_dict(state)
        self._materialize_iterator()
        if position is not None:
            # Workers of the restored iterator prefetched into the next epoch; the new iterator
            # must start at its beginning.
            assert sampler is not None  # position is only set when there is a sampler
            sampler.load_state_dict(position)

    def _shut_down_iterator(self) -> None:
        # load_state_dict drops the loader's iterator. Left to the cyclic GC, its workers wait
        # 5 s each (MP_STATUS_CHECK_INTERVAL) for a shutdown message whose queue was already
        # finalized; shut them down while the queues are intact (torchdata 0.11 internals).
        shut_down = getattr(getattr(self.dataloader, "_iterator", None), "_shutdown_workers", None)
        if callable(shut_down):
            shut_down()

    def _materialize_iterator(self) -> None:
        # Creating a StatefulDataLoader iterator draws its base seed from the global torch RNG.
        # Create it now, before the RNG state is restored, so the draw does not shift dropout
        # masks after the resume; state_dict() caches it for the next iter(loader).
        self.dataloader.state_dict()

    def global_state(self, loader_state: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """World-size independent position (in ``loader_state``, the loader's ``state_dict()``, when
        given), or ``None`` if the sampler is not reshardable."""
        sampler = self.sampler()
        if sampler is None:
            return None
        return global_state_from_loader_state(self.dataloader.state_dict() if loader_state is None else loader_state)

    def counters(self, loader_state: dict[str, Any] | None = None) -> dict[str, int] | None:
        """``epoch``, ``batch_in_epoch`` and ``global_samples_seen`` of the consumed position
        (``samples_before_epoch`` counts the samples of earlier epochs, whatever their ``G``), or
        ``None`` without a ReshardableSampler. ``loader_state``: as :meth:`global_state`."""
        state = self.global_state(loader_state)
        if state is None:
            return None
        g = state["global_batch_size"]
        return {
            "epoch": state["epoch"],
            "batch_in_epoch": state["samples_consumed"] // g,
            "global_samples_seen": state["samples_before_epoch"] + state["samples_consumed"],
        }

    def load_global_state(
        self, state: dict[str, Any] | None, *, rank: int, world_size: int, batch_policy: str = "keep_global_batch"
    ) -> None:
        """Position this rank's loader from the global state (world size, ``num_workers`` or,
        with ``batch_policy="keep_local_batch"``, global batch size changed).

        Raises:
            IncompatibleCheckpointError: the loader has no ReshardableSampler or none was saved.
            ValueError: the global batch size is not divisible by the new world size.
        """
        sampler = self.sampler()
        if sampler is None or state is None:
            raise IncompatibleCheckpointError(
                f"rank {rank}: the world size changed but the dataloader position cannot be "
                "resharded: build the loader on distckpt.data.ReshardableSampler (in the saving "
                "and in the resuming run), or pass dataloader=None and reposition it yourself"
            )
        self._shut_down_iterator()
        self.dataloader.load_state_dict({})  # drop any iterator made at the old position
        sampler.load_state_dict(state, batch_policy=batch_policy)
        # At an epoch boundary the next iter(loader) draws from the restored RNG, as the
        # uninterrupted loop did after the save; elsewhere the iterator is made before it.
        if not (sampler.samples_consumed == 0 and sampler.epoch > 0):
            self._materialize_iterator()


def _saved_num_workers(state: dict[str, Any]) -> int | None:
    """``num_workers`` of the loader that saved ``state`` (torchdata 0.11 layout), else ``None``."""
    if "_snapshot" in state:
        snapshot = state["_snapshot"]
        main = snapshot.get("_main_snapshot", {})
        return main.get("_num_workers", len(snapshot.get("_worker_snapshots", {})))
    if "_num_yielded" in state:
        return 0
    return None


def _epoch_end_position(state: dict[str, Any]) -> dict[str, Any] | None:
    """Global position ``(epoch + 1, 0)`` if ``state`` was saved right after the last batch of an
    epoch (its iterator yielded batches and not yet StopIteration), else ``None``."""
    if state.get("_iterator_finished", True):
        return None
    if "_snapshot" in state:
        yielded = state["_snapshot"].get("_snapshot_step", 0) + state.get("_steps_since_snapshot", 0)
    else:
        yielded = state.get("_num_yielded", 0)
    try:
        position = global_state_from_loader_state(state)
    except ValueError:
        return None
    return position if yielded > 0 and position["samples_consumed"] == 0 else None
