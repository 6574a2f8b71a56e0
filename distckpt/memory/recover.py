"""Choosing the tier a restart resumes from, and the restore from memory (docs/memory.md, "Restore").

:func:`restore_from_memory` runs the inventory and the consistent cut of
:mod:`distckpt.memory.restore` and compares the cut with the durable tier's newest committed step:
memory serves when its step is at least as new (no byte read from the root); otherwise, or when the
memory restore fails, it returns ``None`` and the durable tier serves. Rank 0 logs which tier
served and why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._version import __version__
from ..adapters import tensor_specs
from ..coord.collective import Collective
from ..engine.blocking import run_load
from ..errors import DistCkptError, IncompatibleCheckpointError
from ..ondisk.manifest import Manifest, TensorSpec, check_model_fits
from ..state.training_state import CheckpointState, TrainState
from .restore import (
    Cut,
    Fetch,
    MemoryReader,
    fetch_chunks,
    find_cut,
    inventory,
    memory_metadata,
    plan_fetch,
    plan_needed,
    verify,
)
from .tier import MemoryTier

__all__ = ["MemoryRestore", "restore_from_memory"]

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


def restore_from_memory(
    tier: MemoryTier,
    collective: Collective,
    state: CheckpointState,
    select: frozenset[str],
    *,
    durable_step: int | None,
) -> MemoryRestore | None:
    """Restore the newest complete memory snapshot when it is at least as new as ``durable_step``
    (the durable tier's newest committed step; ``None``: none). Collective.

    Returns:
        The restore, or ``None`` when the durable tier should serve (no complete snapshot, an older
        one, or a failed memory restore: each logged on rank 0 with its reason).

    Raises:
        IncompatibleCheckpointError: the snapshot does not fit the live model or components (every
            difference named; the durable tier holds older states of the same model, so it is not
            tried). Any other failure of the memory restore falls back to the durable tier.
    """
    t0 = time.perf_counter()
    rank = collective.rank
    mine, headers = inventory(tier.dir, tier.layout, rank, run=tier.launch_id)
    entries = [e for part in collective.all_gather(mine) for e in part]  # compact: no headers
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
    location = f"memory://{tier.job}/step-{cut.step}"
    metadata, where = memory_metadata(cut)
    manifest = _manifest(cut, metadata)

    def plan() -> tuple[dict[str, Any], Fetch]:
        # A live model the snapshot does not fit (shape, dtype, keys) is the user's change: said, never cast.
        check_model_fits(manifest, location, tensor_specs(state.model_optim.model), state.model_optim.ties)
        target = state.for_load(set(metadata.state_dict_metadata), cut.world_size, select, metadata=metadata)
        needed = plan_needed(target, metadata, is_coordinator=rank == 0)
        return target, plan_fetch(cut, where, needed, layout=tier.layout, rank=rank)

    def load(target: dict[str, Any], chunks: dict) -> TrainState:
        run_load(target, MemoryReader(metadata, where, chunks), process_group=None, directory=location)
        return state.restore(target, saved_world_size=cut.world_size)

    try:
        with state.model_optim.load_context():
            # One exchange for the fit, the targets, the plan and the chunk requests, one for the
            # reads, one for the load and restore (IncompatibleCheckpointError keeps its type).
            (target, fetch), shared = collective.agree_and_share(
                plan, lambda planned: planned[1].asks, what=f"planning the restore of {location}"
            )
            chunks, received, moved = fetch_chunks(fetch, shared, directory=tier.dir, collective=collective)
            train_state = collective.agree(
                lambda: load(target, chunks), what=f"restoring {location}", error_type=IncompatibleCheckpointError
            )
    except IncompatibleCheckpointError:
        raise  # the durable tier's checkpoints are older states of the same model: as incompatible
    except DistCkptError as e:
        if rank == 0:
            logger.warning("memory tier: restoring %s failed (%s) -> the durable tier serves", location, e)
        return None
    seconds = time.perf_counter() - t0
    if rank == 0:
        logger.info(
            "memory tier serves: %s (%s; newest durable commit: step %s), %.1f MiB moved between nodes, %.2f s",
            location,
            why,
            durable_step,
            moved / 2**20,
            seconds,
        )
    return MemoryRestore(location, train_state, manifest, received, seconds)


def _manifest(cut: Cut, metadata: Metadata) -> Manifest:
    """A manifest of the snapshot: its step, world size, wrapper, and the model's tensors (global
    shape and dtype, from the DCP metadata) for :func:`~distckpt.ondisk.manifest.check_model_fits`."""
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
