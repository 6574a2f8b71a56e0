"""Reading a committed checkpoint into the live training objects, on every rank.

:meth:`CheckpointLoader.load` takes the checkpoint rank 0 chose
(:class:`~distckpt.load.discovery.CheckpointDiscovery`), checks that it fits the live model before
touching anything, plans and reads it through DCP (distckpt's fast reader by default, every file
hashed while read), restores the training state, and falls back to the next older committed
checkpoint when a read finds corruption and ``load.fallback_to_older`` allows it. Every step that
can fail on one rank only is agreed on, so all ranks raise (or fall back) together.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import LOADABLE, CheckpointConfig
from ..coord.collective import Collective
from ..coord.events import EventLog
from ..engine.blocking import gc_paused, run_load
from ..errors import CheckpointCorruptError, IncompatibleCheckpointError
from ..memory import MemoryRestore, MemoryTier, restore_from_memory
from ..ondisk.integrity import BlockDigests
from ..ondisk.layout import parse_step
from ..ondisk.manifest import Manifest, TensorSpec, check_model_fits, first_problem, structure_problems
from ..state.training_state import CheckpointState, TrainState
from ..storage import CheckpointStore, block_digests, check_file, read_dcp_metadata, step_of, store_of
from .discovery import CheckpointDiscovery

__all__ = ["CheckpointLoader"]

logger = logging.getLogger(__name__)


class CheckpointLoader:
    """Loads checkpoints for one manager (every method is collective over ``collective``).

    Args:
        collective: the manager's process-group helper.
        state: the live training state.
        config: ``load`` (``verify``, ``fast_reader``, ``streams_per_node``, ``path``,
            ``fallback_to_older``), ``root``.
        events: this rank's event log (a ``load`` event per read).
        model_specs: ``{fqn: TensorSpec}`` of the live model.
        local_world_size: ranks on this node (they share ``load.streams_per_node``).
        store: the root's storage; every read goes through it.
        memory: the memory tier, consulted before the durable tier when ``load`` names no checkpoint.
    """

    def __init__(
        self,
        *,
        collective: Collective,
        state: CheckpointState,
        config: CheckpointConfig,
        events: EventLog,
        model_specs: dict[str, TensorSpec],
        local_world_size: int,
        store: CheckpointStore,
        memory: MemoryTier | None = None,
    ) -> None:
        self.collective, self.state, self.config = collective, state, config
        self.events, self.model_specs, self.local_world_size = events, model_specs, local_world_size
        self.store, self.memory = store, memory
        self.tier = "durable"  # the tier the last load() read from
        self.restored: MemoryRestore | None = None  # the last restore from memory

    def load(self, discovery: CheckpointDiscovery) -> tuple[str, TrainState, Manifest] | None:
        """Load the checkpoint ``discovery`` chooses, falling back when allowed.

        Returns:
            ``(path, train state, manifest)``, or ``None`` when there is nothing to load.

        Raises:
            CheckpointNotFoundError, CheckpointCorruptError, IncompatibleCheckpointError: as
            :meth:`distckpt.CheckpointManager.load` documents.
        """
        rejected: list[str] = []
        selected, self.tier = self.config.load.selection, "durable"
        if selected != frozenset(LOADABLE) and self.collective.rank == 0:
            how = (
                f"load.only={self.config.load.only}"
                if self.config.load.only is not None
                else f"load.exclude={self.config.load.exclude}"
            )
            logger.info(
                "selective load (%s): loading %s; not loading (live state kept): %s",
                how,
                ", ".join(p for p in LOADABLE if p in selected) or "nothing",
                ", ".join(p for p in LOADABLE if p not in selected),
            )
        while True:
            # rank 0 chooses; one exchange tells every rank its choice and whether any rank failed
            _, chosen = self.collective.agree_and_share(
                lambda: discovery.choose(rejected), lambda mine: mine, what="finding a checkpoint"
            )
            path = chosen[0]
            if self.memory is not None and not rejected and self.config.resolved_load_path is None:
                durable = None if path is None else step_of(self.store, path)
                got = restore_from_memory(self.memory, self.collective, self.state, selected, durable_step=durable)
                if got is not None:
                    self.tier, self.restored = "memory", got
                    return got.location, got.train_state, got.manifest
            if path is None:
                return None
            try:
                train_state, manifest = self.read(path)
                return path, train_state, manifest
            except CheckpointCorruptError as e:
                # A changed byte (same size) is only found while reading. Loading an older
                # checkpoint rewrites every tensor the failed read may have touched.
                if self.config.resolved_load_path is not None:
                    raise
                if not self.config.load.fallback_to_older:
                    raise CheckpointCorruptError(
                        f"{e} -- the newest checkpoint {path} is not loadable. Set load.fallback_to_older: "
                        "true to resume from the previous committed checkpoint, or restore the file; "
                        f"`distckpt verify {self.config.root}` lists every bad file. The live model and "
                        "optimizer may be partly overwritten: load again before training.",
                        path=e.path,
                    ) from e
                if self.collective.rank == 0:
                    logger.warning(
                        "%s -- falling back to the previous committed checkpoint (load.fallback_to_older=true)", e
                    )
                rejected.append(path)

    def read(self, path: str) -> tuple[TrainState, Manifest]:
        """Read the checkpoint ``path`` into the live objects (every rank).

        Raises:
            CheckpointCorruptError: its manifest, ``.metadata`` or a data file is bad (every rank).
            IncompatibleCheckpointError: it does not fit the live model or components.
        """
        # The cyclic GC paused for the whole read, not only DCP's part: unpickling .metadata and
        # set_state_dict allocate objects per tensor (their collections: a third of such a load).
        with gc_paused():
            return self._read(path)

    def _read(self, path: str) -> tuple[TrainState, Manifest]:
        store = store_of(path, self.store)  # load_path may name a checkpoint of another root

        def read_plan_inputs() -> tuple[Any, dict[str, BlockDigests] | None]:
            if self.config.load.verify:  # every rank plans from .metadata: check it first
                for f in manifest.files:
                    if f.path == ".metadata":
                        check_file(store, path, f.path, size_bytes=f.size_bytes, digest=f.hash)
            metadata = checked_metadata(store, path, manifest)
            return metadata, block_digests(store, path, manifest) if self.config.load.verify else None

        # Rank 0 alone reads the manifest, .metadata and the digest files and hands them to every
        # rank (one read per job, not one per rank); an error there raises on every rank, so all
        # ranks fall back together.
        what = f"reading {path}"
        manifest = self.collective.lead(lambda: store.read_manifest(path), what=what, error_type=CheckpointCorruptError)
        check_model_fits(manifest, path, self.model_specs, self.state.model_optim.ties)
        metadata, blocks = self.collective.lead(read_plan_inputs, what=what, error_type=CheckpointCorruptError)
        keys = set(metadata.state_dict_metadata)
        with self.state.model_optim.load_context():
            select = self.config.load.selection
            target = self.collective.agree(
                lambda: self.state.for_load(keys, manifest.world_size, select, metadata=metadata),
                what=f"planning the load of {path}",
            )
            expected = {f.path: (f.size_bytes, f.hash) for f in manifest.files} if self.config.load.verify else None
            self.events.emit("load", manifest.step, path=str(path))
            streams = max(1, self.config.load.streams_per_node // self.local_world_size)
            reader = store.dcp_reader(
                path,
                expected_files=expected,
                fast=self.config.load.fast_reader,
                thread_count=streams,
                block_digests=blocks,
            )
            reader.use_metadata(metadata)  # parsed and checked above: not again
            once = self.config.load.read_once  # "auto": across nodes only (a node shares its page cache)
            if once is True or (once == "auto" and self.local_world_size < self.collective.world_size):
                reader.share_over(self.collective.group)
            run_load(target, reader, process_group=self.collective.group, directory=path)
            train_state = self.collective.agree(
                lambda: self.state.restore(target, saved_world_size=manifest.world_size),
                what=f"restoring {path}",
                error_type=IncompatibleCheckpointError,
            )
        return train_state, manifest


def checked_metadata(store: CheckpointStore, path: str, manifest: Manifest) -> Any:
    """The DCP ``Metadata`` of checkpoint ``path``, after the structure checks ``distckpt verify``
    makes (:func:`~distckpt.ondisk.manifest.structure_problems`: the manifest's step is the directory's,
    every item lies in a listed file, the model tensors are the manifest's).

    Raises:
        CheckpointCorruptError: the first problem (naming its file).
    """
    metadata = read_dcp_metadata(store, path)
    problem = first_problem(
        structure_problems(
            manifest, location=path, dir_step=parse_step(os.path.basename(path.rstrip("/"))), metadata=metadata
        ),
        path,
    )
    if problem is not None:
        raise problem
    return metadata
