"""The counters and loss history a checkpoint holds beside the model: :class:`TrainState`."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainState"]


@dataclass(kw_only=True)
class TrainState:
    """Counters and loss history saved with every checkpoint; returned by ``load()``.

    Attributes:
        step: optimizer steps completed.
        epoch: current epoch (0-based).
        batch_in_epoch: global batches consumed in the current epoch.
        global_samples_seen: samples consumed by all ranks since the start of training.
        global_tokens_seen: tokens consumed by all ranks (0 if the caller does not count them).
        loss_history: ``[(step, loss), ...]`` of the most recent steps, bounded by config.
        checkpoint_path: directory it was loaded from (``None`` before any load).
        saved_world_size: world size of the run that wrote the checkpoint.
        run_id: the experiment tracker's run id, kept across resumes (``CheckpointManager(run_id=)``).
        metrics: ``{name: value}`` passed with this step (``maybe_save(..., metrics=)``).
        probe_loss: the probe's loss at the save (``CheckpointManager(probe=)``), or ``None``.
        probe_loss_loaded: the probe's loss measured after ``load()`` (not saved).
        batch_change: set by a resume whose global batch differs from the saved one
            (``elastic.batch_policy: keep_local_batch``): what was done
            (:func:`distckpt._state.rebatch.apply_step_rule`); recorded in the manifest of this run's saves, not in
            the checkpoint's state.
        interval: ``schedule.interval_steps: auto``: the interval statistics a save records in its
            manifest (:mod:`distckpt._save.schedule`); not in the checkpoint's state.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    global_samples_seen: int = 0
    global_tokens_seen: int = 0
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    checkpoint_path: str | None = None
    saved_world_size: int | None = None
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    probe_loss: float | None = None
    probe_loss_loaded: float | None = None
    batch_change: dict[str, Any] | None = None
    interval: dict[str, Any] | None = None

    _SAVED = (
        "step",
        "epoch",
        "batch_in_epoch",
        "global_samples_seen",
        "global_tokens_seen",
        "loss_history",
        "run_id",
        "metrics",
        "probe_loss",
    )

    COUNTERS = ("epoch", "batch_in_epoch", "global_samples_seen", "global_tokens_seen")

    def record(
        self, step: int, loss: float | None, counters: dict[str, int], *, history_len: int, metrics: dict | None = None
    ) -> None:
        """Set ``step`` and the given counters; append ``(step, loss)`` to the bounded history.
        ``metrics`` belong to ``step``: a new step starts without any.

        Raises:
            TypeError: a counter name not in :attr:`COUNTERS`, or a metric value that is not a number.
        """
        # Most steps pass no counters and no metrics: that path builds nothing (it runs every step).
        if counters and (unknown := set(counters) - set(self.COUNTERS)):
            raise TypeError(f"unknown counter(s) {sorted(unknown)}; known: {list(self.COUNTERS)}")
        if metrics:
            bad = {k: v for k, v in metrics.items() if isinstance(v, bool) or not isinstance(v, numbers.Real)}
            if bad or not all(isinstance(k, str) for k in metrics):
                raise TypeError(f"metrics must map names to numbers (float(tensor) for a tensor); got {metrics!r}")
            # A new dict, never updated in place: snapshots and load()'s copy share the old one.
            kept = self.metrics if step == self.step else {}
            self.metrics = {**kept, **{k: float(v) for k, v in metrics.items()}}
        elif step != self.step:
            self.metrics = {}
        self.step = step
        for k, v in counters.items():
            setattr(self, k, int(v))
        if loss is not None:
            self.loss_history.append((step, float(loss)))
            del self.loss_history[:-history_len]

    def to_saved(self) -> dict[str, Any]:
        """The fields a checkpoint holds (``_SAVED``: counters, loss history, run id, metrics, probe loss);
        the fields set at load time are not saved."""
        saved = {k: getattr(self, k) for k in self._SAVED}
        # new containers (asdict's deep copy, without its recursion): the values are numbers, strings, tuples
        saved["loss_history"], saved["metrics"] = list(self.loss_history), dict(self.metrics)
        return saved
