"""``CheckpointManager``: the policy layer a training script talks to (DESIGN section 1).

Call order (every rank)::

    manager = CheckpointManager(config, model=..., optimizer=..., ...)
    state = manager.load()                      # None on a fresh start
    for step in range(start, total):
        ...train one optimizer step...
        manager.maybe_save(step + 1, loss=loss)  # steps completed so far
    manager.close()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .adapters import ddp_rebuilds_buckets, tensor_specs, wrapper_kind
from .collective import Collective
from .discovery import CheckpointDiscovery, check_model_fits
from .config import CheckpointConfig
from .events import EventLog
from .grace import PreemptionPlan, SaveDurations, plan_preemption
from .engine import AsyncWriter, dcp_load, read_dcp_metadata
from .engine.blocking import describe_exception
from .errors import CheckpointCorruptError, CheckpointLockedError, ConfigError, IncompatibleCheckpointError
from .integrity import check_file
from .lock import RootLock
from .manifest import Manifest
from .preemption import PreemptionWatcher
from .schedule import SaveSchedule
from .state import CheckpointState, TrainState
from .topology import check_shared_root, local_world_size
from .transaction import PhaseHook, SaveContext, SaveTransaction

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    step: int
    started: float = 0.0  # time.perf_counter() at the save call
    thread: threading.Thread | None = None
    error: Exception | None = None


class CheckpointManager:
    """Saves and restores the whole training state through DCP with atomic commits.

    Every public method is collective: all ranks of ``process_group`` call it in the same
    order with the same ``step``.

    Args:
        config: policy (where, when, how many, FULL or SHARDED).
        model: the model, plain or wrapped (DDP, FSDP1, FSDP2, ``torch.compile``).
        optimizer: its optimizer, or ``None``.
        lr_scheduler: object with ``state_dict``/``load_state_dict`` (an ``LRScheduler``).
        grad_scaler: ``torch.amp.GradScaler``.
        dataloader: torchdata ``StatefulDataLoader``; with a
            :class:`~distckpt.data.ReshardableSampler` its position survives a world-size change.
        extra_state: ``{name: Stateful | plain value}`` saved alongside; after ``load()``
            plain values are in ``manager.extra_state``.
        process_group: ranks that checkpoint together; ``None`` = default group (or a
            single process when ``torch.distributed`` is not initialised).
        on_phase: ``on_phase(phase, step, rank)``, called on every rank before each phase of
            a save acts (``stage``, ``write``, ``manifest``, ``rename``, ``latest``,
            ``retention``, ``committed``; see :mod:`distckpt.transaction`): tracing and
            fault injection. It runs on the background thread for async saves.

    Raises:
        ConfigError: the root directory cannot be created or written (on every rank); or the
            run does not resume from the root (``load: false``, or ``load_path`` outside it)
            while the root holds checkpoints, and ``on_existing`` is not ``archive``.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
        dataloader: Any = None,
        extra_state: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        on_phase: PhaseHook | None = None,
    ) -> None:
        self.config = config
        self.root = Path(config.root)
        self.collective = Collective(process_group, timeout_s=config.timeout_s)
        self.rank, self.world_size = self.collective.rank, self.collective.world_size
        self.state = CheckpointState(
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, grad_scaler=grad_scaler,
            dataloader=dataloader, extra_state=extra_state, rank=self.rank,
            world_size=self.world_size,
            seed=config.seed)
        self.train_state = TrainState()
        self._explicit_counters: set[str] = set()  # passed by the caller: never derived
        self.schedule = SaveSchedule(interval_steps=config.interval_steps,
                                     interval_seconds=config.interval_seconds,
                                     collective=self.collective)
        self.wrapper = wrapper_kind(model)
        self.model_specs = tensor_specs(model)
        if self.rank == 0 and self.world_size >= 3 and ddp_rebuilds_buckets(model):
            logger.warning(
                "DDP on %d ranks rebuilds its gradient buckets after each process's first step, so "
                "a same-world resume matches the uninterrupted run to float rounding, not bitwise. "
                "For bitwise resumes build DDP with find_unused_parameters=True (no rebuild; "
                "README: Exactness).", self.world_size)
        self.last_saved_step: int | None = None
        self.last_save_seconds = 0.0
        self.save_durations = SaveDurations()  # predicts the preemption save (grace window)
        self._closed = False
        self._inflight: _InFlight | None = None
        # Background work gets its own gloo group so it never interleaves with the loop's.
        self.background = (Collective(process_group, timeout_s=config.timeout_s)
                           if config.async_mode != "off" else None)
        self.async_writer = (AsyncWriter(config.async_mode, background_staging=config.background_staging,
                                         process_group=self.background.group,
                                         thread_count=config.thread_count,
                                         write_timeout_s=config.effective_write_timeout_s)
                             if self.background is not None else None)
        self.collective.agree(self._prepare_root, what="preparing the checkpoint root",
                              error_type=ConfigError)
        check_shared_root(self.collective, self.root)  # node-local disks: ConfigError on every rank
        self.events = EventLog(config.event_log, self.rank)
        self.collective.agree(self._check_event_log, what="opening the event log", error_type=ConfigError)
        self.lock = RootLock(self.root, lease_s=config.lock_lease_s, renew=True) if config.lock else None
        if self.lock is not None:
            self.collective.agree(lambda: self.lock.acquire() if self.rank == 0 else None,
                                  what="locking the checkpoint root", error_type=CheckpointLockedError)
        self.discovery = CheckpointDiscovery(self.root, config, rank=self.rank, locked=self.lock is not None)
        try:
            self.collective.agree(self.discovery.check_existing, what="checking the root's existing checkpoints",
                                  error_type=ConfigError)
        except Exception:
            if self.lock is not None and self.rank == 0:
                self.lock.release()
            raise
        self.preemption = PreemptionWatcher(self.collective.group) if config.preemption else None
        self.preempted = False
        self._run_id = self.collective.broadcast(uuid.uuid4().hex[:8])
        self.local_world_size = local_world_size(self.collective)  # ranks sharing this node's disk
        self._save_count = 0
        self._rollback_from: int | None = None  # rank 0: set aside newer checkpoints at the next commit
        self._save_ctx = SaveContext(
            root=self.root, rank=self.rank, world_size=self.world_size, wrapper=self.wrapper,
            model_specs=self.model_specs, events=self.events, on_phase=on_phase, keep_last=config.keep_last,
            keep_every_steps=config.keep_every_steps, thread_count=config.thread_count,
            write_timeout_s=config.effective_write_timeout_s, before_commit=self._before_commit)

    @property
    def extra_state(self) -> dict[str, Any]:
        return self.state.extra_state

    # ------------------------------------------------------------------ setup
    def _prepare_root(self) -> None:
        if self.rank != 0:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"CheckpointConfig.root={str(self.root)!r} is not a writable directory: {e}") from e

    def _check_event_log(self) -> None:
        if self.events.path is None:
            return
        try:
            with open(self.events.path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise ConfigError(f"CheckpointConfig.event_log={self.events.path!r} (or $DISTCKPT_EVENT_LOG) "
                              f"cannot be appended to: {e}") from e

    # ------------------------------------------------------------------ load
    def load(self) -> TrainState | None:
        """Resume from the newest valid committed checkpoint (or ``config.load_path``).

        Rank 0 first removes staging directories and deletions left by a crash. A checkpoint is
        valid when its manifest is readable and every listed file exists with the recorded size.
        A ``load_path`` naming ``step-N`` of the root is a rollback: the root's newer checkpoints
        are renamed ``rolledback-step-M-<n>`` (kept; a warning lists them) at this run's first
        save, so a manager that only loads changes nothing.

        Returns:
            The restored :class:`TrainState`, or ``None`` when there is nothing to load (or
            ``config.load`` is false).

        Raises:
            CheckpointNotFoundError: ``config.load_path`` does not exist, or is a DCP directory
                without a distckpt manifest (import it with ``distckpt import``).
            CheckpointCorruptError: the newest checkpoint is invalid (a missing or truncated
                file, or a hash mismatch found while reading it) and
                ``config.fallback_to_older`` is false, or no committed checkpoint is loadable;
                names the file. With ``fallback_to_older`` the next older committed checkpoint
                is tried (a warning names the bad one), and loading it rewrites whatever the
                failed read had written.
            IncompatibleCheckpointError: the live model/optimizer/components do not match;
                lists every difference.
            CollectiveMismatchError: not every rank called ``load()`` within
                ``config.arrival_timeout_s``; names the ranks.
        """
        self._check_open()
        self.collective.arrive("load()", timeout_s=self.config.effective_arrival_timeout_s)
        self.wait()
        if not self.config.load:
            return None
        t0 = time.perf_counter()
        rejected: list[str] = []
        while True:
            path = self.collective.agree(lambda: self.discovery.choose(rejected), what="finding a checkpoint")
            path = self.collective.broadcast(path)
            if path is None:
                logger.info("no committed checkpoint in %s: starting fresh", self.root)
                return None
            try:
                train_state, manifest = self._load_checkpoint(path)
                break
            except CheckpointCorruptError as e:
                # A changed byte (same size) is only found while reading. Loading an older
                # checkpoint rewrites every tensor the failed read may have touched.
                if self.config.load_path is not None:
                    raise
                if not self.config.fallback_to_older:
                    raise CheckpointCorruptError(
                        f"{e} -- the newest checkpoint {path} is not loadable. Set fallback_to_older: "
                        "true to resume from the previous committed checkpoint, or restore the file; "
                        f"`distckpt verify {self.root}` lists every bad file. The live model and "
                        "optimizer may be partly overwritten: load again before training.",
                        path=e.path) from e
                if self.rank == 0:
                    logger.warning("%s -- falling back to the previous committed checkpoint "
                                   "(fallback_to_older=true)", e)
                rejected.append(path)
        rollback = self.discovery.rollback_step()
        if rollback is not None and self.collective.agree(
                lambda: self.discovery.plan_rollback(rollback), what=f"rolling back to {path}",
                error_type=ConfigError):
            self._rollback_from = rollback  # rank 0 sets the newer ones aside at its first commit
        train_state.checkpoint_path = str(path)
        train_state.saved_world_size = manifest.world_size
        self.train_state = train_state
        self.last_saved_step = train_state.step
        self.schedule.mark_saved()
        if self.rank == 0:
            logger.info("loaded %s (step %d, saved by %d ranks as %s, now %d ranks as %s) in %.2f s",
                        path, train_state.step, manifest.world_size, manifest.wrapper,
                        self.world_size, self.wrapper, time.perf_counter() - t0)
        # The caller's copy: later maybe_save calls update self.train_state, not this one.
        return dataclasses.replace(train_state, loss_history=list(train_state.loss_history))

    def _load_checkpoint(self, path: str) -> tuple[TrainState, Manifest]:
        """Read ``path`` into the live objects (every rank). Raises like :meth:`load`."""
        def read_plan_inputs() -> tuple[Manifest, set[str]]:
            manifest = Manifest.read(path)
            check_model_fits(manifest, path, self.model_specs, self.state.model_optim.ties)
            if self.config.verify_on_load:  # every rank plans from .metadata: check it first
                for f in manifest.files:
                    if f.path == ".metadata":
                        check_file(Path(path) / f.path, size_bytes=f.size_bytes, digest=f.hash)
            return manifest, set(read_dcp_metadata(path).state_dict_metadata)

        # Every rank reads these files itself (one node may see an I/O error the others do
        # not): agree, so all ranks raise together, and fall back together.
        manifest, keys = self.collective.agree(read_plan_inputs, what=f"reading {path}",
                                               error_type=CheckpointCorruptError)
        with self.state.model_optim.load_context():
            target = self.collective.agree(
                lambda: self.state.for_load(keys, manifest.world_size), what=f"planning the load of {path}")
            expected = ({f.path: (f.size_bytes, f.hash) for f in manifest.files}
                        if self.config.verify_on_load else None)
            self.events.emit("load", manifest.step, path=str(path))
            streams = max(1, self.config.load_streams_per_node // self.local_world_size)
            dcp_load(target, path, process_group=self.collective.group, expected_files=expected,
                     fast=self.config.fast_load, thread_count=streams)
            train_state = self.collective.agree(
                lambda: self.state.restore(target, saved_world_size=manifest.world_size),
                what=f"restoring {path}", error_type=IncompatibleCheckpointError)
        return train_state, manifest

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, *, loss: float | None = None, last_step: bool = False,
                   **counters: int) -> bool:
        """Record ``loss`` for ``step`` and save if the policy says so. Call once per step.

        Args:
            step: optimizer steps completed (global, the same on every rank).
            loss: this step's loss; pass the same (e.g. all-reduced) value on every rank.
            last_step: the final step of training: saves if ``config.save_at_end``.
            **counters: ``epoch``, ``batch_in_epoch``, ``global_samples_seen``,
                ``global_tokens_seen`` to record in :class:`TrainState`. With a
                ``ReshardableSampler`` the first three are derived from its consumed position
                at each save unless passed here (once passed, always the caller's).

        Returns:
            Whether a checkpoint was committed at this call.

        Raises:
            CheckpointSaveError: the save failed on some rank (raised on every rank); the
                previous checkpoint is intact and training may continue.
            CollectiveMismatchError: a save is due here but not every rank saved this step
                (see :meth:`save`).
        """
        self._check_open()
        self._record(step, loss, counters)
        if self.preemption is not None and self.preemption.agreed():
            return self._save_for_preemption(step)
        due = self.schedule.is_due(step) or (last_step and self.config.save_at_end)
        if not due or self.last_saved_step == step:
            return False
        self._save(step, full=last_step and self.config.full_at_end)
        return True

    def _save_for_preemption(self, step: int) -> bool:
        t0 = time.perf_counter()
        plan = self._plan_preemption(step)
        if self.rank == 0:
            logger.warning("preempted (SIGTERM) at step %d: %s", step, plan.reason)
        self.wait()  # the in-flight save completes and commits first
        saved = plan.action == "save" and self.last_saved_step != step
        if saved:
            self._save(step, blocking=True)
        self.preempted = True
        if self.rank == 0:
            logger.warning("preempted (SIGTERM): %s in %.2f s; %s",
                           f"saved step {step}" if saved else f"no save of step {step} (last saved: "
                           f"{self.last_saved_step})", time.perf_counter() - t0,
                           "exiting" if self.config.exit_on_preemption else "manager.preempted is set")
        if self.config.exit_on_preemption:
            self.close()
            self._tear_down_for_exit()
            raise SystemExit(0)
        return saved

    def _plan_preemption(self, step: int) -> PreemptionPlan:
        """The grace-window decision (:mod:`distckpt.grace`), the same on every rank: each
        rank's figures are gathered and the worst case of each is used."""
        inflight = self._inflight
        predicted = self.save_durations.predict()
        left = None
        if inflight is not None:  # committed already when its thread is done
            left = (max(0.0, (predicted or 0.0) - (time.perf_counter() - inflight.started))
                    if inflight.thread is not None and inflight.thread.is_alive() else 0.0)
        mine = (self.preemption.seconds_since_signal(), predicted, left)
        every = self.collective.all_gather(mine)
        known = [p for _, p, _ in every if p is not None]
        lefts = [x for _, _, x in every if x is not None]
        return plan_preemption(
            grace_s=self.config.preemption_grace_s, elapsed_s=max(e for e, _, _ in every),
            predicted_s=max(known) if known else None, inflight_left_s=max(lefts) if lefts else None,
            step_saved=self.last_saved_step == step)

    def _tear_down_for_exit(self) -> None:
        """Every rank is leaving together: destroy distckpt's gloo group and the default group
        after a barrier. gloo groups left to the interpreter's exit have aborted a rank here
        ("terminate called without an active exception", exit code -6) after a clean save."""
        if not self.collective.enabled:
            return
        try:
            self.collective.barrier()
            dist.destroy_process_group(self.collective.group)
            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; exiting anyway
            logger.warning("process group teardown before the preemption exit failed: %s", describe_exception(e))

    def _record(self, step: int, loss: float | None, counters: dict[str, int]) -> None:
        ts = self.train_state
        unknown = set(counters) - {"epoch", "batch_in_epoch", "global_samples_seen", "global_tokens_seen"}
        if unknown:
            raise TypeError(f"unknown counter(s) {sorted(unknown)}")
        ts.step = step
        self._explicit_counters.update(counters)
        for k, v in counters.items():
            setattr(ts, k, int(v))
        if loss is not None:
            ts.loss_history.append((step, float(loss)))
            del ts.loss_history[: -self.config.loss_history_len]

    def save(self, step: int, *, loss: float | None = None, **counters: int) -> Path:
        """Save the whole training state as ``step-<step>``.

        Protocol (:mod:`distckpt.transaction`): every rank writes into a staging directory;
        outcomes are gathered; on any failure the staging directory is removed and every rank
        raises; else rank 0 writes the manifest last, renames staging -> final, updates
        ``latest`` and applies retention; a final barrier. With ``async_mode`` off this all
        happens before the call returns; otherwise the call returns once the state is staged
        and the write and commit finish in the background (at most one save in flight: the
        next ``save``, :meth:`wait` or :meth:`close` waits for it and raises its error, on
        every rank).

        Returns:
            The checkpoint directory (committed when blocking; committed later when async).

        Raises:
            CheckpointSaveError: on every rank if any rank failed; nothing was committed.
            CollectiveMismatchError: not every rank called ``save`` with this ``step`` within
                ``config.arrival_timeout_s`` (names the ranks); nothing was written.
        """
        return self._save(step, loss=loss, counters=counters)

    def _save(self, step: int, *, loss: float | None = None, counters: dict[str, int] | None = None,
              blocking: bool = False, full: bool = False) -> Path:
        self._check_open()
        self.collective.arrive(f"save(step={step})", timeout_s=self.config.effective_arrival_timeout_s)
        if loss is not None or counters or step != self.train_state.step:
            self._record(step, loss, counters or {})
        self.wait()  # at most one save in flight
        # Unique per save without a collective: a run id agreed at construction + a counter.
        self._save_count += 1
        self.state.derive_counters(self.train_state, explicit=self._explicit_counters)
        snapshot = dataclasses.replace(self.train_state, loss_history=list(self.train_state.loss_history))
        full = full or self.config.state_dict_type == "full"
        tx = SaveTransaction(self._save_ctx, step=step, save_id=f"{self._run_id}{self._save_count:04x}",
                             train_state=snapshot, full=full)

        def build() -> dict[str, Any]:
            return self.state.for_save(snapshot, full_state_dict=full)

        self.last_saved_step = step
        self.schedule.mark_saved()
        if self.async_writer is None or blocking:
            tx.finish(self.collective, tx.write(build, self.collective))
            self.save_durations.record(time.perf_counter() - tx.t0)
            self.last_save_seconds = time.perf_counter() - tx.t0
            return tx.final
        upload, started = tx.start(build, self.async_writer)
        tx.agree_started(self.collective, started)  # a failure to start is raised now, on every rank
        inflight = _InFlight(step=step, started=tx.t0)

        def finish_in_background() -> None:
            try:
                tx.finish(self.background, tx.upload_outcome(upload, self.async_writer, started))
                self.save_durations.record(time.perf_counter() - tx.t0)
            except Exception as e:  # noqa: BLE001 - raised on the training thread by wait()
                inflight.error = e

        inflight.thread = threading.Thread(target=finish_in_background, name=f"distckpt-commit-{step}",
                                           daemon=True)
        inflight.thread.start()
        self._inflight = inflight
        self.last_save_seconds = time.perf_counter() - tx.t0
        return tx.final

    def _before_commit(self) -> None:
        """Rank 0, at the first commit after a rollback: set the root's newer checkpoints aside."""
        if self._rollback_from is not None:
            self.discovery.set_aside_newer(self._rollback_from)
            self._rollback_from = None

    # ------------------------------------------------------------------ lifecycle
    def wait_staged(self) -> None:
        """Block until the in-flight save's tensors are copied. With ``background_staging``,
        call it before ``optimizer.step()`` so parameters never change while being copied."""
        if self.async_writer is not None:
            self.async_writer.wait_staged()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or failed.

        Raises:
            CheckpointSaveError: the background save failed (on every rank); nothing of it
                was committed. Training may continue; the next save starts clean.
        """
        self._check_open()
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        self.wait_staged()
        inflight.thread.join()
        if inflight.error is not None:
            raise inflight.error

    def close(self) -> None:
        """Drain the in-flight save and release staging memory. Idempotent.

        Raises:
            CheckpointSaveError: the in-flight save failed.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self.async_writer is not None:
                self.async_writer.close()
            if self.preemption is not None:
                self.preemption.uninstall()
            if self.lock is not None and self.rank == 0:
                self.lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
