"""Preemption grace window: start the SIGTERM save only when it can finish before the SIGKILL.

A launcher sends SIGTERM, then SIGKILL after a grace period (torchelastic: 30 s, hard-coded in
torch 2.13 for restarts; SLURM: ``KillWait``). A save killed half-way is harmless (the commit is
atomic) but wasted: the time it took is lost to the restart, and the job resumes from the same
checkpoint as if it had not started. So the save is predicted from the durations measured for
this manager's previous saves (the maximum of the last few: a save's duration varies with the
disk's writeback) and compared with what is left of the grace window.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Literal

from .._coord.collective import Collective

__all__ = ["SaveDurations", "PreemptionPlan", "plan_preemption", "agree_preemption_plan"]

Action = Literal["save", "finish_inflight", "skip", "none"]


class SaveDurations:
    """Measured durations (seconds, from the save call to its commit) of the recent saves.

    Args:
        keep: how many recent durations the prediction looks at.
    """

    def __init__(self, keep: int = 4) -> None:
        self._recent: collections.deque[float] = collections.deque(maxlen=keep)

    def record(self, seconds: float) -> None:
        """Add one save's measured duration."""
        self._recent.append(float(seconds))

    def predict(self) -> float | None:
        """The predicted duration of the next save: the maximum of the recent ones; ``None``
        before the first save (nothing to predict from: the save is attempted)."""
        return max(self._recent) if self._recent else None


@dataclasses.dataclass(frozen=True)
class PreemptionPlan:
    """What to do at the step boundary after SIGTERM.

    Attributes:
        action: ``"save"`` (finish any in-flight save, then save this step), ``"finish_inflight"``
            (finish the in-flight save only: sooner than another save), ``"skip"`` (no save
            fits: resume from the last committed checkpoint), ``"none"`` (this step is
            already saved or being saved).
        reason: one line for the log.
    """

    action: Action
    reason: str

    def outcome(self, step: int, saved: bool, last_saved: int | None, t0: float, exiting: bool) -> str:
        """The log line of what the preemption at ``step`` did (``t0``: ``time.perf_counter()`` when acted on)."""
        what = f"saved step {step}" if saved else f"no save of step {step} (last saved: {last_saved})"
        then = "exiting" if exiting else "manager.preempted is set"
        return f"preempted (SIGTERM): {what} in {time.perf_counter() - t0:.2f} s; {then}"


def plan_preemption(
    *, grace_s: float, elapsed_s: float, predicted_s: float | None, inflight_left_s: float | None, step_saved: bool
) -> PreemptionPlan:
    """Decide the preemption save. Every rank must pass the same values (agree on them first).

    Args:
        grace_s: the launcher's grace period between SIGTERM and SIGKILL.
        elapsed_s: seconds since the (earliest) SIGTERM.
        predicted_s: predicted duration of a new save (``None``: unknown, attempt it).
        inflight_left_s: predicted seconds until the in-flight save commits; ``None``: none in flight.
        step_saved: this step is already committed or in flight.
    """
    left = grace_s - elapsed_s
    new = predicted_s or 0.0
    fig = (
        f"predicted save {'?' if predicted_s is None else f'{predicted_s:.2f} s'}, "
        f"{left:.2f} s left of the {grace_s:g} s grace window"
    )
    if step_saved:
        return PreemptionPlan(
            "none",
            "this step is already saved"
            + (f" (in flight, {inflight_left_s:.2f} s to go)" if inflight_left_s is not None else ""),
        )
    if inflight_left_s is None:
        if new <= left:
            return PreemptionPlan("save", f"saving this step: {fig}")
        return PreemptionPlan("skip", f"NOT saving: {fig}; the job resumes from the last committed checkpoint")
    if inflight_left_s + new <= left:
        return PreemptionPlan(
            "save", f"finishing the in-flight save ({inflight_left_s:.2f} s to go), then saving this step: {fig}"
        )
    return PreemptionPlan(
        "finish_inflight",
        f"finishing the in-flight save ({inflight_left_s:.2f} s to go) "
        f"instead of a new one: {fig}; the job resumes from the in-flight "
        "save's step",
    )


def agree_preemption_plan(
    collective: Collective,
    *,
    grace_s: float,
    elapsed_s: float,
    predicted_s: float | None,
    inflight_left_s: float | None,
    step_saved: bool,
) -> PreemptionPlan:
    """:func:`plan_preemption` on the worst case of every rank's figures (gathered over
    ``collective``), so all ranks take the same decision. Arguments are this rank's, in
    seconds, as :func:`plan_preemption` takes them."""
    every = collective.all_gather((elapsed_s, predicted_s, inflight_left_s))
    known = [p for _, p, _ in every if p is not None]
    lefts = [x for _, _, x in every if x is not None]
    return plan_preemption(
        grace_s=grace_s,
        elapsed_s=max(e for e, _, _ in every),
        predicted_s=max(known) if known else None,
        inflight_left_s=max(lefts) if lefts else None,
        step_saved=step_saved,
    )


def agree_on_signal(
    collective: Collective,
    watcher: Any,
    durations: SaveDurations,
    inflight: Any,
    *,
    grace_s: float,
    step_saved: bool,
) -> PreemptionPlan:
    """The grace-window decision at the first step boundary after SIGTERM, the same on every
    rank (:func:`agree_preemption_plan`). Collective.

    Args:
        watcher: the ``PreemptionWatcher`` that agreed on the signal (time since it, seconds).
        durations: this manager's recent save durations (the prediction of the next save).
        inflight: the async save in flight (``BackgroundSave``: ``started``, ``running()``), or ``None``.
        grace_s: seconds between SIGTERM and the launcher's SIGKILL.
        step_saved: this step is already saved (or being saved).
    """
    predicted, left = durations.predict(), None
    if inflight is not None:  # committed already when its thread is done
        left = max(0.0, (predicted or 0.0) - (time.perf_counter() - inflight.started)) if inflight.running() else 0.0
    return agree_preemption_plan(
        collective,
        grace_s=grace_s,
        elapsed_s=watcher.seconds_since_signal(),
        predicted_s=predicted,
        inflight_left_s=left,
        step_saved=step_saved,
    )
