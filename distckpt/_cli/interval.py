"""``distckpt interval ROOT``: what ``schedule.interval_steps: auto`` chose, and from what.

For a root: its interval journal (``.interval.json``, written by rank 0 while an ``auto`` run
trains: it also counts runs that crashed before their first save), else its newest checkpoint's
manifest. For a checkpoint directory: its manifest (the ``interval`` record: save costs, run time,
failures, the decision in force when that save started; :mod:`distckpt._save.interval`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .._errors import CheckpointNotFoundError, DistCkptError
from .._save.interval import IntervalStats, robust_cost
from .._save.schedule import JOURNAL
from .._storage import open_location
from .._tools.reader import CheckpointReader, resolve_checkpoint
from ._common import fmt_time, print_json

NAME = "interval"
HELP = "show the save interval `interval_steps: auto` chose: save cost C, MTBF M, interval, work lost per failure"
EPILOG = """examples:
  distckpt interval runs/demo/ckpt
  distckpt interval runs/demo/ckpt --json | jq '.decision.interval_s'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt interval``."""
    p.add_argument("checkpoint", help="a root (its newest committed checkpoint) or a checkpoint directory")


def journal_of(path: str) -> dict[str, Any] | None:
    """The root's interval journal when ``path`` names a root and it has one readable, else ``None``."""
    store, location = open_location(path)
    if location is not None:
        return None
    try:
        text = store.root_file(JOURNAL).read()
        data = json.loads(text) if text else None
    except (OSError, ValueError, DistCkptError):
        return None
    try:  # a journal with invalid fields is skipped like an unreadable one
        return data if isinstance(data, dict) and IntervalStats.from_dict(data) is not None else None
    except (TypeError, ValueError):
        return None


def report(location: str, journal: dict[str, Any] | None = None) -> dict[str, Any]:
    """The interval report of the checkpoint at ``location``, or of the root's ``journal`` when given
    (seconds throughout; ``step_s``: seconds per training step; ``runs``: the recent starts with how
    the run before each ended; ``source``: ``journal`` or ``manifest``).

    Raises:
        CheckpointNotFoundError: no journal, and the checkpoint has no readable manifest or its
            manifest no interval statistics (the run that wrote it did not use ``interval_steps: auto``).
    """
    manifest = CheckpointReader(location, check_files=False).manifest
    data = journal or (manifest.interval if manifest is not None else None)
    if manifest is None or not data:
        raise CheckpointNotFoundError(
            f"{location}: no interval statistics in its manifest (the run that wrote it did not use "
            "schedule.interval_steps: auto; set it and save once)"
        )
    stats = IntervalStats.from_dict(data)
    decision = {k.removeprefix("decision_"): v for k, v in data.items() if k.startswith("decision_")}
    return {
        "source": "journal" if journal else "manifest",
        "checkpoint": location,
        "step": manifest.step,
        "saved": fmt_time(manifest.wall_time),
        "ending": data.get("ending"),
        "cost_s": robust_cost(stats.costs_s),
        "costs_s": stats.costs_s,
        "mtbf_s": stats.mtbf_s(float(data.get("mtbf_prior_s", 0.0))),
        "mtbf_prior_s": data.get("mtbf_prior_s"),
        "run_time_s": stats.exposure_s,
        "failures": stats.failures,
        "preemptions": stats.preemptions,
        "finishes": stats.finishes,
        "step_s": stats.step_s,
        "min_interval_s": data.get("min_interval_s"),
        "max_overhead": data.get("max_overhead"),
        "decision": decision,
        "runs": stats.runs,
    }


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt interval``; returns the exit code (0 ok)."""
    r = report(resolve_checkpoint(args.checkpoint), journal_of(args.checkpoint))
    if args.json:
        print_json(r)
        return 0
    d, c = r["decision"], r["cost_s"]
    kind = {"running": "still running or crashed", "periodic": "a periodic save"}.get(r["ending"], r["ending"])
    where = f"the root's journal (last run: {kind})" if r["source"] == "journal" else f"its manifest ({kind})"
    print(f"checkpoint {r['checkpoint']}  step {r['step']}  saved {r['saved']}; statistics from {where}")
    costs = " ".join(f"{x:.3g}" for x in r["costs_s"])
    print(f"  C  save cost: {c:.3f} s (median of the last {len(r['costs_s'])}: {costs})" if c else "  C  not measured")
    print(
        f"  M  mean time between failures: {r['mtbf_s']:.0f} s = (prior {r['mtbf_prior_s']:.0f} s + run time "
        f"{r['run_time_s']:.0f} s) / (1 + {r['failures']} failures); {r['preemptions']} preemptions, "
        f"{r['finishes']} finished runs, {len(r['runs'])} starts recorded"
    )
    steps = f" (~{d['interval_s'] / r['step_s']:.0f} steps of {r['step_s']:.3g} s)" if r["step_s"] else ""
    print(
        f"  interval {d['interval_s']:.1f} s{steps} by {d['formula']}; floor min_interval_s {r['min_interval_s']} s, "
        f"ceiling max_overhead {r['max_overhead']}; overhead {d['overhead']:.2%}"
    )
    print(f"  expected work lost per failure: {d['expected_loss_s']:.1f} s (plus the restart)")
    return 0
