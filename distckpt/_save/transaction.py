"""One save, end to end: the commit protocol (docs/design.md, section 4).

A :class:`SaveTransaction` owns the whole sequence for one step, on every rank::

    stage -> write (blocking, or started in the background) -> outcomes gathered on rank 0
          -> rank 0: manifest -> rename -> latest -> retention -> final barrier

Blocking and async saves run the same object: a blocking save calls :meth:`write` then
:meth:`finish` on the training thread; an async save calls :meth:`start` on the training
thread, :meth:`agree_started` (so a failure to start is raised at once, on every rank), and
:meth:`upload_outcome` + :meth:`finish` on a background thread over its own gloo group.

At each phase the transaction emits an event (:class:`~distckpt._coord.events.EventLog`) and calls
the ``on_phase(phase, step, rank)`` hook, *before* the phase acts. Phases: ``stage``,
``write``, ``manifest``, ``rename``, ``latest``, ``retention`` (once per deleted checkpoint,
with that checkpoint's step), ``committed``. The hook is the supported seam for fault
injection and tracing: a hook that sleeps widens the on-disk state before each phase, one that
raises or kills the process lands in it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Protocol

import torch

from .._config import RetentionConfig, SaveConfig
from .._coord.collective import Collective
from .._coord.events import EventLog
from .._coord.topology import hardware_summary
from .._engine import dcp_save
from .._engine.blocking import describe_exception
from .._errors import CheckpointSaveError
from .._ondisk.layout import checkpoint_name
from .._ondisk.manifest import Manifest, TensorSpec, model_fingerprint
from .._state.train_state import TrainState
from .._storage import CheckpointStore
from .._version import __version__
from .purge import Purger
from .retention import KnownCheckpoints, best_steps, steps_to_delete

__all__ = ["BackgroundSave", "PHASES", "PhaseHook", "RankOutcome", "Rollback", "SaveContext", "SaveTransaction"]

logger = logging.getLogger(__name__)

PHASES = ("stage", "write", "manifest", "rename", "latest", "retention", "committed")  # passed to on_phase, in order


class PhaseHook(Protocol):
    """``on_phase(phase, step, rank)``, called before each phase of a save acts."""

    def __call__(self, phase: str, step: int, rank: int) -> None:
        """Called on ``rank`` before ``phase`` (one of :data:`PHASES`) of the save of ``step`` acts."""
        ...


@dataclasses.dataclass
class RankOutcome:
    """What one rank reports after its write phase; gathered on rank 0 only.

    Attributes:
        error: ``None`` on success, else a one-line description of what failed on this rank.
        stage_s: seconds from the save call until the state was handed to the writer.
        write_s: seconds of the write phase (for async: until the background write finished).
        files: ``{path relative to the checkpoint: (size_bytes, xxh3-128 hex digest)}`` this
            rank wrote, its digest file included (the block digests stay in that file:
            :meth:`~distckpt._storage.base.CheckpointStore.write_digests`).
    """

    error: str | None
    stage_s: float = 0.0
    write_s: float = 0.0
    files: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Rollback:
    """A rollback of the root to ``step``, pending until this run's first commit (rank 0): the root's
    newer checkpoints are set aside then, so this run's steps and ``latest`` are its own.

    Attributes:
        step: the step the run resumed from; the root's checkpoints above it are set aside as
            ``rolledback-step-M-<n>`` (kept, never loaded or deleted).
        by_load_path: the rollback was asked for by ``load.path`` / ``load.step`` (this run's
            checkpoints record them: said in the warning).
        done: set by the commit that set them aside; later commits leave the root alone.
    """

    step: int
    by_load_path: bool = False
    done: bool = False


@dataclasses.dataclass
class SaveContext:
    """What every save of one manager shares (built once by the manager).

    Attributes:
        store: the root's storage (:mod:`distckpt._storage`); every save goes through it.
        rank, world_size: of the checkpointing process group.
        wrapper: wrapper kind recorded in the manifest (``ddp``, ``fsdp2+compile``, ...).
        model_specs: gives ``{fqn: TensorSpec}`` of the live model (manifest + fingerprint), called at the commit.
        events: this rank's event log.
        on_phase: the user's phase hook, or ``None``.
        retention: ``CheckpointConfig.retention``: ``keep_last``, ``keep_every_steps``, best-K
            retention by a metric of the manifests (``keep_best``).
        save: ``CheckpointConfig.save``: writer threads per rank (``thread_count``), incremental
            saves (``incremental``, ``full_every``; :mod:`distckpt._storage.incremental`).
        write_timeout_s: deadline of one rank's blocking write phase (seconds;
            ``CheckpointConfig.coordination.effective_write_timeout_s``).
        purger: removes the files of checkpoints retention deleted, in the background (rank 0,
            POSIX); joined before the next retention, by ``BackgroundSave`` and the manager's ``wait``.
        initial_load: the run's initial-load options, recorded in every manifest (:mod:`distckpt._load.restart`).
        known: rank 0's validated committed checkpoints, kept between saves for retention.
    """

    store: CheckpointStore
    rank: int
    world_size: int
    wrapper: str
    model_specs: Callable[[], dict[str, TensorSpec]]
    events: EventLog
    on_phase: PhaseHook | None
    retention: RetentionConfig
    save: SaveConfig
    write_timeout_s: float
    purger: Purger = dataclasses.field(default_factory=Purger)
    initial_load: dict[str, Any] | None = None
    known: KnownCheckpoints = dataclasses.field(default_factory=KnownCheckpoints)


class SaveTransaction:
    """The save of one ``step``; see the module docstring for the call order.

    Args:
        ctx: the manager's shared save settings.
        step: global step saved (the checkpoint is ``step-<step>``).
        save_id: unique per save (names the pending directory).
        train_state: counters and loss history to save (a snapshot: not mutated later).
        full: FULL model/optimizer state dict instead of SHARDED (recorded in the manifest).
        rollback_from: a rollback whose newer checkpoints rank 0 sets aside before this commit,
            unless done (``None``: none).
    """

    def __init__(
        self,
        ctx: SaveContext,
        *,
        step: int,
        save_id: str,
        train_state: TrainState,
        full: bool,
        rollback_from: Rollback | None = None,
    ) -> None:
        self.ctx, self.step, self.train_state, self.full = ctx, step, train_state, full
        self.rollback_from = rollback_from
        self.store = ctx.store
        self.pending = self.store.pending_location(step, save_id)  # a location: a path or a URL
        self.final = self.store.final_location(step, self.pending)
        self.t0 = time.perf_counter()

    def phase(self, name: str, step: int | None = None, **fields: Any) -> None:
        """Emit the event of phase ``name`` and call the hook (before the phase acts)."""
        step = self.step if step is None else step
        self.ctx.events.emit(name, step, **fields)
        if self.ctx.on_phase is not None:
            self.ctx.on_phase(name, step, self.ctx.rank)

    # ------------------------------------------------------------------ write
    def write(self, build_state_dict: Callable[[], dict[str, Any]], collective: Collective) -> RankOutcome:
        """Stage and write this rank's part, blocking. Never raises for a failed write: the
        failure is in the outcome, so every rank reaches :meth:`finish` and agrees."""
        t_stage = 0.0
        try:
            self.phase("stage")
            sd = build_state_dict()
            self.phase("write", pending=self.pending, blocking=True)
            self.store.begin_write(self.pending)
            t_stage = time.perf_counter() - self.t0
            files = dcp_save(
                sd,
                self.pending,
                process_group=collective.group,
                thread_count=self.ctx.save.thread_count,
                write_timeout_s=self.ctx.write_timeout_s,
                writer=self._writer(),
            )
            files = self.store.write_digests(self.pending, self.ctx.rank, files)
            return RankOutcome(None, t_stage, time.perf_counter() - self.t0 - t_stage, files)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            return RankOutcome(describe_exception(e), t_stage, time.perf_counter() - self.t0 - t_stage)

    def start(self, build_state_dict: Callable[[], dict[str, Any]], async_writer: Any) -> tuple[Any, RankOutcome]:
        """Stage and start the background write (``AsyncWriter.start``).

        Returns:
            ``(upload future or None, outcome so far)``; the outcome's error is set when
            staging or starting failed on this rank.
        """
        try:
            self.phase("stage")
            sd = build_state_dict()
            self.phase("write", pending=self.pending, blocking=False)
            self.store.begin_write(self.pending)
            upload = async_writer.start(sd, self.pending, writer=self._writer())
            return upload, RankOutcome(None, time.perf_counter() - self.t0)
        except BaseException as e:  # noqa: BLE001 - as in write()
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            return None, RankOutcome(describe_exception(e), time.perf_counter() - self.t0)

    def _incremental(self) -> tuple[int, int | None] | None:
        """``(step, full_every)`` of an incremental save (``None``: not incremental)."""
        if not self.ctx.save.incremental:
            return None
        return self.step, self.ctx.save.full_every

    def _writer(self) -> Any:
        """The store's DCP writer for this save (incremental when configured)."""
        return self.store.dcp_writer(
            self.pending,
            thread_count=self.ctx.save.thread_count,
            write_timeout_s=self.ctx.write_timeout_s,
            incremental=self._incremental(),
        )

    def agree_started(self, collective: Collective, outcome: RankOutcome) -> None:
        """All ranks agree that the background write started everywhere (training thread).

        Raises:
            CheckpointSaveError: on every rank, when any rank failed to stage or start;
                the pending directory is removed.
        """
        failures = {r: e for r, e in enumerate(collective.all_gather(outcome.error)) if e is not None}
        if failures:
            self._abort(collective)
            raise self.error(failures)

    def finish_in_background(
        self,
        collective: Collective,
        upload: Any,
        async_writer: Any,
        started: RankOutcome,
        on_committed: Callable[[float], None] | None = None,
    ) -> "BackgroundSave":
        """Wait for the upload and :meth:`finish` over ``collective`` on a daemon thread;
        ``on_committed(seconds from the save call)`` runs there after the commit."""
        return BackgroundSave(
            self, lambda: self.finish(collective, self.upload_outcome(upload, async_writer, started)), on_committed
        )

    def upload_outcome(self, upload: Any, async_writer: Any, started: RankOutcome) -> RankOutcome:
        """Wait for the background write (background thread); never raises."""
        try:
            upload.result()
            files = async_writer.written_files(self.pending, self.ctx.rank)
            files = self.store.write_digests(self.pending, self.ctx.rank, files)
            return dataclasses.replace(started, write_s=time.perf_counter() - self.t0 - started.stage_s, files=files)
        except BaseException as e:  # noqa: BLE001 - DCP raises BaseException subclasses
            return dataclasses.replace(
                started, error=describe_exception(e), write_s=time.perf_counter() - self.t0 - started.stage_s
            )

    # ------------------------------------------------------------------ commit
    def finish(self, collective: Collective, outcome: RankOutcome) -> None:
        """Gather every rank's outcome on rank 0; abort, or commit on rank 0; final barrier.

        Raises:
            CheckpointSaveError: on every rank, when any rank's write or rank 0's commit
                failed; nothing of this save is committed and the previous checkpoints are
                intact.
        """
        outcomes: list[RankOutcome] | None = collective.gather(outcome)  # rank 0 only: no rank gets every file
        failures: dict[int, str] = {}
        commit_error, timings = None, {"stage": 0.0, "write": 0.0}
        if outcomes is not None:
            failures = {r: o.error for r, o in enumerate(outcomes) if o.error is not None}
            timings = {"stage": max(o.stage_s for o in outcomes), "write": max(o.write_s for o in outcomes)}
            if not failures:
                commit_error = self._commit(timings, {name: e for o in outcomes for name, e in o.files.items()})
        failures, commit_error = collective.broadcast((failures, commit_error))
        if failures:
            self._abort(collective)
            raise self.error(failures)
        if commit_error is not None:
            self._abort(collective)
            raise self.error({0: f"commit: {commit_error}"})
        collective.barrier()
        self.phase("committed", seconds=time.perf_counter() - self.t0)
        if self.ctx.rank == 0:
            logger.info(
                "committed %s: %.3f s after the save call (stage %.3f s, write %.3f s)",
                self.final,
                time.perf_counter() - self.t0,
                timings["stage"],
                timings["write"],
            )

    def error(self, failures: dict[int, str]) -> CheckpointSaveError:
        """The error every rank raises when ``failures`` (``{rank: why}``) is not empty."""
        return CheckpointSaveError(
            f"save of step {self.step} failed on rank(s) {sorted(failures)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in failures.items())
            + f". Nothing was committed; previous checkpoints in {self.store.root} are intact.",
            failures=failures,
        )

    def _manifest(self, timings: dict[str, float], files: dict[str, tuple[int, str]]) -> Manifest:
        ts, ctx = self.train_state, self.ctx
        manifest = Manifest(
            step=self.step,
            epoch=ts.epoch,
            global_samples_seen=ts.global_samples_seen,
            wall_time=time.time(),
            world_size=ctx.world_size,
            wrapper=ctx.wrapper,
            state_dict_type="full" if self.full else "sharded",
            torch_version=torch.__version__,
            distckpt_version=__version__,
            model=ctx.model_specs(),
            model_fingerprint=model_fingerprint(ctx.model_specs()),
            loss=ts.loss_history[-1][1] if ts.loss_history and ts.loss_history[-1][0] == self.step else None,
            timings_s=timings,
            files=self.store.list_files(self.pending, files, references=ctx.save.incremental),
            run_id=ts.run_id,
            metrics=dict(ts.metrics),
            probe_loss=ts.probe_loss,
            hardware=hardware_summary(),
            batch_change=ts.batch_change,
            initial_load=ctx.initial_load,
            interval=ts.interval,
        )
        return manifest

    def _commit(self, timings: dict[str, float], files: dict[str, tuple[int, str]]) -> str | None:
        """Rank 0: manifest, rename, ``latest``, retention. Returns an error string or ``None``."""
        t0 = time.perf_counter()
        try:
            timings = dict(timings, commit=0.0)
            manifest = self._manifest(timings, files)
            manifest.timings_s["commit"] = time.perf_counter() - t0  # up to the manifest write
            if self.rollback_from is not None and not self.rollback_from.done:
                self._set_aside_newer(self.rollback_from)
            self.store.commit(self.pending, self.step, manifest, on_phase=self.phase)
        except Exception as e:  # noqa: BLE001 - broadcast to every rank
            return describe_exception(e)
        try:
            self._apply_retention(manifest)
        except OSError as e:  # a failed delete never fails the save that just committed
            logger.error("retention failed in %s: %s", self.store.root, e)
        return None

    def _set_aside_newer(self, rollback: Rollback) -> None:
        """Rank 0, before the first commit after a rollback: set the root's newer checkpoints aside."""
        moved = [
            f"{checkpoint_name(s)} -> {self.store.set_aside(s, 'rolledback')}"
            for s in self.store.committed_steps()
            if s > rollback.step
        ]  # set_aside leaves `latest` naming a committed checkpoint
        rollback.done = True
        if moved:
            again = (
                "This run's checkpoints record load.path/load.step: a restart with the same config resumes "
                "them, not the rollback."
                if rollback.by_load_path
                else ""
            )
            logger.warning(
                "rollback to %s: set aside %d newer checkpoint(s), kept: %s. %s",
                checkpoint_name(rollback.step),
                len(moved),
                ", ".join(moved),
                again,
            )

    def _apply_retention(self, manifest: Manifest) -> None:
        root = self.store.root
        manifests = self.ctx.known.committed(self.store, new=(self.step, manifest))
        committed = list(manifests)
        best, kb = [], self.ctx.retention.keep_best
        if kb is not None and (best := best_steps({s: m.metrics for s, m in manifests.items() if s <= self.step}, kb)):
            logger.info(
                "retention: keeps the best %d by %s (%s): %s",
                kb.k,
                kb.metric,
                kb.mode,
                ", ".join(f"step {s} ({manifests[s].metrics[kb.metric]:.6g})" for s in best),
            )
        newer = [s for s in committed if s > self.step]
        if newer:  # not this run's (a save without a load in a used root): never deleted
            logger.warning(
                "%s holds checkpoints newer than the step-%d just committed (steps %s); "
                "retention leaves them, and a later load.enabled: true resumes from step %d",
                root,
                self.step,
                newer,
                max(newer),
            )
        self.ctx.purger.join()  # the previous save's removals: References reads every directory
        # POSIX: a checkpoint an incremental one refers to is deferred, not deleted. The rename
        # to .deleting- happens here; the removal of its files runs on the purger's thread.
        steps = steps_to_delete(
            committed,
            keep_last=self.ctx.retention.keep_last,
            keep_every_steps=self.ctx.retention.keep_every_steps,
            just_committed=self.step,
            also_keep=best,
        )
        for line in self.store.delete_checkpoints(
            steps, before=lambda step: self.phase("retention", step), remove=self.ctx.purger.submit
        ):
            logger.info("retention: %s", line)

    def _abort(self, collective: Collective) -> None:
        if self.ctx.rank == 0:
            self.store.abort(self.pending)
        collective.barrier()


class BackgroundSave:
    """The write and commit of an async save, running on a daemon thread (at most one per
    manager). Its error is kept and raised by :meth:`join` on the training thread.

    Attributes:
        step: the step being saved.
        started: ``time.perf_counter()`` at the save call.
        seconds: save call to commit (seconds), once committed.
    """

    def __init__(
        self, tx: SaveTransaction, finish: Callable[[], None], on_committed: Callable[[float], None] | None = None
    ) -> None:
        self.step, self.started = tx.step, tx.t0
        self.seconds: float | None = None
        self._error: Exception | None = None

        def run() -> None:
            try:
                finish()
                self.seconds = time.perf_counter() - tx.t0
                if on_committed is not None:
                    on_committed(self.seconds)
            except Exception as e:  # noqa: BLE001 - raised on the training thread by join()
                self._error = e
            finally:
                tx.ctx.purger.join()  # joining this thread means retention's removals are done too

        self._thread = threading.Thread(target=run, name=f"distckpt-commit-{tx.step}", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        """Whether the write or commit is still going on."""
        return self._thread.is_alive()

    def done(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (``None``: forever) for the thread; never raises.
        Returns whether it finished (committed or failed)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the commit.

        Raises:
            CheckpointSaveError: the background save failed (on every rank).
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
