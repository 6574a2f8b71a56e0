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
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import __version__
from .adapters import tensor_specs, wrapper_kind
from .collective import Collective
from .commit import commit, delete_checkpoint, find_committed, list_files, remove_leftovers, set_aside, validate
from .config import CheckpointConfig
from .events import EventLog
from .grace import PreemptionPlan, SaveDurations, plan_preemption
from .engine import AsyncWriter, dcp_load, dcp_save, read_dcp_metadata
from .engine.blocking import describe_exception
from .errors import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    IncompatibleCheckpointError,
)
from .integrity import check_file, hash_file
from .layout import checkpoint_name, staging_name
from .lock import RootLock
from .manifest import Manifest, model_fingerprint
from .preemption import PreemptionWatcher
from .retention import steps_to_delete
from .schedule import SaveSchedule
from .state import CheckpointState, TrainState
from .topology import check_shared_root, local_world_size

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

    Raises:
        ConfigError: the root directory cannot be created or written (on every rank).
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
        self.schedule = SaveSchedule(interval_steps=config.interval_steps,
                                     interval_seconds=config.interval_seconds,
                                     collective=self.collective)
        self.wrapper = wrapper_kind(model)
        self.model_specs = tensor_specs(model)
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
        self.preemption = PreemptionWatcher(self.collective.group) if config.preemption else None
        self.preempted = False
        self._run_id = self.collective.broadcast(uuid.uuid4().hex[:8])
        self.local_world_size = local_world_size(self.collective)  # ranks sharing this node's disk
        self._save_count = 0

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

        Rank 0 first removes staging directories left by a crash. A checkpoint is valid when
        its manifest is readable and every listed file exists with the recorded size.

        Returns:
            The restored :class:`TrainState`, or ``None`` when there is nothing to load (or
            ``config.load`` is false).

        Raises:
            CheckpointNotFoundError: ``config.load_path`` does not exist.
            CheckpointCorruptError: the newest checkpoint is invalid (a missing or truncated
                file, or a hash mismatch found while reading it) and
                ``config.fallback_to_older`` is false, or no committed checkpoint is loadable;
                names the file. With ``fallback_to_older`` the next older committed checkpoint
                is tried (a warning names the bad one), and loading it rewrites whatever the
                failed read had written.
            IncompatibleCheckpointError: the live model/optimizer/components do not match;
                lists every difference.
        """
        self.wait()
        if not self.config.load:
            return None
        t0 = time.perf_counter()
        rejected: list[str] = []
        while True:
            path = self.collective.agree(lambda: self._choose_checkpoint(rejected), what="finding a checkpoint")
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
            self._check_model(manifest, path)
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

    def _choose_checkpoint(self, rejected: list[str]) -> str | None:
        """Rank 0 picks the checkpoint; other ranks return ``None`` (then broadcast)."""
        if self.rank != 0:
            return None
        for name in (remove_leftovers(self.root) if self.lock is not None else []):
            logger.warning("removed %s left by an interrupted save or delete", self.root / name)
        if self.config.load_path is not None:
            p = Path(self.config.load_path)
            if not p.is_dir():
                raise CheckpointNotFoundError(f"CheckpointConfig.load_path={str(p)!r} does not exist")
            validate(p)
            return str(p)
        newest_error: CheckpointCorruptError | None = None
        for step, p, result in find_committed(self.root):
            if str(p) in rejected:
                result = CheckpointCorruptError(f"{p}: failed to load", path=str(p))
            elif isinstance(result, Manifest):
                if newest_error is not None:
                    logger.warning("newest checkpoint is corrupt (%s); falling back to %s "
                                   "(fallback_to_older=true)", newest_error, p)
                return str(p)
            if not self.config.fallback_to_older:
                raise CheckpointCorruptError(
                    f"{result} -- the newest checkpoint {p} is not loadable. Set "
                    "fallback_to_older: true to resume from the previous committed checkpoint, "
                    f"or remove {p}.", path=result.path)
            newest_error = newest_error or result
            if self.lock is not None:  # the run will save this step again: move it out of the way
                logger.warning("set aside corrupt checkpoint %s as %s", p, set_aside(p))
        if newest_error is not None:  # never start fresh silently over a run's checkpoints
            raise CheckpointCorruptError(
                f"no committed checkpoint in {self.root} is loadable (newest problem: {newest_error}). "
                "Restore the files, point load_path at a good copy, or move the root away to start "
                "fresh.", path=newest_error.path)
        return None

    def _check_model(self, manifest: Manifest, path: str) -> None:
        """Compare the manifest's fingerprint with the live model before touching anything."""
        if manifest.model_fingerprint == model_fingerprint(self.model_specs):
            return
        saved, live = manifest.model, self.model_specs
        missing = sorted(set(live) - set(saved))
        unexpected = sorted(set(saved) - set(live))
        mismatched = []
        for key in sorted(set(saved) & set(live)):
            for what in ("shape", "dtype"):
                a, b = getattr(saved[key], what), getattr(live[key], what)
                if list(a) != list(b) if what == "shape" else a != b:
                    mismatched.append((key, what, str(a), str(b)))
        lines = [f"checkpoint {path} does not fit the live model:"]
        lines += [f"  missing in checkpoint: {k}" for k in missing]
        lines += [f"  unexpected (in checkpoint, not in model): {k}" for k in unexpected]
        lines += [f"  {what} mismatch for {k}: checkpoint {a}, model {b}" for k, what, a, b in mismatched]
        lines.append("Load into the same architecture (a renamed layer or changed size/dtype needs "
                     "an explicit conversion; distckpt never casts or drops weights silently).")
        raise IncompatibleCheckpointError("\n".join(lines), missing=missing, unexpected=unexpected,
                                          mismatched=mismatched)

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, *, loss: float | None = None, last_step: bool = False,
                   **counters: int) -> bool:
        """Record ``loss`` for ``step`` and save if the policy says so. Call once per step.

        Args:
            step: optimizer steps completed (global, the same on every rank).
            loss: this step's loss; pass the same (e.g. all-reduced) value on every rank.
            last_step: the final step of training: saves if ``config.save_at_end``.
            **counters: ``epoch``, ``batch_in_epoch``, ``global_samples_seen``,
                ``global_tokens_seen`` to record in :class:`TrainState`.

        Returns:
            Whether a checkpoint was committed at this call.

        Raises:
            CheckpointSaveError: the save failed on some rank (raised on every rank); the
                previous checkpoint is intact and training may continue.
        """
        self._check_open()
        self._record(step, loss, counters)
        if self.preemption is not None and self.preemption.agreed():
            return self._save_for_preemption(step)
        due = self.schedule.is_due(step) or (last_step and self.config.save_at_end)
        if not due or self.last_saved_step == step:
            return False
        self.save(step, _full=last_step and self.config.full_at_end)
        return True

    def _save_for_preemption(self, step: int) -> bool:
        t0 = time.perf_counter()
        plan = self._plan_preemption(step)
        if self.rank == 0:
            logger.warning("preempted (SIGTERM) at step %d: %s", step, plan.reason)
        self.wait()  # the in-flight save completes and commits first
        saved = plan.action == "save" and self.last_saved_step != step
        if saved:
            self.save(step, _blocking=True)
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
        for k, v in counters.items():
            setattr(ts, k, int(v))
        if loss is not None:
            ts.loss_history.append((step, float(loss)))
            del ts.loss_history[: -self.config.loss_history_len]

    def save(self, step: int, *, loss: float | None = None, _blocking: bool = False, _full: bool = False,
             **counters: int) -> Path:
        """Save the whole training state as ``step-<step>``.

        Protocol (DESIGN section 4): every rank writes into a staging directory; outcomes are
        gathered; on any failure the staging directory is removed and every rank raises; else
        rank 0 writes the manifest last, renames staging -> final, updates ``latest`` and
        applies retention; a final barrier. With ``async_mode`` off this all happens before
        the call returns; otherwise the call returns once the state is staged and the write
        and commit finish in the background (at most one save in flight: the next ``save``,
        :meth:`wait` or :meth:`close` waits for it and raises its error, on every rank).

        Returns:
            The checkpoint directory (committed when blocking; committed later when async).

        Raises:
            CheckpointSaveError: on every rank if any rank failed; nothing was committed.
        """
        self._check_open()
        if loss is not None or counters or step != self.train_state.step:
            self._record(step, loss, counters)
        self.wait()  # at most one save in flight
        t0 = time.perf_counter()
        # Unique per save without a collective: a run id agreed at construction + a counter.
        self._save_count += 1
        save_id = f"{self._run_id}{self._save_count:04x}"
        staging = self.root / staging_name(step, save_id)
        final = self.root / checkpoint_name(step)
        snapshot = dataclasses.replace(self.train_state, loss_history=list(self.train_state.loss_history))
        error, t_stage, upload, written = None, 0.0, None, {}
        blocking = self.async_writer is None or _blocking
        full = self.config.state_dict_type == "full" or _full
        try:
            self.events.emit("stage", step)
            sd = self.state.for_save(snapshot, full_state_dict=full)
            self.events.emit("write", step, staging=str(staging), blocking=blocking)
            staging.mkdir(parents=True, exist_ok=True)
            if blocking:
                t_stage = time.perf_counter() - t0
                written = dcp_save(sd, staging, process_group=self.collective.group,
                                   thread_count=self.config.thread_count,
                                   write_timeout_s=self.config.effective_write_timeout_s)
            else:
                upload = self.async_writer.start(sd, staging)
                t_stage = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - gathered below
            error = describe_exception(e)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = describe_exception(e)
        self.last_saved_step = step
        self.schedule.mark_saved()
        if blocking:
            self._finalize(self.collective, step, staging, final, snapshot, t0,
                           (error, t_stage, time.perf_counter() - t0 - t_stage, written), full)
            self.last_save_seconds = time.perf_counter() - t0
            return final
        # Failures before the background part are agreed on now, on the main group.
        failures = {r: e for r, e in enumerate(self.collective.all_gather(error)) if e is not None}
        if failures:
            self._abort(self.collective, staging)
            raise self._save_error(step, failures)
        inflight = _InFlight(step=step, started=t0)
        inflight.thread = threading.Thread(
            target=self._finalize_in_background, name=f"distckpt-commit-{step}", daemon=True,
            args=(inflight, upload, step, staging, final, snapshot, t0, t_stage, full))
        inflight.thread.start()
        self._inflight = inflight
        self.last_save_seconds = time.perf_counter() - t0
        return final

    def _finalize_in_background(self, inflight, upload, step, staging, final, snapshot, t0, t_stage,
                                full) -> None:
        error, written = None, {}
        try:
            upload.result()
            written = self.async_writer.written_files(staging, self.rank)
        except BaseException as e:  # noqa: BLE001 - DCP raises BaseException subclasses
            error = describe_exception(e)
        try:
            self._finalize(self.background, step, staging, final, snapshot, t0,
                           (error, t_stage, time.perf_counter() - t0 - t_stage, written), full)
        except Exception as e:  # noqa: BLE001 - raised on the training thread by wait()
            inflight.error = e

    def _finalize(self, collective: Collective, step: int, staging: Path, final: Path,
                  snapshot: TrainState, t0: float,
                  outcome: tuple[str | None, float, float, dict[str, tuple[int, str]]],
                  full: bool) -> None:
        """Steps 2-4 of the commit protocol over ``collective``; raises on every rank."""
        outcomes = collective.all_gather(outcome)
        failures = {r: o[0] for r, o in enumerate(outcomes) if o[0] is not None}
        if failures:
            self._abort(collective, staging)
            raise self._save_error(step, failures)
        timings = {"stage": max(o[1] for o in outcomes), "write": max(o[2] for o in outcomes)}
        written = {name: entry for o in outcomes for name, entry in o[3].items()}
        commit_error = (self._commit(step, staging, final, snapshot, timings, written, full)
                        if self.rank == 0 else None)
        commit_error = collective.broadcast(commit_error)
        if commit_error is not None:
            self._abort(collective, staging)
            raise self._save_error(step, {0: f"commit: {commit_error}"})
        collective.barrier()
        self.save_durations.record(time.perf_counter() - t0)
        self.events.emit("committed", step, seconds=time.perf_counter() - t0)
        if self.rank == 0:
            logger.info("committed %s: %.3f s after the save call (stage %.3f s, write %.3f s)",
                        final, time.perf_counter() - t0, timings["stage"], timings["write"])

    def _save_error(self, step: int, failures: dict[int, str]) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"save of step {step} failed on rank(s) {sorted(failures)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in failures.items())
            + f". Nothing was committed; previous checkpoints in {self.root} are intact.",
            failures=failures)

    def _commit(self, step: int, staging: Path, final: Path, ts: TrainState,
                timings: dict[str, float], written: dict[str, tuple[int, str]], full: bool) -> str | None:
        """Rank 0: manifest, rename, ``latest``, retention. Returns an error string or ``None``."""
        t0 = time.perf_counter()
        try:
            timings = dict(timings, commit=0.0)
            manifest = Manifest(
                step=step, epoch=ts.epoch, global_samples_seen=ts.global_samples_seen,
                wall_time=time.time(), world_size=self.world_size, wrapper=self.wrapper,
                state_dict_type="full" if full else "sharded", torch_version=torch.__version__,
                distckpt_version=__version__, model=self.model_specs,
                model_fingerprint=model_fingerprint(self.model_specs),
                loss=ts.loss_history[-1][1] if ts.loss_history and ts.loss_history[-1][0] == step else None,
                timings_s=timings, files=list_files(staging, written))
            for entry in manifest.files:
                if entry.hash is None:  # no writer reported it: hash it here rather than skip it
                    logger.warning("no writer reported a hash for %s; hashing it on rank 0", entry.path)
                    entry.hash = hash_file(staging / entry.path)[1]
            timings["commit"] = time.perf_counter() - t0  # up to the manifest write
            commit(staging, final, manifest, on_phase=lambda phase: self.events.emit(phase, step))
        except Exception as e:  # noqa: BLE001 - broadcast to every rank
            return describe_exception(e)
        try:
            self._apply_retention()
        except OSError as e:  # a failed delete never fails the save that just committed
            logger.error("retention failed in %s: %s", self.root, e)
        return None

    def _apply_retention(self) -> None:
        committed = [s for s, _, r in find_committed(self.root) if isinstance(r, Manifest)]
        for step in steps_to_delete(committed, keep_last=self.config.keep_last,
                                    keep_every_steps=self.config.keep_every_steps):
            self.events.emit("retention", step)
            delete_checkpoint(self.root / checkpoint_name(step))
            logger.info("retention: deleted %s", self.root / checkpoint_name(step))

    def _abort(self, collective: Collective, staging: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        collective.barrier()

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
