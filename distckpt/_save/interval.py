"""The checkpoint interval chosen from measurements: pure functions and a statistics record.

No torch, no process group, no storage: the inputs are save costs (seconds), failure statistics
and the step time; the output is an interval (seconds). The durable tier's schedule
(:mod:`distckpt._save.schedule`, ``schedule.interval_steps: auto``) and the simulation
(``benchmarks/bench_interval.py``) use it; a memory tier can use it the same way.

Model (Daly 2006): the job computes for ``tau`` seconds, then stalls ``C`` seconds for a
save, and so on; failures arrive at rate ``1/M``; a failure loses the work since the last
completed save, plus a restart. The expected wall time is minimal near

- Young (1974): ``tau = sqrt(2 C M)``;
- Daly (2006, eq. 37, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", FGCS 22): ``tau = sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C`` for
  ``C < 2M``, else ``tau = M``. The restart time does not move the optimum (Daly, eq. 13: it
  scales the expected time by a constant factor).

``M`` is a gamma-exponential posterior mean: a prior of one failure in ``mtbf_s`` seconds, plus
the failures and run time this root has seen: ``M = (mtbf_s + exposure_s) / (1 + failures)``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Iterable, Literal

__all__ = [
    "COST_WINDOW",
    "Decision",
    "IntervalStats",
    "young_interval",
    "daly_interval",
    "robust_cost",
    "posterior_mtbf",
    "expected_loss_s",
    "choose_interval",
]

COST_WINDOW = 8
"""Save costs kept (the most recent); their median is ``C``."""

RUNS_KEPT = 32
"""Starts remembered for the report (the counts cover all of them)."""

Formula = Literal["young", "daly"]


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)`` (seconds of work between saves).

    Args:
        cost_s: ``C``, seconds the training loop loses per save (> 0).
        mtbf_s: ``M``, mean time between failures (seconds, > 0).
    """
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37; module docstring), seconds of work between saves.

    Args:
        cost_s: ``C`` (seconds, > 0).
        mtbf_s: ``M`` (seconds, > 0).
    """
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


def robust_cost(samples: Iterable[float]) -> float | None:
    """``C``: the median of the most recent :data:`COST_WINDOW` save costs (seconds), so one slow
    save (a cold page cache, a first async save that allocates its staging buffers) does not move
    the interval; ``None`` without samples."""
    recent = list(samples)[-COST_WINDOW:]
    return statistics.median(recent) if recent else None


def posterior_mtbf(prior_s: float, exposure_s: float, failures: int) -> float:
    """``M`` (seconds): the posterior mean time between failures under a gamma prior worth one
    failure in ``prior_s`` (conjugate to exponential inter-failure times; Gelman et al.,
    *Bayesian Data Analysis*, section 2.6): ``(prior_s + exposure_s) / (1 + failures)``.

    Args:
        prior_s: ``schedule.mtbf_s`` (seconds, > 0).
        exposure_s: run time observed on this root (seconds, >= 0).
        failures: runs that ended without a final or preemption save (count, >= 0).
    """
    return (prior_s + max(0.0, exposure_s)) / (1 + max(0, failures))


def expected_loss_s(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """Expected work lost by one failure (seconds): the time since the last completed save, for
    exponential failures within a segment of ``interval_s + cost_s`` seconds,
    ``M - s / (exp(s / M) - 1)`` (about ``s / 2`` when ``s << M``); the restart comes on top."""
    s = interval_s + cost_s
    x = s / mtbf_s
    if x < 1e-6:
        return s / 2.0
    return mtbf_s - s / math.expm1(x) if x < 700 else s


@dataclasses.dataclass(frozen=True)
class Decision:
    """One choice of the interval.

    Attributes:
        interval_s: seconds of training between the end of one save and the start of the next.
        formula: ``"young"`` or ``"daly"`` (the optimum), ``"min_interval_s"`` (the floor won),
            ``"max_overhead"`` (the overhead ceiling won) or ``"first save"`` (no cost measured yet).
        cost_s: ``C`` used (seconds; ``None`` before the first save).
        mtbf_s: ``M`` used (seconds).
        optimum_s: the formula's interval before the floor and ceiling (seconds; ``None`` without ``C``).
        expected_loss_s: expected work lost per failure at ``interval_s`` (seconds).
        overhead: ``C / (interval_s + C)``, the fraction of wall time spent in saves without failures.
        optimum_formula: the formula of ``optimum_s`` (``"daly"`` or ``"young"``).
    """

    interval_s: float
    formula: str
    cost_s: float | None
    mtbf_s: float
    optimum_s: float | None
    expected_loss_s: float
    overhead: float
    optimum_formula: str = "daly"

    def describe(self) -> str:
        """One line for the log: the interval, the formula and its inputs."""
        if self.cost_s is None:
            return f"{self.interval_s:.1f} s (first save: no save cost measured yet; M = {self.mtbf_s:.0f} s)"
        opt = f"{self.optimum_formula} optimum {self.optimum_s:.1f} s" if self.optimum_s is not None else ""
        bound = "" if self.formula == self.optimum_formula else f", raised to the {self.formula} bound"
        return (
            f"{self.interval_s:.1f} s ({opt}{bound}; C = {self.cost_s:.3f} s, M = {self.mtbf_s:.0f} s, "
            f"overhead {self.overhead:.2%}, expected loss per failure {self.expected_loss_s:.1f} s)"
        )


def choose_interval(
    cost_s: float | None,
    mtbf_s: float,
    *,
    min_interval_s: float,
    max_overhead: float | None,
    formula: Formula = "daly",
    ceiling_cost_s: float | None = None,
) -> Decision:
    """The interval (seconds of training between saves) for save cost ``cost_s`` and MTBF ``mtbf_s``.

    ``interval = max(optimum, min_interval_s, C' (1 - max_overhead) / max_overhead)``: the last
    term keeps ``C' / (interval + C')``, the share of wall time spent saving, at most ``max_overhead``
    for saves costing up to ``C'`` (``ceiling_cost_s``, default ``C``; the schedule passes the largest
    recent cost, so that the bound holds for a slower save than the median). Without a measured cost
    (``None``) the first save comes after ``min_interval_s``.

    Args:
        cost_s: ``C`` (seconds) or ``None``.
        mtbf_s: ``M`` (seconds, > 0).
        min_interval_s: the floor (seconds, > 0).
        max_overhead: the ceiling on the fraction of wall time spent in saves (0 < x < 1), or ``None``.
        formula: ``"daly"`` (default) or ``"young"``.
        ceiling_cost_s: ``C'`` (seconds) for the ceiling; ``None``: ``cost_s``.
    """
    if cost_s is None:
        return Decision(min_interval_s, "first save", None, mtbf_s, None, min_interval_s / 2.0, 0.0)
    cost_s = max(cost_s, 1e-6)
    optimum = daly_interval(cost_s, mtbf_s) if formula == "daly" else young_interval(cost_s, mtbf_s)
    interval, why = max(optimum, 1e-6), str(formula)
    if min_interval_s > interval:
        interval, why = min_interval_s, "min_interval_s"
    bound_cost = max(cost_s, ceiling_cost_s or 0.0)
    if max_overhead is not None and bound_cost * (1.0 - max_overhead) / max_overhead > interval:
        interval, why = bound_cost * (1.0 - max_overhead) / max_overhead, "max_overhead"
    return Decision(
        interval_s=interval,
        formula=why,
        cost_s=cost_s,
        mtbf_s=mtbf_s,
        optimum_s=optimum,
        expected_loss_s=expected_loss_s(interval, cost_s, mtbf_s),
        overhead=cost_s / (interval + cost_s),
        optimum_formula=str(formula),
    )


@dataclasses.dataclass
class IntervalStats:
    """What the choice needs from the past, carried from checkpoint to checkpoint (the manifest's
    ``interval`` field, :meth:`to_dict` / :meth:`from_dict`).

    Attributes:
        costs_s: recent save costs (seconds; at most :data:`COST_WINDOW`, oldest first).
        exposure_s: run time of the earlier runs of this root, each up to its last save (seconds).
        failures: earlier runs that ended after a periodic save: crashed or killed, work lost.
        preemptions: earlier runs that ended with a preemption save (no work lost).
        finishes: earlier runs that ended with their final save.
        runs: the most recent starts (:data:`RUNS_KEPT`): ``{"start": unix s, "previous_end": kind}``.
        step_s: median seconds per training step seen by rank 0 (``None``: not measured).
    """

    costs_s: list[float] = dataclasses.field(default_factory=list)
    exposure_s: float = 0.0
    failures: int = 0
    preemptions: int = 0
    finishes: int = 0
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    step_s: float | None = None

    def record_cost(self, seconds: float) -> None:
        """Add one save's cost (seconds), keeping the most recent :data:`COST_WINDOW`."""
        self.costs_s = [*self.costs_s, float(seconds)][-COST_WINDOW:]

    def start_after(self, saved: dict[str, Any] | None, *, now: float) -> str:
        """A new run starts from a checkpoint whose manifest recorded ``saved`` (``None``: a fresh
        root or a checkpoint without statistics). Takes over its statistics and counts how the run
        that wrote it ended, from the kind of its newest save (``saved["ending"]``): ``periodic``
        (a manifest) or ``running`` (the root's journal) means the run stopped without a final or
        preemption save: a failure.

        Returns:
            How the previous run ended: ``"crashed"``, ``"preempted"``, ``"finished"`` or ``"none"``.
        """
        if saved:
            previous = IntervalStats.from_dict(saved)
            for field in dataclasses.fields(self):
                setattr(self, field.name, getattr(previous, field.name))
        ending = {"periodic": "crashed", "running": "crashed", "preempted": "preempted", "final": "finished"}.get(
            (saved or {}).get("ending", ""), "none"
        )
        self.failures += ending == "crashed"
        self.preemptions += ending == "preempted"
        self.finishes += ending == "finished"
        self.runs = [*self.runs, {"start": now, "previous_end": ending}][-RUNS_KEPT:]
        return ending

    def mtbf_s(self, prior_s: float, run_s: float = 0.0) -> float:
        """``M`` (seconds) from the prior and this root's history plus ``run_s`` seconds of the current run."""
        return posterior_mtbf(prior_s, self.exposure_s + run_s, self.failures)

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        """JSON-ready fields plus ``extra`` (the manifest also records the decision and its inputs)."""
        return {**dataclasses.asdict(self), **extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "IntervalStats":
        """Parse :meth:`to_dict`'s output; unknown keys (the decision) are ignored, missing ones default.

        Raises:
            ValueError: a field of the wrong type or out of range (a hand-edited or foreign file).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        stats = cls(**{k: v for k, v in data.items() if k in names})

        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

        counts = (stats.failures, stats.preemptions, stats.finishes)
        if not (
            all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
            and number(stats.exposure_s)
            and isinstance(stats.costs_s, list)
            and all(number(c) for c in stats.costs_s)
            and isinstance(stats.runs, list)
            and (stats.step_s is None or number(stats.step_s))
        ):
            raise ValueError(f"interval statistics with invalid fields: {data!r:.300}")
        return stats
