"""Loading a committed checkpoint, or the memory tier's snapshot, into the live training objects, on every rank.

:meth:`CheckpointLoader.load` takes the checkpoint rank 0 chose
(:class:`~distckpt._load.discovery.CheckpointDiscovery`) or the memory tier's newer snapshot
(:func:`~distckpt._memory.source.choose_snapshot`) and reads it with the one read of
:func:`~distckpt._load.read.read_checkpoint`: a durable checkpoint through :class:`StoreSource`
(distckpt's fast reader by default, every file hashed while read), the snapshot through
:class:`~distckpt._memory.source.MemorySource`. It falls back from a failed memory restore to the
durable tier, and to the next older committed checkpoint when a read finds corruption and
``load.fallback_to_older`` allows it. Every step that can fail on one rank only is agreed on, so
all ranks raise (or fall back) together.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from .._config import LOADABLE, CheckpointConfig
from .._coord.collective import Collective
from .._coord.events import EventLog
from .._engine.blocking import gc_paused
from .._errors import CheckpointCorruptError, DistCkptError, IncompatibleCheckpointError
from .._memory import MemoryRestore, MemoryTier, choose_snapshot, take_inventory
from .._ondisk.integrity import BlockDigests
from .._ondisk.layout import parse_step
from .._ondisk.manifest import Manifest, first_problem, structure_problems
from .._state.train_state import TrainState
from .._state.training_state import CheckpointState
from .._storage import CheckpointStore, check_file, digest_index, read_dcp_metadata, step_of, store_of
from .discovery import CheckpointDiscovery
from .read import CheckpointSource, read_checkpoint

__all__ = ["CheckpointLoader", "StoreSource", "checked_metadata"]

logger = logging.getLogger(__name__)


class CheckpointLoader:
    """Loads checkpoints for one manager (every method is collective over ``collective``).

    Args:
        collective: the manager's process-group helper.
        state: the live training state.
        config: ``load`` (``verify``, ``fast_reader``, ``streams_per_node``, ``path``,
            ``fallback_to_older``), ``root``.
        events: this rank's event log (a ``load`` event per read).
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
        local_world_size: int,
        store: CheckpointStore,
        memory: MemoryTier | None = None,
    ) -> None:
        self.collective, self.state, self.config = collective, state, config
        self.events, self.local_world_size = events, local_world_size
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
        # Manifests, metadata, targets: objects per tensor, whose collections would scan the whole heap.
        with gc_paused():
            return self._load(discovery)

    def _load(self, discovery: CheckpointDiscovery) -> tuple[str, TrainState, Manifest] | None:
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
            memory = self.memory if not rejected and self.config.resolved_load_path is None else None

            def choose(memory: MemoryTier | None = memory) -> tuple[str | None, tuple[list, dict[str, Any]]]:
                return discovery.choose(rejected), take_inventory(memory) if memory is not None else ([], {})

            # Rank 0 chooses; one exchange tells every rank its choice and whether any rank failed,
            # and gathers every rank's memory inventory with it.
            (_, (_, headers)), chosen = self.collective.agree_and_share(
                choose, lambda mine: (mine[0], mine[1][0]), what="finding a checkpoint"
            )
            path = chosen[0][0]
            if memory is not None:
                entries = [e for _, part in chosen for e in part]
                got = self._from_memory(None if path is None else step_of(self.store, path), entries, headers)
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
        """Read the checkpoint ``path`` into the live objects (every rank): :func:`read_checkpoint`
        from a :class:`StoreSource`.

        Raises:
            CheckpointCorruptError: its manifest, ``.metadata`` or a data file is bad (every rank).
            IncompatibleCheckpointError: it does not fit the live model or components.
        """
        return self._read(StoreSource(path, self))

    def _read(self, source: CheckpointSource) -> tuple[TrainState, Manifest]:
        return read_checkpoint(
            source,
            state=self.state,
            collective=self.collective,
            select=self.config.load.selection,
        )

    def _from_memory(self, durable_step: int | None, entries: list, headers: dict[str, Any]) -> MemoryRestore | None:
        """Restore the memory tier's newest complete snapshot when it is at least as new as
        ``durable_step`` (docs/memory.md, "How it works"), from every rank's inventory ``entries``
        and this rank's ``headers`` (:func:`~distckpt._memory.source.take_inventory`); ``None``:
        the durable tier serves (each reason logged on rank 0).

        Raises:
            IncompatibleCheckpointError: the snapshot does not fit the live model or components. The
                durable tier holds older states of the same model, so it is not tried. Any other
                failure of the memory restore falls back to the durable tier.
        """
        assert self.memory is not None
        t0 = time.perf_counter()
        source = choose_snapshot(
            self.memory, self.collective, durable_step=durable_step, entries=entries, headers=headers
        )
        if source is None:
            return None
        try:
            train_state, manifest = self._read(source)
        except IncompatibleCheckpointError:
            raise
        except DistCkptError as e:
            if self.collective.rank == 0:
                logger.warning("memory tier: restoring %s failed (%s) -> the durable tier serves", source.location, e)
            return None
        return source.served(train_state, manifest, seconds=time.perf_counter() - t0)


class StoreSource:
    """A committed checkpoint of a storage location as a :class:`~distckpt._load.read.CheckpointSource`.

    Rank 0 alone reads the manifest and ``.metadata`` and hands them to every rank (one read per
    job, not one per rank); an error there raises on every rank, so all ranks fall back together.
    Each rank reads the digest files of the files it reads
    (:class:`~distckpt._ondisk.digests.DigestIndex`). The reader is the store's (distckpt's fast
    reader by default, every file hashed while read); DCP's reads end in their own agreement, so a
    digest file found changed on one rank fails the read on every rank.

    Args:
        path: the checkpoint (of the root, or of another root: ``load.path``).
        loader: the loader reading it (its config, store, collective, events, node size).
    """

    read_agrees = True

    def __init__(self, path: str, loader: CheckpointLoader) -> None:
        self.location, self.loader = path, loader
        self.store = store_of(path, loader.store)  # load_path may name a checkpoint of another root
        self.what = f"reading {path}"
        self._manifest: Manifest | None = None
        self._metadata: Any = None
        self.blocks: Mapping[str, BlockDigests] | None = None

    def manifest(self) -> Manifest:
        """The manifest, read by rank 0 (``CheckpointCorruptError`` on every rank)."""
        read = functools.partial(self.store.read_manifest, self.location)
        self._manifest = self.loader.collective.lead(read, what=self.what, error_type=CheckpointCorruptError)
        return self._manifest

    def metadata(self) -> Any:
        """``.metadata`` (its hash checked first with ``load.verify``), read and checked by rank 0
        (``CheckpointCorruptError`` on every rank)."""
        path, manifest, verify = self.location, self._manifest, self.loader.config.load.verify
        assert manifest is not None  # manifest() first

        def read_plan_inputs() -> tuple[Any, dict[str, BlockDigests] | None]:
            if verify:  # every rank plans from .metadata: check it first
                for f in manifest.files:
                    if f.path == ".metadata":
                        check_file(self.store, path, f.path, size_bytes=f.size_bytes, digest=f.hash)
            return checked_metadata(self.store, path, manifest)

        self._metadata = self.loader.collective.lead(
            read_plan_inputs, what=self.what, error_type=CheckpointCorruptError
        )
        # Each rank reads the digest files of the files it reads, when it reads them: no rank
        # receives every rank's block digests.
        self.blocks = digest_index(self.store, path, manifest) if verify else None
        return self._metadata

    def plan(self, target: dict[str, Any]) -> tuple[None, None]:
        """Nothing to plan or share: every rank reads its own items from the store."""
        return None, None

    def reader(self, plan: None, shared: list[None]) -> Any:
        """The store's DCP reader, verifying what it reads with ``load.verify``; shares its reads
        across nodes with ``load.read_once``."""
        loader, path, manifest = self.loader, self.location, self._manifest
        config = loader.config.load
        assert manifest is not None
        expected = {f.path: (f.size_bytes, f.hash) for f in manifest.files} if config.verify else None
        loader.events.emit("load", manifest.step, path=str(path))
        streams = max(1, config.streams_per_node // loader.local_world_size)
        reader = self.store.dcp_reader(
            path, expected_files=expected, fast=config.fast_reader, thread_count=streams, block_digests=self.blocks
        )
        reader.use_metadata(self._metadata)  # parsed and checked above: not again
        once = config.read_once  # "auto": across nodes only (a node shares its page cache)
        if once is True or (once == "auto" and loader.local_world_size < loader.collective.world_size):
            reader.share_over(loader.collective.group)
        return reader


def checked_metadata(store: CheckpointStore, path: str, manifest: Manifest) -> Any:
    """The DCP ``Metadata`` of checkpoint ``path``, after the structure checks ``distckpt verify``
    makes (:func:`~distckpt._ondisk.manifest.structure_problems`: the manifest's step is the directory's,
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
