"""What ``launch/elastic_demo.py`` reads back from its runs: the timeline of world sizes and
steps (:class:`Timeline`), the samples each step kept, the summary of every transition
(:func:`analyze`), its requirements (:func:`check`) and the printed table (:func:`print_table`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch import recovery
from launch.jobs import Run, read_jsonl, sample_accounting

__all__ = ["Timeline", "analyze", "check", "kept_samples", "print_table"]


@dataclass
class Timeline:
    """Rank 0's ``metrics.jsonl`` records of the elastic run, each with the time the driver saw it."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)  # time.monotonic() per record

    def poll(self) -> list[dict[str, Any]]:
        """Read records appended since the last call (a torn last line waits for the next call)."""
        rows = read_jsonl(self.path)
        new = rows[len(self.records) :]
        now = time.monotonic()
        self.records.extend(new)
        self.seen.extend([now] * len(new))
        return new

    def segments(self) -> list[tuple[int, int]]:
        """``[start, end)`` index ranges of consecutive steps at one world size by one worker
        process of rank 0 (one worker round: a restart that replays nothing starts a new one)."""
        out, start = [], 0
        for i in range(1, len(self.records) + 1):
            if (
                i == len(self.records)
                or self.records[i]["step"] != self.records[i - 1]["step"] + 1
                or self.records[i]["world_size"] != self.records[i - 1]["world_size"]
                or self.records[i].get("worker_start") != self.records[i - 1].get("worker_start")
            ):
                out.append((start, i))
                start = i
        return [s for s in out if s[1] > s[0]]


def kept_samples(out: Path, timeline: Timeline, *, presave: bool = False) -> dict[int, list[int]]:
    """Global sample ids per step of each step's last execution (see the module doc). ``presave``:
    from ``presave.rank<r>.jsonl``, written before each ``maybe_save`` (``--memory``: a kill
    right after a step's snapshot, before ``samples.rank<r>.jsonl``, keeps the step); a step
    rank 0 never recorded (killed between that snapshot and its record, then resumed past it)
    ran at the world size of the step before it."""
    last_ws = {r["step"]: r["world_size"] for r in timeline.records}
    if presave:
        for step in range(2, max(last_ws, default=0)):
            if step not in last_ws and step - 1 in last_ws:
                last_ws[step] = last_ws[step - 1]
    per_rank: dict[int, dict[int, list[int]]] = {}
    name = "presave" if presave else "samples"
    for rank in range(max(last_ws.values(), default=0)):
        per_rank[rank] = {r["step"]: r["ids"] for r in read_jsonl(out / f"{name}.rank{rank}.jsonl")}
    history = {}
    for step, ws in last_ws.items():
        parts = [per_rank[r].get(step) for r in range(ws)]
        if all(p is not None for p in parts):
            history[step] = [i for p in parts if p is not None for i in p]
    return history


def analyze(
    out: Path,
    timeline: Timeline,
    triggers: list[tuple[str, float]],
    baseline: Run,
    info: dict[str, Any],
    steps: int,
    *,
    wall: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The summary of the elastic run in ``out`` against ``baseline``.

    Args:
        out: the elastic run's ``train.out``.
        timeline: its metrics records with the times the driver saw them.
        triggers: ``(trigger, time.monotonic())`` in order: ``node_join``, ``node_loss``.
        baseline: the finished baseline run (records loaded).
        info: ``global_batch_size``, ``steps_per_epoch``, ``dataset_len``, ``sampler_seed``.
        steps: the step every run must reach.
        wall: with the memory tier (``--memory``): each trigger's wall time (``time.time()``);
            the events then also get ``tier``, ``bytes_read_from_root``, ``bytes_between_nodes``
            and ``breakdown_s`` (``launch.recovery.breakdown``).
    """
    events = read_jsonl(out / "events.jsonl")
    resumed = [e for e in events if e["event"] == "resumed"]
    preempted = {e["step"] for e in events if e["event"] == "preempted"}
    segs = timeline.segments()
    rows = []
    for i in range(1, len(segs)):
        before, after = timeline.records[segs[i - 1][1] - 1], timeline.records[segs[i][0]]
        t_first = timeline.seen[segs[i][0]]
        # The trigger of this transition: the latest one before the first step at the new size.
        trig = [(name, t) for name, t in triggers if t <= t_first]
        name, t_trig = trig[-1] if trig else ("unknown", None)
        resumed_from = after["step"] - 1
        rows.append(
            {
                "trigger": name,
                "world_size_before": before["world_size"],
                "world_size_after": after["world_size"],
                "saved_on_sigterm": before["step"] in preempted and before["step"] == resumed_from,
                "resumed_from_step": resumed_from,
                # < 0 when rank 0 was killed between a step's snapshot and its record: nothing replayed
                "steps_replayed": max(0, before["step"] - resumed_from),
                "seconds_to_resume": round(t_first - t_trig, 2) if t_trig is not None else None,
            }
        )
        if wall is not None:
            ev = next((e for e in resumed if e.get("worker_start") == after.get("worker_start")), {})
            rows[-1].update(
                {
                    "tier": ev.get("tier"),
                    "bytes_read_from_root": ev.get("bytes_read_from_root"),
                    "bytes_between_nodes": ev.get("bytes_between_nodes"),
                    "breakdown_s": recovery.breakdown(wall[name], ev, after) if name in wall else None,
                }
            )
    history = kept_samples(out, timeline, presave=wall is not None)
    final = max((r["step"] for r in timeline.records), default=0)
    dup, skip = sample_accounting(history, final, info)
    diffs = [
        abs(r["loss"] - baseline.metrics[r["step"]]["loss"]) for r in timeline.records if r["step"] in baseline.metrics
    ]
    return {
        "events": rows,
        "final_step": final,
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "compared_executions": len(diffs),
        "duplicated_samples": dup,
        "skipped_samples": skip,
        "samples_match_baseline": all(history.get(s) == baseline.samples.get(s) for s in range(1, steps + 1)),
        "world_sizes": [timeline.records[a]["world_size"] for a, _ in segs],
        "resumes": [
            {k: e.get(k) for k in ("step", "saved_world_size", "world_size", "checkpoint_path")}
            | ({} if wall is None else {"tier": e.get("tier")})
            for e in resumed
        ],
    }


def check(
    summary: dict[str, Any], steps: int, tolerance: float, expect: list[str], *, memory: bool = False
) -> list[dict[str, Any]]:
    """The demo's requirements, each ``{"what", "ok", "value"}``; with ``memory`` also: the worker
    crash and the node loss replay at most one step and read nothing from the root."""
    reqs = []

    def req(what: str, ok: bool, value: Any) -> None:
        reqs.append({"what": what, "ok": bool(ok), "value": value})

    ev = summary["events"]
    req(f"transitions {expect}", [e["trigger"] for e in ev] == expect, [e["trigger"] for e in ev])
    want = {"node_join": (2, 4), "worker_crash": (4, 4), "node_loss": (4, 2)}
    for e in ev:
        if e["trigger"] in want:
            req(
                f"{e['trigger']}: world size {want[e['trigger']][0]} -> {want[e['trigger']][1]}",
                (e["world_size_before"], e["world_size_after"]) == want[e["trigger"]],
                [e["world_size_before"], e["world_size_after"]],
            )
        if e["trigger"] == "node_join":
            req(
                "node_join: resumed from the checkpoint saved on SIGTERM, no step replayed",
                e["saved_on_sigterm"] and e["steps_replayed"] == 0,
                [e["saved_on_sigterm"], e["steps_replayed"]],
            )
        if e["trigger"] == "node_loss":
            ok = any(
                r["step"] == e["resumed_from_step"] and r["saved_world_size"] == 4 and r["world_size"] == 2
                for r in summary["resumes"]
            )
            req("node_loss: resumed on 2 ranks from a checkpoint the 4 ranks committed", ok, e["resumed_from_step"])
        if memory and e["trigger"] in ("worker_crash", "node_loss"):
            req(
                f"{e['trigger']}: at most 1 step replayed, restored from memory, 0 bytes read from the root",
                e["steps_replayed"] <= 1 and e.get("tier") == "memory" and e.get("bytes_read_from_root") == 0,
                [e["steps_replayed"], e.get("tier"), e.get("bytes_read_from_root")],
            )
    req(
        f"reached step {steps}",
        summary["final_step"] == steps and summary["returncode"] == 0,
        [summary["final_step"], summary["returncode"]],
    )
    d = summary["max_abs_loss_diff"]
    req(f"|loss - baseline| <= {tolerance:g} at every step executed", d is not None and d <= tolerance, d)
    req(
        "no duplicated or skipped samples",
        summary["duplicated_samples"] == 0 and summary["skipped_samples"] == 0,
        [summary["duplicated_samples"], summary["skipped_samples"]],
    )
    return reqs


def print_table(summary: dict[str, Any]) -> None:
    cols = [
        "trigger",
        "world_size_before",
        "world_size_after",
        "saved_on_sigterm",
        "resumed_from_step",
        "steps_replayed",
        "seconds_to_resume",
    ]
    heads = ["event", "before", "after", "saved on SIGTERM", "resumed", "replayed", "s to resume"]
    table = [heads] + [[str(e[c]) for c in cols] for e in summary["events"]]
    if any("tier" in e for e in summary["events"]):  # --memory
        cols += ["tier", "from root", *recovery.PHASES]
        table[0] += ["tier", "MiB from root", *(f"{p} s" for p in recovery.PHASES)]
        for row, e in zip(table[1:], summary["events"]):
            mib = e["bytes_read_from_root"]
            row += [str(e["tier"]), "-" if mib is None else f"{mib / 2**20:.1f}"]
            row += [str((e["breakdown_s"] or {}).get(p)) for p in recovery.PHASES]
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    for n, row in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print(
        f"final step {summary['final_step']}, max|dloss| {summary['max_abs_loss_diff']}, "
        f"duplicated {summary['duplicated_samples']}, skipped {summary['skipped_samples']}"
    )
