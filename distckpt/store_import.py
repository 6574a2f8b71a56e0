"""``distckpt import`` into an object-storage root (``s3://bucket/prefix``): the same checkpoint
:func:`distckpt.export.import_weights` commits on POSIX, written and committed through the
root's :class:`~distckpt.storage.base.CheckpointStore` (data prefix, then the manifest PUT as
a conditional create)."""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

from ._version import __version__
from .errors import ConfigError
from .export import load_weights
from .lock import RootLock
from .manifest import Manifest, TensorSpec, model_fingerprint
from .rng import capture_rng, derive_rng, restore_rng
from .state import WEIGHTS_ONLY_KEY, TrainState, pack
from .storage import open_store

__all__ = ["import_to_store"]

logger = logging.getLogger(__name__)


def import_to_store(weights_path: str | os.PathLike, root: str, *, step: int = 0,
                    on_existing: Literal["refuse", "archive"] = "refuse") -> str:
    """:func:`~distckpt.export.import_weights` into an ``s3://`` root.

    Returns:
        The committed checkpoint's location (its data-prefix URL).

    Raises:
        CheckpointNotFoundError, ValueError: as ``import_weights`` (the weights file).
        ConfigError: the bucket is missing or not accessible, or the root holds checkpoints
            and ``on_existing`` is ``"refuse"``.
        CheckpointLockedError: another job writes this root.
        CheckpointSaveError: never; a failed write or commit raises ``OSError`` /
            ``FileExistsError`` (the step is committed already) and leaves nothing committed.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    weights = load_weights(weights_path)
    store: Any = open_store(root)  # an S3Store: set_aside is object storage's
    store.prepare()
    lock = RootLock.of(store)
    lock.acquire()
    pending = store.pending_location(step, uuid.uuid4().hex[:12])
    try:
        existing = sorted(s for s, _, _ in store.find_committed())
        if existing and on_existing != "archive":
            raise ConfigError(f"{root} already holds {len(existing)} checkpoint(s), newest step {existing[-1]}: "
                              "a load: true run would resume those, not the import. Import into another root, "
                              "or archive them first (their manifests renamed archived-step-N-<n>)")
        moved = [store.set_aside(s, "archived") for s in existing]
        if moved:
            store.repair_latest()
            logger.warning("import: set aside the %d checkpoint(s) of %s: %s", len(moved), root, ", ".join(moved))
        saved_rng = capture_rng()
        try:
            derive_rng(0, 0, step)  # rank 0's RNG as a fresh run derives it (as import_weights)
            rng = capture_rng()
        finally:
            restore_rng(saved_rng)
        state = {"model": weights, "train_state": pack(TrainState(step=step).to_saved()),
                 "rank_state": {"rank0": {"rng": pack(rng)}},
                 WEIGHTS_ONLY_KEY: pack({"source": str(Path(weights_path).resolve()),
                                         "size_bytes": Path(weights_path).stat().st_size, "time": time.time()})}
        writer = store.dcp_writer(pending, thread_count=1, write_timeout_s=None)
        t_write = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state, storage_writer=writer, no_dist=True)
        t_write = time.perf_counter() - t_write
        specs = {k: TensorSpec(shape=list(v.shape), dtype=str(v.dtype)) for k, v in sorted(weights.items())}
        manifest = Manifest(
            step=step, wall_time=time.time(), world_size=1, wrapper="plain", state_dict_type="full",
            torch_version=torch.__version__, distckpt_version=__version__, model=specs,
            model_fingerprint=model_fingerprint(specs),
            timings_s={"stage": 0.0, "write": t_write, "commit": time.perf_counter() - t0 - t_write},
            files=store.list_files(pending, dict(writer.fs.written)))
        location = store.commit(pending, step, manifest)
    except BaseException:
        store.abort(pending)
        raise
    finally:
        lock.release()
    logger.info("imported %s as %s (%d tensors) in %.2f s", weights_path, location, len(weights),
                time.perf_counter() - t0)
    return location
