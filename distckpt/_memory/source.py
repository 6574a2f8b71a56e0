"""The memory tier as a source of a restore: whether it serves a restart, and how its snapshot is
read (docs/memory.md, "How it works").

:func:`take_inventory` lists a node's snapshots (exchanged with the choice of the durable
checkpoint) and :func:`choose_snapshot` finds the consistent cut (:mod:`distckpt._memory.fetch`) and
compares it with the durable tier's newest committed step: memory serves when its step is at least
as new (no byte read from the root); otherwise it returns ``None`` and the durable tier serves.
The :class:`MemorySource` it returns is read by the loader's one read of any checkpoint,
:func:`~distckpt._load.read.read_checkpoint`; a failed read falls back to the durable tier there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .._coord.collective import Collective
from .._ondisk.manifest import Manifest, TensorSpec
from .._state.train_state import TrainState
from .._version import __version__
from .fetch import (
    Cut,
    Entry,
    Fetch,
    MemoryReader,
    SnapshotFiles,
    fetch_chunks,
    find_cut,
    inventory,
    map_chunks,
    memory_metadata,
    plan_fetch,
    plan_needed,
    verify,
)
from .tier import MemoryTier

__all__ = ["MemoryRestore", "MemorySource", "choose_snapshot", "take_inventory"]

logger = logging.getLogger(__name__)


@dataclass
class MemoryRestore:
    """The outcome of a restore from memory.

    Attributes:
        location: ``memory://<job>/step-<N>`` (names the tier in logs and ``TrainState.checkpoint_path``).
        train_state: the restored counters.
        manifest: a manifest of the snapshot (step, world size, wrapper) for the caller's bookkeeping.
        bytes_received: bytes this rank received from other nodes.
        seconds: wall time of the restore on this rank.
    """

    location: str
    train_state: TrainState
    manifest: Manifest
    bytes_received: int
    seconds: float


def take_inventory(tier: MemoryTier) -> tuple[list[Entry], dict[str, Any]]:
    """This rank's share of its node's snapshots (:func:`~distckpt._memory.fetch.inventory`): the
    compact entries every rank exchanges, and the headers kept here. A directory that cannot be
    listed gives none (a warning): the other nodes' copies or the durable tier serve."""
    try:
        return inventory(tier.dir, tier.layout, tier.rank, run=tier.launch_id)
    except OSError as e:
        logger.warning("memory tier: listing %s failed (%s); its snapshots are not used", tier.dir, e)
        return [], {}


def choose_snapshot(
    tier: MemoryTier,
    collective: Collective,
    *,
    durable_step: int | None,
    entries: list[Entry],
    headers: dict[str, Any],
) -> MemorySource | None:
    """The newest complete memory snapshot, as a source to read, when it is at least as new as
    ``durable_step`` (the durable tier's newest committed step; ``None``: none). Collective: the
    hashes of the newest candidate's files (without the corrupt ones, again).

    Args:
        entries: every rank's :func:`take_inventory` entries (exchanged by the caller with the
            choice of the durable checkpoint: one exchange for both).
        headers: this rank's :func:`take_inventory` headers.

    Returns:
        The snapshot, or ``None`` when the durable tier should serve (no complete snapshot or an
        older one: logged on rank 0 with its reason).
    """
    rank = collective.rank
    cut, why = find_cut(entries)
    corrupt = 0
    while cut is not None:  # hash only the files of the newest candidate; without the corrupt ones, again
        parts = collective.all_gather(verify(tier.dir, rank, cut, headers))
        bad = {tuple(b) for found, _ in parts for b in found}
        if not bad:
            for _, theirs in parts:
                cut.headers.update(theirs)
            break
        corrupt += len(bad)
        entries = [e for e in entries if (e[0], e[1]) not in bad]
        cut, why = find_cut(entries)
    if cut is None and corrupt:
        why += f"; {corrupt} corrupt snapshot file(s) left out (warnings above name them)"
    if cut is None or (durable_step is not None and cut.step < durable_step):
        if rank == 0:
            reason = why if cut is None else f"its newest complete snapshot, step {cut.step}, is older"
            logger.info("memory tier: %s -> the durable tier serves (newest commit: step %s)", reason, durable_step)
        return None
    return MemorySource(tier, collective, cut, why=why, durable_step=durable_step)


class MemorySource:
    """A memory snapshot (a consistent cut) as a :class:`~distckpt._load.read.CheckpointSource`:
    its manifest and DCP metadata are built from the cut's headers, each rank's plan names the
    chunks it needs, and the reader serves them from memory once :func:`fetch_chunks` read them
    from this node or received them from a node holding them.

    Args:
        tier: the memory tier (its directory and node layout).
        collective: the manager's process-group helper.
        cut: from :func:`choose_snapshot`, its headers verified.
        why: why this cut (for the log); durable_step: the durable tier's newest committed step.
    """

    read_agrees = False  # the chunks are in memory once fetched: DCP's copy is agreed with the restore

    def __init__(self, tier: MemoryTier, collective: Collective, cut: Cut, *, why: str, durable_step: int | None):
        self.tier, self.collective, self.cut, self.why, self.durable_step = tier, collective, cut, why, durable_step
        self.location = f"memory://{tier.job}/step-{cut.step}"
        self._metadata, self.where = memory_metadata(cut)
        self._manifest = _manifest(cut, self._metadata)
        self.received = self.moved = 0  # bytes this rank received; all ranks moved between nodes
        self._files: SnapshotFiles | None = None  # mapped by plan()
        self._local: dict[MetadataIndex, torch.Tensor] = {}

    def manifest(self) -> Manifest:
        """The snapshot's manifest (no exchange: built from the cut's headers)."""
        return self._manifest

    def metadata(self) -> Metadata:
        """The snapshot's DCP ``Metadata`` (no exchange)."""
        return self._metadata

    def plan(self, target: dict[str, Any]) -> tuple[Fetch, dict[int, list[tuple[str, int, int]]]]:
        """Where this rank gets each chunk the load of ``target`` reads, and its requests to other nodes."""
        rank = self.collective.rank
        needed = plan_needed(target, self._metadata, is_coordinator=rank == 0)
        fetch = plan_fetch(self.cut, self.where, needed, layout=self.tier.layout, rank=rank)
        # Mapped here, inside the plan's agreement: the moves after it need no agreement of their own.
        self._files, self._local = map_chunks(fetch, self.cut, rank=rank, directory=self.tier.dir)
        return fetch, fetch.asks

    def reader(self, plan: Fetch, shared: list[dict[int, list[tuple[str, int, int]]]]) -> MemoryReader:
        """Receive this rank's chunks from other nodes and send theirs (``shared``: every rank's
        requests); a reader over them and the node's own."""
        assert self._files is not None  # plan() first
        chunks, self.received, self.moved, error = fetch_chunks(
            plan, shared, self._files, self._local, collective=self.collective
        )
        return MemoryReader(self._metadata, self.where, chunks, error)

    def served(self, train_state: TrainState, manifest: Manifest, *, seconds: float) -> MemoryRestore:
        """The outcome of a completed restore of this snapshot (``seconds``: its wall time), logged on rank 0."""
        if self.collective.rank == 0:
            logger.info(
                "memory tier serves: %s (%s; newest durable commit: step %s), %.1f MiB moved between nodes, %.2f s",
                self.location,
                self.why,
                self.durable_step,
                self.moved / 2**20,
                seconds,
            )
        return MemoryRestore(self.location, train_state, manifest, self.received, seconds)


def _manifest(cut: Cut, metadata: Metadata) -> Manifest:
    """A manifest of the snapshot: its step, world size, wrapper, and the model's tensors (global
    shape and dtype, from the DCP metadata) for :func:`~distckpt._ondisk.manifest.check_model_fits`."""
    model = {
        fqn.removeprefix("model."): TensorSpec(shape=list(md.size), dtype=str(md.properties.dtype))
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    return Manifest(
        step=cut.step,
        world_size=cut.world_size,
        wrapper=cut.headers[min(cut.headers)]["wrapper"],
        state_dict_type="sharded",
        torch_version=torch.__version__,
        distckpt_version=__version__,
        model=model,
        model_fingerprint="",
    )
