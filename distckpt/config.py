"""Checkpoint policy configuration: a kw-only dataclass, YAML only at the edge."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError
from .ondisk.layout import check_root_scheme, checkpoint_name

__all__ = ["CheckpointConfig", "KeepBest", "LOADABLE", "INITIAL_LOAD", "READ_ONLY_SAVE"]

StateDictType = Literal["sharded", "full"]
BATCH_POLICIES = ("keep_global_batch", "keep_local_batch")  # CheckpointConfig.batch_policy
STEP_RULES = ("keep", "rescale")  # CheckpointConfig.step_rule

LOADABLE = ("model", "optimizer", "lr_scheduler", "grad_scaler", "dataloader", "rng", "counters", "extra_state")
"""Parts of a checkpoint ``load_only`` / ``exclude_from_loading`` name (``counters``: step, epoch,
samples/tokens seen, loss history, metrics, run id)."""

READ_ONLY_SAVE = ("CheckpointConfig.read_only=true: this manager only loads and never writes to its root, so "
                  "save() and maybe_save() are refused. Build the manager without read_only to train and save.")
"""The ``ConfigError`` message of a save asked of a ``read_only`` manager."""

INITIAL_LOAD = ("load_path", "load_step", "load_only", "exclude_from_loading")
"""The options that say how a run starts: applied only while the root holds no checkpoint the
run committed (:mod:`distckpt.load.restart`; README "Resume options")."""


@dataclass(kw_only=True)
class KeepBest:
    """Best-K retention (``keep_best: {metric: val_loss, mode: min, k: 2}``): the ``k``
    checkpoints with the best ``metric`` (passed as ``maybe_save(..., metrics={...})``) are kept
    in addition to ``keep_last``. Ties: the earlier step wins. A checkpoint without the metric
    (or with a NaN) never counts as best."""

    metric: str
    mode: Literal["min", "max"] = "min"
    k: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"CheckpointConfig.keep_best.metric={self.metric!r}: must be a non-empty name")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"CheckpointConfig.keep_best.mode={self.mode!r}: expected 'min' or 'max'")
        _positive("keep_best.k", self.k, integer=True)


@dataclass(kw_only=True)
class CheckpointConfig:
    """What to save, when, and how many to keep.

    Args:
        root: directory holding ``step-*`` checkpoints, ``latest`` and pending directories (saves in progress).
        interval_steps: save when ``step % interval_steps == 0``; ``None`` disables.
        interval_seconds: save when this many seconds (wall clock on rank 0) passed since the
            last save; rank 0 decides and broadcasts, so skewed clocks never split the ranks.
        keep_last: committed checkpoints to keep (>= 1); the newest is never deleted.
            ``None`` keeps all.
        keep_every_steps: checkpoints whose step is a multiple of this are kept forever.
        save_at_end: ``maybe_save(..., last_step=True)`` always saves.
        state_dict_type: ``"sharded"`` (each rank writes its shards) or ``"full"``
            (model/optimizer gathered to rank 0 with CPU offload, rank 0 writes them).
        load: ``True`` resumes from the newest committed checkpoint in ``root`` if any.
        load_path: resume from this checkpoint directory instead of the newest in ``root``.
            A ``step-N`` of ``root`` itself is a rollback: at the run's first save, the root's
            newer checkpoints are renamed ``rolledback-step-M-<n>`` (kept, never loaded or
            deleted), so its steps and ``latest`` are the rolled-back run's. Like ``load_step``,
            ``load_only`` and ``exclude_from_loading`` it applies at the run's first start only:
            once the root holds a checkpoint committed with the same four options (each
            manifest records them), a start with this config is a restart and resumes the
            root's newest checkpoint in full (:mod:`distckpt.load.restart`).
        on_existing: what a run that does not resume from ``root`` (``load: false``, or a
            ``load_path`` outside ``root``) does when ``root`` already holds checkpoints:
            ``"refuse"`` (``ConfigError`` at construction, naming the newest) or
            ``"archive"`` (rename them ``archived-step-N-<n>``, nothing deleted). A run that
            resumes from ``root`` never needs it.
        fallback_to_older: when the newest checkpoint is corrupt, load the next older
            committed one (with a warning) instead of raising ``CheckpointCorruptError``.
        verify_on_load: each rank checks size and xxh3-128 hash of every file it reads
            against the manifest: with ``fast_load`` from the bytes as they are read (one
            pass), otherwise in a pass before DCP's read.
        fast_load: read with distckpt's ``FastFileSystemReader`` (large sequential reads
            straight into the destination tensors; README "Benchmarks" has the figures) instead
            of DCP's item-by-item ``FileSystemReader``. ``False`` falls back to DCP's reader (the
            checkpoint format is the same either way).
        load_streams_per_node: with ``fast_load``, parallel sequential read streams per node,
            divided among the node's ranks (at least one per rank). Deeper storage queues
            (NVMe arrays) usually want more (``benchmarks/README.md`` has this disk's figures).
        loss_history_len: number of recent losses kept in the checkpoint.
        seed: base seed for deriving RNG state of ranks that did not exist at save time.
        async_mode: ``"off"`` (blocking save), ``"thread"`` or ``"process"``: ``save`` returns
            once the state is staged (copied); the write and the commit finish in the background
            (``"thread"``: with Python's cyclic GC paused until this rank's write ends).
        background_staging: with async, copy in a background thread too; the loop must call
            ``manager.wait_staged()`` before the state changes in place: ``optimizer.step()``,
            and the forward when it updates buffers (BatchNorm's running statistics).
        thread_count: writer threads (and files) per rank for DCP's ``FileSystemWriter``
            (``make bench`` measures 1 against the default 4 on your disk).
        lock: hold ``<root>/.lock`` while the manager is open, so a second job on the same root
            fails at construction (``CheckpointLockedError``). Without the lock the manager
            does not remove pending directories (they may belong to a live writer).
        lock_lease_s: rank 0 renews the lock every ``lock_lease_s / 3`` seconds; another job
            (on another host, where the holder's process cannot be checked) takes a lock over
            once it was not renewed for this long. The same scheduler job takes it over at once.
        preemption: on SIGTERM (any rank), all ranks save at the next ``maybe_save``.
        exit_on_preemption: after that save, close, destroy the process groups (distckpt's
            and the default one, after a barrier: every rank leaves together) and ``raise
            SystemExit(0)``; when false, ``maybe_save`` returns and ``manager.preempted`` is
            true (the job then ends the way it chooses, as ``launch/train.py`` does).
        preemption_grace_s: seconds between SIGTERM and the launcher's SIGKILL (torchelastic: 30;
            SLURM: ``KillWait``). The preemption save starts only when its predicted duration
            (the longest of this manager's last 4 saves) fits in what is left of it; an async
            save in flight is finished instead of starting another when both do not fit.
        full_at_end: the final save (``last_step=True``) is a FULL checkpoint.
        event_log: append phase events (stage, write, manifest, rename, latest, retention,
            committed, load) as JSON lines to this file; ``$DISTCKPT_EVENT_LOG`` also works.
        timeout_s: timeout of collectives distckpt issues on its own process groups (seconds).
        write_timeout_s: deadline of one rank's write phase (seconds); past it the rank gives
            up and the save fails with ``CheckpointSaveError`` on every rank, before the other
            ranks' wait hits ``timeout_s`` (which would leave the process group unusable).
            ``None``: ``timeout_s / 2``. Must be below ``timeout_s``.
        arrival_timeout_s: how long the entry check of ``save`` and ``load`` (also of a
            ``maybe_save`` that saves) waits for every rank to make the same call (seconds). A
            rank that skipped the call, passed another step or made another call then gives
            ``CollectiveMismatchError`` naming the ranks, instead of a hang of ``timeout_s``
            ending in a gloo error. It bounds that check only: ``maybe_save`` first runs its own
            collectives (the preemption all-reduce with ``preemption``, the schedule's broadcast
            with ``interval_seconds``), which wait up to ``timeout_s`` for a rank that is merely
            late. Raise it when a rank does long work of its own (evaluation on rank 0 only)
            before a direct ``save``/``load``, or before ``maybe_save`` without those
            collectives. ``None``: ``timeout_s / 5``. Must be below ``timeout_s``.
        batch_policy: what a resume does when the global batch size changed since the save
            (read from the saved ``ReshardableSampler`` state). ``"keep_global_batch"``: refuse
            (``IncompatibleCheckpointError``), the global batch must be held constant.
            ``"keep_local_batch"``: the data position carries over in samples (every sample of
            the epoch is still handed out exactly once; README "Resharding").
        step_rule: with ``keep_local_batch``, what happens to the step counter when the global
            batch changed: ``"keep"`` (step and LR scheduler untouched) or ``"rescale"``
            (``step = global_samples_seen // new_global_batch``, the LR scheduler moved by the
            same number of steps; checkpoints of higher steps are set aside at the first save).
        incremental: a tensor whose bytes equal those of the same item (name, shard layout,
            dtype) in the previous committed checkpoint is not written again: the new
            checkpoint refers to the earlier file (plain ``dcp.load`` follows the reference).
            Local (POSIX) roots only. Retention defers deleting a checkpoint while a kept one
            refers to it. README "Incremental checkpoints" has the measured cost.
        full_every: with ``incremental``, every ``full_every``-th save writes every tensor
            (``None``: only when there is no incremental checkpoint before it), so old
            checkpoints stay referenced for at most that many saves.
        s3_endpoint_url: S3 endpoint of an ``s3://bucket/prefix`` root (``None``: boto3's
            standard ``AWS_ENDPOINT_URL`` or AWS). Credentials only ever come from the standard
            environment / profiles, never from this config.
        s3_region: S3 region (``None``: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else ``us-east-1``).
        read_only: a manager that only loads and writes nothing to the root (an evaluation of a
            read-only snapshot): no lock, no shared-root token file, no removal of leftovers, no
            set-aside or rollback, no SIGTERM handler, no async writer; ``load_path`` /
            ``load_step`` / the selection always apply; ``save`` and ``maybe_save`` raise
            ``ConfigError``. Needs ``load: true``. An ``event_log`` is still appended to where it points.
    """

    root: str
    interval_steps: int | None = 100
    interval_seconds: float | None = None
    keep_last: int | None = 3
    keep_every_steps: int | None = None
    save_at_end: bool = True
    state_dict_type: StateDictType = "sharded"
    load: bool = True
    load_path: str | None = None
    on_existing: Literal["refuse", "archive"] = "refuse"
    fallback_to_older: bool = False
    verify_on_load: bool = True
    fast_load: bool = True
    load_streams_per_node: int = 2
    loss_history_len: int = 1000
    seed: int = 0
    async_mode: Literal["off", "thread", "process"] = "off"
    background_staging: bool = False
    thread_count: int = 4
    lock: bool = True
    lock_lease_s: float = 300.0
    preemption: bool = True
    exit_on_preemption: bool = True
    preemption_grace_s: float = 30.0
    full_at_end: bool = False
    event_log: str | None = None
    timeout_s: float = 600.0
    write_timeout_s: float | None = None
    arrival_timeout_s: float | None = None
    keep_best: KeepBest | None = None
    load_step: int | None = None
    load_only: list[str] | None = None
    exclude_from_loading: list[str] | None = None
    probe_tolerance: float = 0.01
    probe_on_mismatch: Literal["raise", "warn"] = "raise"
    # A changed global batch on resume (issue 16 item 1; README "Resharding")
    batch_policy: Literal["keep_global_batch", "keep_local_batch"] = "keep_global_batch"
    step_rule: Literal["keep", "rescale"] = "keep"
    incremental: bool = False
    full_every: int | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    read_only: bool = False

    def __post_init__(self) -> None:
        _check_batch_policy(self.batch_policy, self.step_rule)
        if not isinstance(self.root, (str, os.PathLike)):
            raise ConfigError(f"CheckpointConfig.root={self.root!r}: must be a directory path")
        self.root = os.fspath(self.root)
        if not self.root:
            raise ConfigError("CheckpointConfig.root must be a non-empty directory path")
        check_root_scheme(self.root, "CheckpointConfig.root")
        if self.root.startswith("s3://"):
            if len(self.root[5:].split("/", 1)[0]) < 3:
                raise ConfigError(f"CheckpointConfig.root={self.root!r}: expected s3://bucket/prefix "
                                  "(a bucket name of 3-63 characters)")
            if self.async_mode == "process":
                raise ConfigError("CheckpointConfig.async_mode='process' is not supported on s3:// roots "
                                  "(use 'thread')")
        for name in ("s3_endpoint_url", "s3_region"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"CheckpointConfig.{name}={getattr(self, name)!r}: must be a string or null")
        _positive("interval_steps", self.interval_steps, allow_none=True, integer=True)
        _positive("interval_seconds", self.interval_seconds, allow_none=True)
        _positive("keep_last", self.keep_last, allow_none=True, integer=True)
        _positive("keep_every_steps", self.keep_every_steps, allow_none=True, integer=True)
        _positive("loss_history_len", self.loss_history_len, integer=True)
        _positive("thread_count", self.thread_count, integer=True)
        _positive("load_streams_per_node", self.load_streams_per_node, integer=True)
        _positive("timeout_s", self.timeout_s)
        _positive("preemption_grace_s", self.preemption_grace_s)
        _positive("lock_lease_s", self.lock_lease_s)
        _positive("write_timeout_s", self.write_timeout_s, allow_none=True)
        if self.write_timeout_s is not None and self.write_timeout_s >= self.timeout_s:
            raise ConfigError(
                f"CheckpointConfig.write_timeout_s={self.write_timeout_s!r} must be below "
                f"timeout_s={self.timeout_s!r}: the other ranks wait for a slow writer at most timeout_s")
        _positive("arrival_timeout_s", self.arrival_timeout_s, allow_none=True)
        if self.arrival_timeout_s is not None and self.arrival_timeout_s >= self.timeout_s:
            raise ConfigError(
                f"CheckpointConfig.arrival_timeout_s={self.arrival_timeout_s!r} must be below "
                f"timeout_s={self.timeout_s!r}: it exists to fail before the collectives time out")
        if self.async_mode not in ("off", "thread", "process"):
            raise ConfigError(
                f"CheckpointConfig.async_mode={self.async_mode!r}: expected 'off', 'thread' or 'process'"
            )
        if self.async_mode != "off" and self.keep_last is not None and self.keep_last < 2:
            raise ConfigError(
                f"CheckpointConfig.keep_last={self.keep_last} with async_mode={self.async_mode!r}: "
                "keep at least 2 (the newest may still be in flight when retention runs)"
            )
        if self.background_staging and self.async_mode == "off":
            raise ConfigError("CheckpointConfig.background_staging=true needs async_mode 'thread' or 'process'")
        if self.on_existing not in ("refuse", "archive"):
            raise ConfigError(f"CheckpointConfig.on_existing={self.on_existing!r}: expected 'refuse' or 'archive'")
        if self.on_existing == "archive" and self.load and self.load_path is None:
            raise ConfigError(
                "CheckpointConfig.on_existing='archive' with load: true and no load_path: this run "
                "resumes from the root's checkpoints, so nothing would be archived. Set load: false "
                "to start fresh and archive them, or drop on_existing")
        if not isinstance(self.read_only, bool):
            raise ConfigError(f"CheckpointConfig.read_only={self.read_only!r}: must be true or false")
        if self.read_only and (not self.load or self.on_existing == "archive"):
            raise ConfigError("CheckpointConfig.read_only=true only loads: it needs load: true and no on_existing: "
                              f"archive (load={self.load}, on_existing={self.on_existing!r})")
        if not isinstance(self.incremental, bool):
            raise ConfigError(f"CheckpointConfig.incremental={self.incremental!r}: must be true or false")
        _positive("full_every", self.full_every, allow_none=True, integer=True)
        if self.full_every is not None and not self.incremental:
            raise ConfigError(f"CheckpointConfig.full_every={self.full_every!r} needs incremental: true "
                              "(every save of a non-incremental run is full); set incremental: true or drop it")
        if self.incremental and "://" in self.root:
            raise ConfigError(
                f"CheckpointConfig.incremental=true with root={self.root!r}: incremental checkpoints refer to "
                "earlier checkpoints' files by relative file-system paths, so they need a local (POSIX) root; "
                "set incremental: false for this root")
        if self.state_dict_type not in ("sharded", "full"):
            raise ConfigError(
                f"CheckpointConfig.state_dict_type={self.state_dict_type!r}: "
                "expected 'sharded' or 'full'"
            )
        self._check_resume_options()

    def _check_resume_options(self) -> None:
        if isinstance(self.keep_best, dict):
            unknown = sorted(set(self.keep_best) - {"metric", "mode", "k"})
            if unknown or "metric" not in self.keep_best:
                raise ConfigError(f"CheckpointConfig.keep_best={self.keep_best!r}: expected "
                                  "{metric: NAME, mode: min|max, k: N}")
            self.keep_best = KeepBest(**self.keep_best)
        if self.keep_best is not None and not isinstance(self.keep_best, KeepBest):
            raise ConfigError(f"CheckpointConfig.keep_best={self.keep_best!r}: expected a mapping "
                              "{metric: NAME, mode: min|max, k: N}")
        if self.load_step is not None:
            if isinstance(self.load_step, bool) or not isinstance(self.load_step, int) or self.load_step < 0:
                raise ConfigError(f"CheckpointConfig.load_step={self.load_step!r}: must be a step number (>= 0)")
            if self.load_path is not None or not self.load:
                raise ConfigError("CheckpointConfig.load_step needs load: true and no load_path "
                                  f"(load_step={self.load_step}, load={self.load}, load_path={self.load_path!r})")
        for name in ("load_only", "exclude_from_loading"):
            parts = getattr(self, name)
            if parts is None:
                continue
            if isinstance(parts, str) or not all(isinstance(p, str) for p in parts):
                raise ConfigError(f"CheckpointConfig.{name}={parts!r}: expected a list of {list(LOADABLE)}")
            unknown = sorted(set(parts) - set(LOADABLE))
            if unknown:
                raise ConfigError(f"CheckpointConfig.{name}: unknown part(s) {unknown}; valid: {list(LOADABLE)}")
        if self.load_only is not None and self.exclude_from_loading is not None:
            raise ConfigError("CheckpointConfig: set load_only or exclude_from_loading, not both")
        selected = self.load_selection
        if "lr_scheduler" in selected and "optimizer" not in selected:
            raise ConfigError(
                "CheckpointConfig: loading the lr_scheduler without its optimizer is refused (the "
                "scheduler's state sets the optimizer's learning rates and counts its steps): load "
                "both, or neither (add lr_scheduler to exclude_from_loading / drop it from load_only)")
        _positive("probe_tolerance", self.probe_tolerance)
        if self.probe_on_mismatch not in ("raise", "warn"):
            raise ConfigError(f"CheckpointConfig.probe_on_mismatch={self.probe_on_mismatch!r}: "
                              "expected 'raise' or 'warn'")

    @property
    def load_selection(self) -> frozenset[str]:
        """The parts of a checkpoint ``load()`` restores (:data:`LOADABLE` by default)."""
        if self.load_only is not None:
            return frozenset(self.load_only)
        return frozenset(LOADABLE) - frozenset(self.exclude_from_loading or ())

    @property
    def initial_load(self) -> dict[str, Any] | None:
        """``{option: value}`` of :data:`INITIAL_LOAD` as configured (paths as strings, parts as
        lists), or ``None`` when none is set: what every checkpoint of this run records."""
        values = {name: getattr(self, name) for name in INITIAL_LOAD}
        if values["load_path"] is not None:
            values["load_path"] = os.fspath(values["load_path"])
        for name in ("load_only", "exclude_from_loading"):
            values[name] = None if values[name] is None else list(values[name])
        return values if any(v is not None for v in values.values()) else None

    def for_restart(self) -> "CheckpointConfig":
        """This config for a restart of its run (:mod:`distckpt.load.restart`): without the
        :data:`INITIAL_LOAD` options, so ``load()`` resumes the root's newest checkpoint in full."""
        return dataclasses.replace(self, load_path=None, load_step=None, load_only=None,
                                   exclude_from_loading=None, on_existing="refuse")

    @property
    def resolved_load_path(self) -> str | None:
        """``load_path``, or ``<root>/step-<load_step>``; ``None`` when neither is set."""
        if self.load_step is not None:
            return os.path.join(self.root, checkpoint_name(self.load_step))
        return self.load_path

    @property
    def effective_write_timeout_s(self) -> float:
        """``write_timeout_s``, or ``timeout_s / 2`` when unset (seconds)."""
        return self.write_timeout_s if self.write_timeout_s is not None else self.timeout_s / 2

    @property
    def effective_preemption(self) -> bool:
        """``preemption``, unless ``read_only``: a manager that never saves leaves SIGTERM alone."""
        return self.preemption and not self.read_only

    @property
    def effective_arrival_timeout_s(self) -> float:
        """``arrival_timeout_s``, or ``timeout_s / 5`` when unset (seconds)."""
        return self.arrival_timeout_s if self.arrival_timeout_s is not None else self.timeout_s / 5

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "CheckpointConfig":
        """Build from a mapping.

        Raises:
            ConfigError: an unknown key (names the valid ones), a missing required key
                (``root``), or an invalid value.
        """
        valid = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown CheckpointConfig key(s) {unknown}; valid keys: {', '.join(valid)}"
            )
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ConfigError(f"CheckpointConfig: missing required key(s) {missing} (e.g. root: "
                              "runs/my_run/ckpt)")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, section: str | None = "checkpoint") -> "CheckpointConfig":
        """Read a YAML file. With ``section``, the config is that top-level mapping if present.

        Raises:
            ConfigError: unreadable YAML, not a mapping, unknown keys or a missing ``root``
                (the message names the file).
        """
        import yaml

        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if section is not None and isinstance(data, dict) and section in data:
            data = data[section]
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of CheckpointConfig fields")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e


def _check_batch_policy(batch_policy: str, step_rule: str) -> None:
    if batch_policy not in BATCH_POLICIES:
        raise ConfigError(f"CheckpointConfig.batch_policy={batch_policy!r}: expected one of {list(BATCH_POLICIES)}")
    if step_rule not in STEP_RULES:
        raise ConfigError(f"CheckpointConfig.step_rule={step_rule!r}: expected one of {list(STEP_RULES)}")
    if step_rule == "rescale" and batch_policy != "keep_local_batch":
        raise ConfigError("CheckpointConfig.step_rule='rescale' needs batch_policy='keep_local_batch': with "
                          f"batch_policy={batch_policy!r} the global batch never changes, so there is nothing "
                          "to rescale")


def _positive(name: str, value: float | None, *, allow_none: bool = False, integer: bool = False) -> None:
    if value is None and allow_none:
        return
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"CheckpointConfig.{name}={value!r}: must be a positive integer")
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise ConfigError(f"CheckpointConfig.{name}={value!r}: must be a positive, finite number")
