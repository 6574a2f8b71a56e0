"""``CheckpointManager``: the policy layer a training script talks to (docs/design.md, sections 1-2).

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
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ._adapters import check_model_and_optimizer, ddp_resume_not_bitwise, inner_optimizer, wrapper_kind
from ._config import READ_ONLY_SAVE, CheckpointConfig
from ._coord.collective import Collective
from ._coord.events import EventLog
from ._coord.topology import check_shared_root, elastic_store_warning, exchange_setup
from ._engine.blocking import gc_paused
from ._errors import ConfigError, ManagerClosedError
from ._load.discovery import CheckpointDiscovery
from ._load.loading import CheckpointLoader
from ._load.resume import ProbeFn, RunIdAndProbe
from ._memory import MemoryTier
from ._save.background import open_async_writer
from ._save.grace import SaveDurations, agree_on_signal
from ._save.preemption import PreemptionWatcher, StepVote
from ._save.schedule import SaveSchedule, check_step
from ._save.transaction import BackgroundSave, PhaseHook, Rollback, SaveContext, SaveTransaction
from ._state.train_state import TrainState
from ._state.training_state import CheckpointState
from ._storage import open_config_store
from ._storage.lock import RootLock

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores the whole training state through DCP with atomic commits.

    Every public method is collective: all ranks of ``process_group`` call it in the same
    order with the same ``step``.

    Args:
        config: policy (where, when, how many, FULL or SHARDED).
        model: the model, plain or wrapped (DDP, FSDP1, FSDP2, ``torch.compile``).
        optimizer: its optimizer, or ``None``.
        lr_scheduler: object with ``state_dict``/``load_state_dict`` (DCP's ``Stateful`` protocol; an
            ``LRScheduler``).
        grad_scaler: ``torch.amp.GradScaler``.
        dataloader: torchdata ``StatefulDataLoader``; with a
            :class:`~distckpt.data.ReshardableSampler` its position survives a world-size change.
        extra_state: ``{name: Stateful | plain value}`` saved alongside; after ``load()``
            plain values are in ``manager.extra_state``.
        process_group: ranks that checkpoint together; ``None`` = default group (or a
            single process when ``torch.distributed`` is not initialised).
        on_phase: ``on_phase(phase, step, rank)``, called on every rank before each phase of a save
            (:mod:`distckpt._save.transaction`): tracing and fault injection; on the background thread when async.
        probe, run_id: ``probe(model) -> loss`` on a fixed batch, compared after ``load()``; the tracker's
            run id kept across resumes (``None``: the checkpoint's, or new). :mod:`distckpt._load.resume`.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ConfigError: ``config`` fails its checks (:meth:`CheckpointConfig.validate`); ``optimizer`` holds
            parameters that are not ``model``'s; the root cannot be created or written (on every rank); or the
            run does not resume from the root (``load.enabled: false``, or ``load.path`` outside it) while the
            root holds checkpoints, and ``load.on_existing`` is not ``archive``.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Stateful | None = None,
        grad_scaler: Stateful | None = None,
        dataloader: Stateful | None = None,
        extra_state: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        on_phase: PhaseHook | None = None,
        probe: ProbeFn | None = None,
        run_id: str | None = None,
    ) -> None:
        config.validate()  # its sections may have been changed since it was built: checked again, before any use
        optimizer = inner_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: the optimizer it wraps
        check_model_and_optimizer(model, optimizer)  # an optimizer of another model: ConfigError now, not at a save
        self.config = config
        self.store = open_config_store(config)  # a plain path: POSIX; s3://bucket/prefix: S3
        self.root = self.store.root  # a location: str
        coord = config.coordination  # liveness_s: a heartbeat, so a save's entry check names a lost rank in seconds
        self.collective = Collective(process_group, timeout_s=coord.timeout_s, liveness_s=coord.liveness_timeout_s)
        self.rank, self.world_size = self.collective.rank, self.collective.world_size
        self.state = CheckpointState(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            grad_scaler=grad_scaler,
            rank=self.rank,
            dataloader=dataloader,
            extra_state=extra_state,
            world_size=self.world_size,
            elastic=config.elastic,
        )
        self.extras = RunIdAndProbe(probe=probe, run_id=run_id, model=model, collective=self.collective, config=config)
        self._explicit_counters: set[str] = set()  # passed by the caller: never derived
        self.schedule = SaveSchedule(config.schedule, collective=self.collective, store=self.store)
        self.wrapper = wrapper_kind(model)
        if self.rank == 0:  # pitfalls of the wrapper and of the launcher, said once
            for why in filter(None, (ddp_resume_not_bitwise(model, self.world_size), elastic_store_warning())):
                logger.warning("%s", why)
        self.last_saved_step: int | None = None
        self.last_save_seconds = 0.0
        self.save_durations = SaveDurations()  # predicts the preemption save (grace window)
        self._closed = False
        self._inflight: BackgroundSave | None = None
        read_only = not config.save.enabled
        self.background, self.async_writer = open_async_writer(config, process_group)
        self.discovery = CheckpointDiscovery(self.store, config, rank=self.rank, locked=coord.lock and not read_only)
        self.events = EventLog(coord.event_log, self.rank)
        self.lock = RootLock.of(self.store, lease_s=coord.lock_lease_s, renew=True) if self.discovery.locked else None
        try:  # one exchange (coord/topology.py); a restart loads without its initial-load options (restart.py)
            estimate = MemoryTier.setup_estimate(config, model, optimizer, self.world_size)  # bytes; 0: no tier
            self.config, self.setup = exchange_setup(
                self.collective, self.store, self._prepare, write=not read_only, estimate=estimate, run_id=run_id
            )
            self.discovery.config = self.extras.config = self.config
            check_shared_root(self.collective, self.store, self.setup, write=not read_only)  # node-local: ConfigError
        except Exception:
            if self.lock is not None and self.rank == 0:
                self.lock.release()
            raise
        self.extras.agreed(self.setup)
        self.train_state = TrainState(run_id=self.extras.run_id)
        self.preemption = PreemptionWatcher(self.collective.group) if config.effective_preemption else None
        self.vote = StepVote(self.collective, self.preemption, self.schedule, timeout_s=coord.timeout_s)
        self.preempted = False
        self.local_world_size = self.setup.local_world_size  # ranks sharing this node's disk
        self._save_count = 0
        self._rollback: Rollback | None = None  # rank 0: newer checkpoints set aside at the next commit
        self._save_ctx = SaveContext(
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            wrapper=self.wrapper,
            on_phase=on_phase,
            model_specs=self.state.model_optim.specs,
            events=self.events,
            retention=config.retention,
            save=config.save,
            initial_load=config.initial_load,
            write_timeout_s=coord.effective_write_timeout_s,
        )
        self.memory = MemoryTier.create(self.config, self.collective, self.setup, model, optimizer, self.wrapper)
        writer = self.async_writer
        self.state.guard.add(self.memory and self.memory.wait_copied, writer and writer.wait_staged)
        self.loader = CheckpointLoader(
            collective=self.collective,
            state=self.state,
            config=self.config,
            events=self.events,
            local_world_size=self.local_world_size,
            store=self.store,
            memory=self.memory,
        )

    def _prepare(self) -> CheckpointConfig:
        """The setup exchange's local part (rank 0: the root, its lock, the config this start runs with)."""
        self.discovery.prepare_root()
        self.events.check_appendable()
        if self.lock is not None and self.rank == 0:
            self.lock.acquire()
        return self.discovery.check_existing()

    @property
    def extra_state(self) -> dict[str, Any]:
        """The ``extra_state`` objects given at construction, by name (their state is saved and loaded)."""
        return self.state.extra_state

    # ------------------------------------------------------------------ load
    def load(self) -> TrainState | None:
        """Resume from the newest valid committed checkpoint (or ``config.load.path``/``load.step``),
        all of it or the parts ``load.only``/``load.exclude`` select.

        With ``memory.enabled``, a newer (or as new) complete snapshot in the nodes' memory serves
        first (docs/memory.md). Crash leftovers, validity, rollbacks: docs/resume.md.

        Returns:
            The restored :class:`TrainState`, or ``None`` when there is nothing to load (or
            ``config.load.enabled`` is false).

        Raises:
            CheckpointNotFoundError: ``config.load.path`` does not exist, or is a DCP directory without a
                distckpt manifest (import it with ``distckpt import``).
            CheckpointCorruptError: the newest checkpoint is invalid (a missing or truncated
                file, or a hash mismatch found while reading it) and
                ``config.load.fallback_to_older`` is false, or no committed checkpoint is loadable;
                names the file. With ``load.fallback_to_older`` the next older committed checkpoint
                is tried (a warning names the bad one), and loading it rewrites whatever the
                failed read had written.
            IncompatibleCheckpointError: the live model/optimizer/components do not match;
                lists every difference. Or the probe's loss differs from the saved one (both named).
            CollectiveMismatchError: not every rank called ``load()`` within
                ``config.coordination.arrival_timeout_s``; names the ranks.
        """
        self._check_open("load")
        self.collective.arrive("load()", timeout_s=self.config.coordination.effective_arrival_timeout_s)
        self.wait()
        if not self.config.load.enabled:
            return None
        t0 = time.perf_counter()
        found = self.loader.load(self.discovery)
        if found is None:
            logger.info("no committed checkpoint in %s: starting fresh", self.root)
            return None
        path, train_state, manifest = found
        rollback = self.discovery.rollback_step(loaded_step=manifest.step, resumed_step=train_state.step)
        if rollback is not None and self.collective.agree(
            lambda: self.discovery.plan_rollback(rollback), what=f"rolling back to {path}", error_type=ConfigError
        ):
            self._rollback = Rollback(rollback, by_load_path=self.discovery.load_location() is not None)
        self.extras.after_load(train_state, manifest, path, wrapper=self.wrapper, seconds=time.perf_counter() - t0)
        self.train_state = train_state
        self.last_saved_step = train_state.step
        self.schedule.resumed(manifest.interval)  # interval_steps: auto takes over the root's statistics
        return dataclasses.replace(train_state, loss_history=list(train_state.loss_history))  # the caller's copy

    # ------------------------------------------------------------------ save
    def maybe_save(
        self,
        step: int,
        *,
        loss: float | None = None,
        last_step: bool = False,
        metrics: dict[str, float] | None = None,
        **counters: int,
    ) -> bool:
        """Record ``loss`` for ``step`` and save if the policy says so. Call once per step.

        With several ranks a SIGTERM or a clock-based save acts one step later, agreed by the step
        vote (:class:`~distckpt._save.preemption.StepVote`), so a step with nothing due waits for no rank.

        Args:
            step: optimizer steps completed (global, the same on every rank).
            loss: this step's loss; pass the same (e.g. all-reduced) value on every rank.
            last_step: the final step of training: saves if ``config.schedule.save_at_end``.
            metrics: ``{name: number}`` of this step, the same on every rank; in the manifest (``retention.keep_best``).
            **counters: ``epoch``, ``batch_in_epoch``, ``global_samples_seen``,
                ``global_tokens_seen`` to record in :class:`TrainState`. With a
                ``ReshardableSampler`` the first three are derived from its consumed position
                at each save unless passed here (once passed, always the caller's).

        Returns:
            Whether a checkpoint was committed at this call.

        Raises:
            CheckpointSaveError: the save failed on some rank (raised on every rank); the
                previous checkpoint is intact and training may continue.
            CollectiveMismatchError: a save is due here but not every rank saved this step (see :meth:`save`).
        """
        if type(step) is not int:  # the common case costs no call: this runs at every step
            check_step(step, "maybe_save")
        self._check_open("maybe_save", step, save=True)
        self._record(step, loss, counters, metrics)
        if self.memory is not None:  # the memory tier's snapshot, before any durable save
            self.memory.maybe_snapshot(step, self.state, self.train_state, explicit=self._explicit_counters)
        vote = self.vote.decide(step)  # the previous boundary's vote: normally done by now
        if vote.preempt:
            return self._save_for_preemption(step)
        kind, full = ("final", self.config.schedule.full_at_end) if last_step else ("periodic", False)
        if saved := (vote.due or (last_step and self.config.schedule.save_at_end)) and self.last_saved_step != step:
            self._save(step, full=full, kind=kind)
        self.vote.start_next(step)
        return saved

    def _save_for_preemption(self, step: int) -> bool:
        t0 = time.perf_counter()
        plan = agree_on_signal(
            self.collective,
            self.preemption,
            self.save_durations,
            self._inflight,
            grace_s=self.config.preemption.grace_s,
            step_saved=self.last_saved_step == step,
        )
        if self.rank == 0:
            logger.warning("preempted (SIGTERM) at step %d: %s", step, plan.reason)
        self.wait()  # the in-flight save completes and commits first
        if saved := plan.action == "save" and self.last_saved_step != step:
            self._save(step, blocking=True, kind="preempted")
        self.preempted = True
        if self.rank == 0:
            logger.warning(plan.outcome(step, saved, self.last_saved_step, t0, self.config.preemption.exit))
        if self.config.preemption.exit:
            self.close()
            self.collective.tear_down_for_exit()
            raise SystemExit(0)
        return saved

    def _record(self, step: int, loss: float | None, counters: dict[str, int], metrics: dict | None = None) -> None:
        self.train_state.record(step, loss, counters, history_len=self.config.save.loss_history_len, metrics=metrics)
        self._explicit_counters.update(counters)

    def save(self, step: int, *, loss: float | None = None, metrics: dict | None = None, **counters: int) -> str:
        """Save the whole training state as ``step-<step>`` (``metrics`` as for :meth:`maybe_save`).

        The commit protocol is :class:`~distckpt._save.transaction.SaveTransaction`'s. With ``async_save.mode`` off it
        completes before the call returns; otherwise the call returns once the state is staged and the write and commit
        finish in the background (at most one save in flight: the next ``save``, :meth:`wait` or :meth:`close` waits for
        it and raises its error, on every rank).

        Returns:
            The checkpoint directory, on S3 its data-prefix URL (committed when blocking; later when async).

        Raises:
            CheckpointSaveError: on every rank if any rank failed; nothing was committed.
            CollectiveMismatchError: not every rank called ``save`` with this ``step`` within
                ``config.coordination.arrival_timeout_s`` (names the ranks); nothing was written.
            TypeError: ``step`` is not an ``int`` (also raised by :meth:`maybe_save`).
        """
        check_step(step, "save")
        return self._save(step, loss=loss, counters=counters, metrics=metrics)

    def _save(
        self,
        step: int,
        *,
        loss: float | None = None,
        counters: dict[str, int] | None = None,
        blocking: bool = False,
        full: bool = False,
        metrics: dict[str, float] | None = None,
        kind: str = "periodic",
    ) -> str:
        self._check_open("save", step, save=True)
        self.collective.arrive(f"save(step={step})", timeout_s=self.config.coordination.effective_arrival_timeout_s)
        if loss is not None or counters or metrics or step != self.train_state.step:
            self._record(step, loss, counters or {}, metrics)
        self.wait()  # at most one save in flight
        self._save_count += 1
        save_id = f"{self.setup.start_id[:8]}{self._save_count:04x}"  # the start id + a counter: no collective
        self.state.derive_counters(self.train_state, explicit=self._explicit_counters)
        self.extras.before_save(self.train_state)  # run id, probe loss (a forward on every rank)
        snapshot = dataclasses.replace(self.train_state, loss_history=list(self.train_state.loss_history))
        snapshot.interval = self.schedule.snapshot(kind)  # interval_steps: auto: recorded in the manifest
        full = full or self.config.save.state_dict_type == "full"
        tx = SaveTransaction(
            self._save_ctx, step=step, save_id=save_id, train_state=snapshot, full=full, rollback_from=self._rollback
        )

        def build() -> dict[str, Any]:
            return self.state.for_save(snapshot, full_state_dict=full)

        self.last_saved_step = step
        self.schedule.mark_saved()
        with gc_paused():  # the state_dict, plans, metadata, manifest: objects per tensor (blocking.gc_paused)
            if self.async_writer is None or blocking:
                tx.finish(self.collective, tx.write(build, self.collective))
                self.save_durations.record(time.perf_counter() - tx.t0)
            else:
                upload, started = tx.start(build, self.async_writer)
                tx.agree_started(self.collective, started)  # a failure to start is raised now, on every rank
                assert self.background is not None  # created with async_writer
                self._inflight = tx.finish_in_background(
                    self.background, upload, self.async_writer, started, on_committed=self.save_durations.record
                )
        self.last_save_seconds = time.perf_counter() - tx.t0  # the stall of an async save
        self.schedule.saved(self.last_save_seconds, None if blocking else self._inflight)
        return tx.final

    # ------------------------------------------------------------------ lifecycle
    def wait_staged(self) -> None:
        """Block until every copy of the state still in flight is done: the memory tier's snapshot
        and a background-staged save's tensors. ``optimizer.step()`` and the model's forward wait by
        themselves; call this only before changing the state in place some other way (a parameter
        edited under ``torch.no_grad()``). Returns at once when nothing is in flight."""
        self.state.guard.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or failed, and retention's file removal is done.

        Raises:
            CheckpointSaveError: the background save failed (on every rank); nothing of it
                was committed. Training may continue; the next save starts clean.
        """
        self._check_open("wait")
        self._save_ctx.purger.join()  # a blocking save's retention removes files in the background
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self.wait_staged()
            inflight.join()

    def close(self) -> None:
        """Drain the in-flight save, release the async staging buffers and the lock, and destroy
        distckpt's own gloo groups (after a barrier: every rank calls ``close``). Idempotent.
        Leaving a ``with`` block by an exception releases local resources only.

        Raises:
            CheckpointSaveError: the in-flight save failed.
        """
        self._close(tear_down=True)

    def _close(self, *, tear_down: bool) -> None:
        if self._closed:
            return
        try:
            self.vote.close(tear_down=tear_down)  # every rank is here: the last boundary's vote completes
            self.wait()
        finally:
            self._closed = True
            if self.async_writer is not None:
                self.async_writer.close()
            if self.memory is not None:
                self.memory.close(free=tear_down)  # after an exception: kept for the restart
            self.state.guard.remove()
            self.vote.uninstall()  # the SIGTERM handler
            if self.lock is not None and self.rank == 0:
                self.lock.release()
        for collective in filter(None, (self.background, self.collective)):  # after an exception: no heartbeat
            collective.close() if tear_down else collective.stop_heartbeat()

    def _check_open(self, call: str, step: int | None = None, *, save: bool = False) -> None:
        if self._closed:
            call += "()" if step is None else f"(step={step})"
            raise ManagerClosedError(
                f"CheckpointManager(root={self.root!r}) is closed: {call} came after close() or its `with` block; "
                "call it before closing, or build a new CheckpointManager on the root to go on"
            )
        if save and not self.config.save.enabled:
            raise ConfigError(READ_ONLY_SAVE)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(tear_down=exc_type is None)  # after an exception the peers may not be here
