"""The one read of a checkpoint into the live training state, from any source (docs/design.md, section 5).

:func:`read_checkpoint` is the read every load makes, from the durable tier
(:class:`~distckpt._load.loading.StoreSource`) or from the memory tier's snapshot
(:class:`~distckpt._memory.source.MemorySource`): the fit check, the load target, DCP's read into
it and the restore of every part (model, optimizer, scheduler, scaler, extras, data position,
counters, RNG last). A :class:`CheckpointSource` supplies only what differs: the manifest, the DCP
metadata and the reader that obtains the stored bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata

from .._coord.collective import Collective
from .._engine.blocking import gc_paused, run_load
from .._errors import IncompatibleCheckpointError
from .._ondisk.manifest import Manifest, TensorSpec, check_model_fits
from .._state.train_state import TrainState
from .._state.training_state import CheckpointState

__all__ = ["CheckpointSource", "read_checkpoint"]


class CheckpointSource(Protocol):
    """Where one checkpoint's stored state comes from. Every method is called on every rank, in
    the order :func:`read_checkpoint` calls them.

    Attributes:
        location: names the checkpoint in errors, logs and ``TrainState.checkpoint_path``.
        read_agrees: the reader's reads end in an agreement of their own (DCP over the process
            group, errors raised on every rank with the failing file); ``False``: the reads are
            local (the bytes are already here) and agreed together with the restore.
    """

    location: str
    read_agrees: bool

    def manifest(self) -> Manifest:
        """The checkpoint's manifest (step, world size, model specs). Collective."""
        ...

    def metadata(self) -> Metadata:
        """The checkpoint's DCP ``Metadata``, checked. Collective."""
        ...

    def plan(self, target: dict[str, Any]) -> tuple[Any, Any]:
        """``(this rank's read plan, what every rank must learn of it)`` for the load target
        ``target``; local (shared in the planning exchange)."""
        ...

    def reader(self, plan: Any, shared: list[Any]) -> StorageReader:
        """The DCP reader serving this rank's ``plan`` (``shared``: every rank's share, in rank
        order). Collective."""
        ...


def read_checkpoint(
    source: CheckpointSource,
    *,
    state: CheckpointState,
    collective: Collective,
    select: frozenset[str],
) -> tuple[TrainState, Manifest]:
    """Read the checkpoint ``source`` holds into the live training objects (every rank, collective).

    Args:
        source: the durable checkpoint or the memory snapshot.
        state: the live training state.
        collective: the manager's process-group helper.
        select: the parts to restore (:data:`~distckpt._config.LOADABLE`); the others keep their live state.

    Returns:
        ``(the restored counters, the checkpoint's manifest)``.

    Raises:
        IncompatibleCheckpointError: the checkpoint does not fit the live model or components
            (every difference named; every rank).
        CheckpointCorruptError: a manifest, metadata or data read found damage (every rank).
        DistCkptError: any other failure of a rank's read or restore, on every rank.
    """
    # The cyclic GC paused for the whole read, not only DCP's part: unpickling .metadata and
    # set_state_dict allocate objects per tensor (their collections: a third of such a load).
    with gc_paused():
        location = source.location
        manifest = source.manifest()
        metadata = source.metadata()
        keys = set(metadata.state_dict_metadata)
        with state.model_optim.load_context():

            def fits(live: dict[str, TensorSpec]) -> None:
                # A live model the checkpoint does not fit (shape, dtype, keys) is the user's change: said, never cast.
                check_model_fits(manifest, location, live, state.model_optim.ties)

            def plan() -> tuple[dict[str, Any], tuple[Any, Any]]:
                target = state.for_load(keys, manifest.world_size, select, metadata=metadata, fits=fits)
                return target, source.plan(target)

            # One exchange agrees on the targets and shares the sources' requests.
            (target, (mine, _)), shared = collective.agree_and_share(
                plan, lambda planned: planned[1][1], what=f"planning the load of {location}"
            )
            reader = source.reader(mine, shared)

            def restore() -> TrainState:
                if not source.read_agrees:  # local reads: agreed with the restore, one exchange
                    run_load(target, reader, process_group=collective.group, directory=location)
                return state.restore(target, saved_world_size=manifest.world_size)

            if source.read_agrees:  # raises on every rank, naming the failing rank and file
                run_load(target, reader, process_group=collective.group, directory=location)
            train_state = collective.agree(
                restore, what=f"restoring {location}", error_type=IncompatibleCheckpointError
            )
    return train_state, manifest
