"""The sections of :class:`~distckpt._config.CheckpointConfig`: one kw-only dataclass each.

Each section is a YAML mapping under ``checkpoint:`` (``retention: {keep_last: 2}``) and a
keyword of ``CheckpointConfig`` (``retention=RetentionConfig(keep_last=2)``). A section checks
its own fields when built; the checks that span sections (or need ``root``) are the config's. An unknown
keyword is a ``ConfigError`` with a "did you mean" (the check :mod:`distckpt._config` installs).
Every field's docstring gives its unit (where it has one) and its default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ._errors import ConfigError

__all__ = [
    "AsyncSaveConfig",
    "DEFAULT_MTBF_S",
    "CoordinationConfig",
    "ElasticConfig",
    "KeepBest",
    "LOADABLE",
    "LoadConfig",
    "MemoryConfig",
    "PreemptionConfig",
    "RetentionConfig",
    "SaveConfig",
    "ScheduleConfig",
    "StorageConfig",
]

BATCH_POLICIES = ("keep_global_batch", "keep_local_batch")  # ElasticConfig.batch_policy
STEP_RULES = ("keep", "rescale")  # ElasticConfig.step_rule

DEFAULT_MTBF_S = 7.9 * 3600.0
"""``schedule.mtbf_s``'s default, 28,440 s: the mean time to failure Meta reports for 1,024-GPU jobs
(Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
arXiv 2410.21680). A prior: the root's own restarts and run time take over as they accumulate."""

LOADABLE = ("model", "optimizer", "lr_scheduler", "grad_scaler", "dataloader", "rng", "counters", "extra_state")
"""Parts of a checkpoint ``load.only`` / ``load.exclude`` name (``counters``: step, epoch,
samples/tokens seen, loss history, metrics, run id)."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """When to save (YAML section ``schedule:``)."""

    interval_steps: int | Literal["auto"] | None = 100
    """Save when ``step % interval_steps == 0`` (steps); ``None`` disables. ``"auto"``: the interval
    is chosen from this job's measured save cost and failure rate (Young/Daly; ``mtbf_s``,
    ``min_interval_s``, ``max_overhead``; docs/interval.md), rank 0 deciding. Default ``100``."""
    interval_s: float | None = None
    """Save when this many seconds (rank 0's wall clock) passed since the last save; rank 0 decides
    and broadcasts, so skewed clocks never split the ranks. Default ``None`` (no time interval)."""
    save_at_end: bool = True
    """``maybe_save(..., last_step=True)`` always saves. Default ``True``."""
    full_at_end: bool = False
    """The final save (``last_step=True``) is a FULL checkpoint. Default ``False``."""
    mtbf_s: float = DEFAULT_MTBF_S
    """``interval_steps: auto`` only: the prior mean time between failures of this job (seconds),
    updated by the restarts the root records. Default ``28440`` (7.9 h, Meta's mean time to failure
    of 1,024-GPU jobs, arXiv 2410.21680)."""
    min_interval_s: float = 60.0
    """``interval_steps: auto`` only: never less training than this between saves (seconds); also
    when the first save comes, before any save cost is measured. Default ``60``."""
    max_overhead: float | None = 0.02
    """``interval_steps: auto`` only: the most of the wall time saves may take (a fraction, 0 < x <
    1; the interval is lengthened to keep ``C / (interval + C)`` under it); ``None``: no ceiling.
    Default ``0.02``."""

    def __post_init__(self) -> None:
        if self.interval_steps != "auto":
            check_positive("schedule.interval_steps", self.interval_steps, allow_none=True, integer=True)
        elif self.interval_s is not None:
            raise ConfigError(
                "CheckpointConfig.schedule: interval_steps='auto' chooses the interval itself; "
                f"remove interval_s={self.interval_s!r} (or set interval_steps to a number)"
            )
        check_positive("schedule.interval_s", self.interval_s, allow_none=True)
        check_positive("schedule.mtbf_s", self.mtbf_s)
        check_positive("schedule.min_interval_s", self.min_interval_s)
        if self.max_overhead is not None:
            check_positive("schedule.max_overhead", self.max_overhead)
            if self.max_overhead >= 1:
                raise ConfigError(
                    f"CheckpointConfig.schedule.max_overhead={self.max_overhead!r}: a fraction of wall time, "
                    "0 < x < 1 (e.g. 0.02); null for no ceiling"
                )


@dataclass(kw_only=True)
class KeepBest:
    """Best-K retention (``retention: {keep_best: {metric: val_loss, mode: min, k: 2}}``): the ``k``
    checkpoints with the best ``metric`` (passed as ``maybe_save(..., metrics={...})``) are kept
    in addition to ``keep_last``. Ties: the earlier step wins. A checkpoint without the metric
    (or with a NaN) never counts as best."""

    metric: str
    """Name of the metric (a key of ``metrics``). Required."""
    mode: Literal["min", "max"] = "min"
    """``"min"``: the lowest values are best; ``"max"``: the highest. Default ``"min"``."""
    k: int = 1
    """Checkpoints kept by the metric (count). Default ``1``."""

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"CheckpointConfig.retention.keep_best.metric={self.metric!r}: must be a non-empty name")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"CheckpointConfig.retention.keep_best.mode={self.mode!r}: expected 'min' or 'max'")
        check_positive("retention.keep_best.k", self.k, integer=True)


@dataclass(kw_only=True)
class RetentionConfig:
    """How many checkpoints to keep (YAML section ``retention:``)."""

    keep_last: int | None = 3
    """Committed checkpoints to keep (count, >= 1; >= 2 with async saves); the newest is never
    deleted. ``None`` keeps all. Default ``3``."""
    keep_every_steps: int | None = None
    """Checkpoints whose step is a multiple of this (steps) are kept forever. Default ``None``."""
    keep_best: KeepBest | None = None
    """Best-K retention by a metric (:class:`KeepBest`; in YAML ``{metric: NAME, mode: min|max,
    k: N}``), kept in addition to ``keep_last``. Default ``None``."""

    def __post_init__(self) -> None:
        check_positive("retention.keep_last", self.keep_last, allow_none=True, integer=True)
        check_positive("retention.keep_every_steps", self.keep_every_steps, allow_none=True, integer=True)
        expected = "{metric: NAME, mode: min|max, k: N}"
        if isinstance(self.keep_best, dict):
            unknown = sorted(set(self.keep_best) - {"metric", "mode", "k"})
            if unknown or "metric" not in self.keep_best:
                raise ConfigError(f"CheckpointConfig.retention.keep_best={self.keep_best!r}: expected {expected}")
            self.keep_best = KeepBest(**self.keep_best)
        if self.keep_best is not None and not isinstance(self.keep_best, KeepBest):
            raise ConfigError(f"CheckpointConfig.retention.keep_best={self.keep_best!r}: expected a mapping {expected}")


@dataclass(kw_only=True)
class SaveConfig:
    """Whether this manager saves, what one save writes and how (YAML section ``save:``)."""

    enabled: bool = True
    """``False``: a manager that only loads and writes nothing to the root (an evaluation of a
    read-only snapshot): no lock, no shared-root token file, no removal of leftovers, no set-aside
    or rollback, no SIGTERM handler, no async writer; ``load.path`` / ``load.step`` / the selection
    always apply; ``save`` and ``maybe_save`` raise ``ConfigError``. Needs ``load.enabled: true``.
    An ``event_log`` is still appended to where it points. Default ``True``."""
    state_dict_type: Literal["sharded", "full"] = "sharded"
    """``"sharded"`` (each rank writes its shards) or ``"full"`` (model/optimizer gathered to
    rank 0 with CPU offload, rank 0 writes them). Default ``"sharded"``."""
    thread_count: int = 4
    """Writer threads (and files) per rank for DCP's ``FileSystemWriter`` (count; ``make bench``
    measures 1 against the default 4 on your disk). Default ``4``."""
    incremental: bool = False
    """A tensor whose bytes equal those of the same item (name, shard layout, dtype) in the
    previous committed checkpoint is not written again: the new checkpoint refers to the earlier
    file (plain ``dcp.load`` follows the reference). Local (POSIX) roots only. Retention defers
    deleting a checkpoint while a kept one refers to it. docs/incremental.md has the
    measured cost. Default ``False``."""
    full_every: int | None = None
    """With ``incremental``, every ``full_every``-th save (count of saves) writes every tensor
    (``None``: only when there is no incremental checkpoint before it), so old checkpoints stay
    referenced for at most that many saves. Default ``None``."""
    loss_history_len: int = 1000
    """Number of recent losses kept in the checkpoint (count). Default ``1000``."""

    def __post_init__(self) -> None:
        if self.state_dict_type not in ("sharded", "full"):
            raise ConfigError(
                f"CheckpointConfig.save.state_dict_type={self.state_dict_type!r}: expected 'sharded' or 'full'"
            )
        check_positive("save.thread_count", self.thread_count, integer=True)
        check_positive("save.loss_history_len", self.loss_history_len, integer=True)
        if not isinstance(self.incremental, bool):
            raise ConfigError(f"CheckpointConfig.save.incremental={self.incremental!r}: must be true or false")
        check_positive("save.full_every", self.full_every, allow_none=True, integer=True)
        if self.full_every is not None and not self.incremental:
            raise ConfigError(
                f"CheckpointConfig.save.full_every={self.full_every!r} needs save.incremental: true "
                "(every save of a non-incremental run is full); set incremental: true or drop it"
            )


@dataclass(kw_only=True)
class AsyncSaveConfig:
    """Saves in the background (YAML section ``async_save:``)."""

    mode: Literal["off", "thread", "process"] = "off"
    """``"off"`` (blocking save), ``"thread"`` or ``"process"``: ``save`` returns once the state
    is staged (copied); the write and the commit finish in the background (``"thread"``: with
    Python's cyclic GC paused until this rank's write ends). Default ``"off"``."""
    background_staging: bool = False
    """With async, copy in a background thread too; the loop must call ``manager.wait_staged()``
    before the state changes in place: ``optimizer.step()``, and the forward when it updates
    buffers (BatchNorm's running statistics). Default ``False``."""

    def __post_init__(self) -> None:
        if self.mode not in ("off", "thread", "process"):
            raise ConfigError(f"CheckpointConfig.async_save.mode={self.mode!r}: expected 'off', 'thread' or 'process'")
        if self.background_staging and self.mode == "off":
            raise ConfigError(
                "CheckpointConfig.async_save.background_staging=true needs async_save.mode 'thread' or 'process'"
            )


@dataclass(kw_only=True)
class LoadConfig:
    """What ``load()`` resumes from, which parts, and how it reads (YAML section ``load:``).

    ``path``, ``step``, ``only`` and ``exclude`` are the initial-load options
    (:data:`~distckpt._config.INITIAL_LOAD`): they apply at the run's first start only.
    """

    enabled: bool = True
    """``True`` resumes from the newest committed checkpoint in ``root`` if any; ``False``:
    ``load()`` returns ``None`` (a fresh start). Default ``True``."""
    path: str | None = None
    """Resume from this checkpoint directory instead of the newest in ``root``. A ``step-N`` of
    ``root`` itself is a rollback: at the run's first save, the root's newer checkpoints are
    renamed ``rolledback-step-M-<n>`` (kept, never loaded or deleted), so its steps and ``latest``
    are the rolled-back run's. Like ``step``, ``only`` and ``exclude`` it applies at the run's
    first start only: once the root holds a checkpoint committed with the same four options (each
    manifest records them), a start with this config is a restart and resumes the root's newest
    checkpoint in full (:mod:`distckpt._load.restart`). Default ``None``."""
    step: int | None = None
    """Resume from ``<root>/step-<step>`` (a step number, >= 0); needs ``enabled`` and no
    ``path``. Default ``None``."""
    only: list[str] | None = None
    """Restore only these parts of the checkpoint (:data:`LOADABLE`). Default ``None`` (all)."""
    exclude: list[str] | None = None
    """Restore every part but these (:data:`LOADABLE`); not together with ``only``. Default ``None``."""
    on_existing: Literal["refuse", "archive"] = "refuse"
    """What a run that does not resume from ``root`` (``enabled: false``, or a ``path`` outside
    ``root``) does when ``root`` already holds checkpoints: ``"refuse"`` (``ConfigError`` at
    construction, naming the newest) or ``"archive"`` (rename them ``archived-step-N-<n>``,
    nothing deleted). A run that resumes from ``root`` never needs it. Default ``"refuse"``."""
    fallback_to_older: bool = False
    """When the newest checkpoint is corrupt, load the next older committed one (with a warning)
    instead of raising ``CheckpointCorruptError``. Default ``False``."""
    verify: bool = True
    """Each rank checks size and xxh3-128 hash of every file it reads against the manifest: with
    ``fast_reader`` from the bytes read (one pass), else in a pass before DCP's. Default ``True``."""
    fast_reader: bool = True
    """Read with distckpt's ``FastFileSystemReader`` (large sequential reads straight into the
    destination tensors; docs/benchmarks.md, "Load" has the figures) instead of DCP's item-by-item
    ``FileSystemReader``. ``False`` falls back to DCP's reader (the checkpoint format is the same
    either way). Default ``True``."""
    read_once: bool | str = "auto"
    """With ``fast_reader``, read each stored item that every rank loads whole (DDP state,
    replicated buffers, a FULL checkpoint on every rank) once per job -- whole files spread over the
    ranks, hashes checked as read -- and broadcast it over distckpt's process group, instead of
    every rank reading it from the root (see docs/resume.md). ``"auto"``: when the ranks span more
    than one node (ranks of one node read through its shared page cache, measured faster than a
    broadcast); ``true``: always; ``false``: never. Below 16 MiB of such items every rank reads for
    itself. Default ``"auto"``."""
    streams_per_node: int = 2
    """With ``fast_reader``, parallel sequential read streams per node (count), divided among the
    node's ranks (at least one per rank). Deeper storage queues (NVMe arrays) usually want more
    (``benchmarks/README.md`` has this disk's figures). Default ``2``."""
    probe_tolerance: float = 0.01
    """Largest relative difference between the probe loss saved and the one measured after
    loading (a fraction) that passes. Default ``0.01``."""
    probe_on_mismatch: Literal["raise", "warn"] = "raise"
    """A probe loss off by more: ``"raise"`` (``IncompatibleCheckpointError``) or ``"warn"``.
    Default ``"raise"``."""

    def __post_init__(self) -> None:
        if self.on_existing not in ("refuse", "archive"):
            raise ConfigError(f"CheckpointConfig.load.on_existing={self.on_existing!r}: expected 'refuse' or 'archive'")
        if self.on_existing == "archive" and self.enabled and self.path is None:
            raise ConfigError(
                "CheckpointConfig.load.on_existing='archive' with load.enabled: true and no load.path: this run "
                "resumes from the root's checkpoints, so nothing would be archived. Set load.enabled: false "
                "to start fresh and archive them, or drop on_existing"
            )
        if not (isinstance(self.read_once, bool) or self.read_once == "auto"):
            raise ConfigError(f"CheckpointConfig.load.read_once={self.read_once!r}: must be true, false or auto")
        check_positive("load.streams_per_node", self.streams_per_node, integer=True)
        if self.step is not None:
            if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
                raise ConfigError(f"CheckpointConfig.load.step={self.step!r}: must be a step number (>= 0)")
            if self.path is not None or not self.enabled:
                raise ConfigError(
                    "CheckpointConfig.load.step needs load.enabled: true and no load.path "
                    f"(step={self.step}, enabled={self.enabled}, path={self.path!r})"
                )
        for name in ("only", "exclude"):
            parts = getattr(self, name)
            if parts is None:
                continue
            if isinstance(parts, str) or not all(isinstance(p, str) for p in parts):
                raise ConfigError(f"CheckpointConfig.load.{name}={parts!r}: expected a list of {list(LOADABLE)}")
            unknown = sorted(set(parts) - set(LOADABLE))
            if unknown:
                raise ConfigError(f"CheckpointConfig.load.{name}: unknown part(s) {unknown}; valid: {list(LOADABLE)}")
        if self.only is not None and self.exclude is not None:
            raise ConfigError("CheckpointConfig: set load.only or load.exclude, not both")
        if "lr_scheduler" in self.selection and "optimizer" not in self.selection:
            raise ConfigError(
                "CheckpointConfig: loading the lr_scheduler without its optimizer is refused (the "
                "scheduler's state sets the optimizer's learning rates and counts its steps): load "
                "both, or neither (add lr_scheduler to load.exclude / drop it from load.only)"
            )
        check_positive("load.probe_tolerance", self.probe_tolerance)
        if self.probe_on_mismatch not in ("raise", "warn"):
            raise ConfigError(
                f"CheckpointConfig.load.probe_on_mismatch={self.probe_on_mismatch!r}: expected 'raise' or 'warn'"
            )

    @property
    def selection(self) -> frozenset[str]:
        """The parts of a checkpoint ``load()`` restores (:data:`LOADABLE` by default)."""
        if self.only is not None:
            return frozenset(self.only)
        return frozenset(LOADABLE) - frozenset(self.exclude or ())

    def __bool__(self) -> bool:
        """Refused: a truth test of the section would always pass. Raises ``TypeError`` naming
        ``load.enabled``."""
        raise TypeError("CheckpointConfig.load is a section: test CheckpointConfig.load.enabled")


@dataclass(kw_only=True)
class ElasticConfig:
    """A resume at another world size or global batch (YAML section ``elastic:``; docs/resume.md, "Resharding")."""

    batch_policy: Literal["keep_global_batch", "keep_local_batch"] = "keep_global_batch"
    """What a resume does when the global batch size changed since the save (read from the
    saved ``ReshardableSampler`` state). ``"keep_global_batch"``: refuse
    (``IncompatibleCheckpointError``), the global batch must be held constant.
    ``"keep_local_batch"``: the data position carries over in samples (every sample of the epoch
    is still handed out exactly once; docs/resume.md, "Resharding"). Default ``"keep_global_batch"``."""
    step_rule: Literal["keep", "rescale"] = "keep"
    """With ``keep_local_batch``, what happens to the step counter when the global batch changed:
    ``"keep"`` (step and LR scheduler untouched) or ``"rescale"`` (``step = global_samples_seen //
    new_global_batch``, the LR scheduler moved by the same number of steps; checkpoints of higher
    steps are set aside at the first save). Default ``"keep"``."""
    seed: int = 0
    """Base seed for deriving RNG state of ranks that did not exist at save time. Default ``0``."""

    def __post_init__(self) -> None:
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(
                f"CheckpointConfig.elastic.batch_policy={self.batch_policy!r}: expected one of {list(BATCH_POLICIES)}"
            )
        if self.step_rule not in STEP_RULES:
            raise ConfigError(
                f"CheckpointConfig.elastic.step_rule={self.step_rule!r}: expected one of {list(STEP_RULES)}"
            )
        if self.step_rule == "rescale" and self.batch_policy != "keep_local_batch":
            raise ConfigError(
                "CheckpointConfig.elastic.step_rule='rescale' needs batch_policy='keep_local_batch': "
                f"with batch_policy={self.batch_policy!r} the global batch never changes, so there "
                "is nothing to rescale"
            )


@dataclass(kw_only=True)
class PreemptionConfig:
    """SIGTERM handling (YAML section ``preemption:``)."""

    enabled: bool = True
    """On SIGTERM (any rank), all ranks save at the next ``maybe_save``. Default ``True``."""
    exit: bool = True
    """After that save, close, destroy the process groups (distckpt's and the default one, after a
    barrier: every rank leaves together) and ``raise SystemExit(0)``; when false, ``maybe_save``
    returns and ``manager.preempted`` is true (the job then ends the way it chooses, as
    ``launch/train.py`` does). Default ``True``."""
    grace_s: float = 30.0
    """Seconds between SIGTERM and the launcher's SIGKILL (torchelastic: 30; SLURM:
    ``KillWait``). The preemption save starts only when its predicted duration (the longest of
    this manager's last 4 saves) fits in what is left of it; an async save in flight is finished
    instead of starting another when both do not fit. Default ``30``."""

    def __post_init__(self) -> None:
        check_positive("preemption.grace_s", self.grace_s)

    def __bool__(self) -> bool:
        """Refused: a truth test of the section would always pass. Raises ``TypeError`` naming
        ``preemption.enabled``."""
        raise TypeError("CheckpointConfig.preemption is a section: test CheckpointConfig.preemption.enabled")


@dataclass(kw_only=True)
class CoordinationConfig:
    """Timeouts of distckpt's collectives, the root's lock, the event log (YAML section ``coordination:``)."""

    timeout_s: float = 600.0
    """Timeout of collectives distckpt issues on its own process groups (seconds). Default ``600``."""
    write_timeout_s: float | None = None
    """Deadline of one rank's write phase (seconds); past it the rank gives up and the save fails
    with ``CheckpointSaveError`` on every rank, before the other ranks' wait hits ``timeout_s``
    (which would leave the process group unusable). Must be below ``timeout_s``. Default
    ``None``: ``timeout_s / 2``."""
    arrival_timeout_s: float | None = None
    """How long the entry check of ``save`` and ``load`` (also of a ``maybe_save`` that saves) waits
    for a rank that has not made the call yet (seconds; one that is gone: ``liveness_timeout_s``);
    rank 0 logs the missing ranks every 30 s meanwhile. A rank that made another call (another
    step, ``save`` vs ``load``) makes every rank raise ``CollectiveMismatchError`` within about a
    second of both calls, whatever this is; a rank still missing after it gives the same error
    naming it. The check uses the default group's store, not a collective, so the process groups
    stay usable. At most ``timeout_s``. Default ``None``: ``timeout_s`` (earlier: ``timeout_s / 5``)."""
    liveness_timeout_s: float | None = 60.0
    """Seconds without a sign of life after which that entry check stops waiting for a missing
    rank: every rank's manager bumps a counter on the default group's store every
    ``liveness_timeout_s / 6`` s (a daemon thread), and the waiting ranks raise ``RankLostError``
    naming a missing rank whose counter stood still this long (its node lost, its worker killed).
    A slow rank keeps counting; one holding the GIL this long counts as lost. Read about once a
    second (less acts as 1 s). Not below ``arrival_timeout_s``: no effect. ``None``: off. Default 60."""
    lock: bool = True
    """Hold ``<root>/.lock`` while the manager is open, so a second job on the same root fails at
    construction (``CheckpointLockedError``). Without the lock the manager does not remove pending
    directories (they may belong to a live writer). Default ``True``."""
    lock_lease_s: float = 300.0
    """Rank 0 renews the lock every ``lock_lease_s / 3`` seconds; another job (on another host,
    where the holder's process cannot be checked) takes a lock over once it was not renewed for
    this long (seconds). The same scheduler job takes it over at once. Default ``300``."""
    event_log: str | None = None
    """Append phase events (stage, write, manifest, rename, latest, retention, committed, load)
    as JSON lines to this file; ``$DISTCKPT_EVENT_LOG`` also works. Default ``None``."""

    def __post_init__(self) -> None:
        check_positive("coordination.timeout_s", self.timeout_s)
        check_positive("coordination.lock_lease_s", self.lock_lease_s)
        check_positive("coordination.liveness_timeout_s", self.liveness_timeout_s, allow_none=True)
        for name, relation, why in (
            ("write_timeout_s", "below", "the other ranks wait for a slow writer at most timeout_s"),
            ("arrival_timeout_s", "at most", "it bounds the wait for a late rank, which timeout_s bounds"),
        ):
            value = getattr(self, name)
            check_positive(f"coordination.{name}", value, allow_none=True)
            if value is not None and (value > self.timeout_s or (value == self.timeout_s and relation == "below")):
                raise ConfigError(
                    f"CheckpointConfig.coordination.{name}={value!r} must be {relation} "
                    f"coordination.timeout_s={self.timeout_s!r}: {why}"
                )

    @property
    def effective_write_timeout_s(self) -> float:
        """``write_timeout_s``, or ``timeout_s / 2`` when unset (seconds)."""
        return self.write_timeout_s if self.write_timeout_s is not None else self.timeout_s / 2

    @property
    def effective_arrival_timeout_s(self) -> float:
        """``arrival_timeout_s``, or ``timeout_s`` when unset (seconds)."""
        return self.arrival_timeout_s if self.arrival_timeout_s is not None else self.timeout_s


@dataclass(kw_only=True)
class StorageConfig:
    """Object storage of an ``s3://bucket/prefix`` root (YAML section ``storage:``)."""

    s3_endpoint_url: str | None = None
    """S3 endpoint of an ``s3://`` root (``None``: boto3's ``AWS_ENDPOINT_URL`` or AWS). Credentials
    come from the standard environment / profiles only, never from this config. Default ``None``."""
    s3_region: str | None = None
    """S3 region (``None``: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else ``us-east-1``). Default ``None``."""

    def __post_init__(self) -> None:
        for name in ("s3_endpoint_url", "s3_region"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"CheckpointConfig.storage.{name}={getattr(self, name)!r}: must be a string or null")


@dataclass(kw_only=True)
class MemoryConfig:
    """The memory tier: node-local snapshots with replicas on other nodes (YAML ``memory:``; docs/memory.md)."""

    enabled: bool = False
    """Snapshot the training state into node-local shared memory. Default ``False``."""
    interval_steps: int = 1
    """Snapshot every N optimizer steps. Default ``1``."""
    replicas: int = 1
    """Copies of each rank's snapshot on other nodes (0: own node only, lost with it). Default ``1``."""
    dir: str = "/dev/shm/distckpt"
    """Node-local tmpfs directory (outlives the workers); ``{node}``: the node id (``$DISTCKPT_NODE_ID``,
    else the host name); written only under ``<dir>/<job of root>/``. Default ``/dev/shm/distckpt``."""

    def __post_init__(self) -> None:
        check_positive("memory.interval_steps", self.interval_steps, integer=True)
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(f"CheckpointConfig.memory.replicas={self.replicas!r}: must be an integer >= 0")
        if not isinstance(self.dir, str) or not self.dir:
            raise ConfigError(f"CheckpointConfig.memory.dir={self.dir!r}: must be a non-empty directory path")


def check_positive(key: str, value: float | None, *, allow_none: bool = False, integer: bool = False) -> None:
    """``ConfigError`` naming ``CheckpointConfig.<key>`` unless ``value`` is a positive (integer) number."""
    if value is None and allow_none:
        return
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            hint = f" (write {value:.0f})" if isinstance(value, float) and value.is_integer() and value > 0 else ""
            raise ConfigError(f"CheckpointConfig.{key}={value!r}: must be a positive integer{hint}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"CheckpointConfig.{key}={value!r}: must be a positive, finite number")
