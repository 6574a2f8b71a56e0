"""Running the chaos jobs: one ``torchrun launch.train`` segment, tailed and killed at its aim.

Process handling (start, kill the whole tree, timeouts, records) is :mod:`launch.jobs`.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.jobs import Run, check_timeout, kill_job, load_records, read_jsonl, start_train
from launch.train import CHAOS_PAUSE_ENV, CHAOS_PRESAVE_ENV
from tests.chaos.aim import Aim

__all__ = ["KillRecord", "Segment", "JsonlTail", "presave_samples", "run_job", "median", "phase_durations"]


@dataclass
class KillRecord:
    """One kill and what it left (a ``per_kill`` row of the report)."""

    kill: int
    segment: int
    world_size_before: int
    world_size_after: int | None = None
    phase_aimed: str = ""
    occurrence: int = 1
    offset_aimed_s: float = 0.0
    offset_actual_s: float | None = None  # kill call minus the aimed event's timestamp
    instant_s: float | None = None  # kill call, seconds after the segment's torchrun started
    event_step: int | None = None  # step field of the aimed event
    save_step: int | None = None  # the save in flight (last stage/write event of rank 0)
    last_event: str | None = None  # last rank-0 phase event before the kill, "phase@step"
    phase_hit: str = ""
    disk: dict[str, Any] = field(default_factory=dict)
    last_step_trained: int = 0  # last step every rank recorded (presave)
    newest_committed: int | None = None
    resumed_from: int | None = None  # what the next segment logged
    resume_ok: bool | None = None
    verify_problems: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    param_diffs: dict[str, float] = field(default_factory=dict)  # step -> max |chaos - reference|


@dataclass
class Segment:
    """One torchrun job of the chaos run."""

    index: int
    world_size: int
    run: Run
    aim: Aim | None
    expected_resume: int | None
    lineage: frozenset[int] = frozenset()  # world sizes that trained the state it ends with
    kill: KillRecord | None = None
    phase_events: list[dict[str, Any]] = field(default_factory=list)  # rank 0 only
    error: str | None = None


class JsonlTail:
    """Reads the complete JSON lines appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def new(self) -> list[dict[str, Any]]:
        """The records completed since the last call; a line torn by a kill is skipped."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # an unfinished line waits for its newline
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # torn by a kill; the next line starts clean
                continue
        return out


def presave_samples(run: Run) -> dict[int, list[int]]:
    """Global sample ids per step every rank recorded before its save (see the package doc)."""
    per_rank = [
        {r["step"]: r["ids"] for r in read_jsonl(run.out / f"presave.rank{rank}.jsonl")} for rank in range(run.nproc)
    ]
    complete = set.intersection(*(set(p) for p in per_rank)) if per_rank else set()
    return {s: [i for p in per_rank for i in p[s]] for s in sorted(complete)}


def run_job(
    run: Run, cmd_tail: list[str], *, timeout_s: float, pause_s: float = 0.0, aim: Aim | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, float | None, float]:
    """Run one ``torchrun launch.train`` job; SIGKILL it at ``aim`` if given.

    Args:
        run: the job; its records are read back into it (samples from ``presave``).
        cmd_tail: ``--config`` and overrides after ``-m launch.train``.
        timeout_s: the job is killed and ``TimeoutError`` raised past this.
        pause_s: ``LAUNCH_CHAOS_PAUSE_S`` for the job (0: none).
        aim: when to kill; ``None`` lets the job finish.

    Returns:
        ``(rank-0 phase events, the aimed event or None, wall-clock time of the kill call or
        None, wall-clock time torchrun was started)``; wall clock because event ``t`` is.

    Raises:
        TimeoutError: past ``timeout_s`` (the job is killed first).
    """
    phase_log = run.out / "phases.jsonl"
    t0, w0 = time.monotonic(), time.time()
    proc = start_train(
        run, cmd_tail, DISTCKPT_EVENT_LOG=str(phase_log), **{CHAOS_PRESAVE_ENV: "1", CHAOS_PAUSE_ENV: str(pause_s)}
    )
    tail, events, seen = JsonlTail(phase_log), [], 0
    aimed, deadline, kill_at = None, None, None
    try:
        while proc.poll() is None:
            check_timeout(proc, run, t0, timeout_s)
            for e in tail.new():
                if e.get("rank") != 0:
                    continue
                events.append(e)
                if aim is not None and aimed is None and e.get("phase") == aim.event:
                    seen += 1
                    if seen == aim.occurrence:
                        aimed, deadline = e, e["t"] + aim.offset_s
            if deadline is not None and time.time() >= deadline:
                kill_at = time.time()
                kill_job(proc)
                run.killed = True
                break
            time.sleep(0.001 if aim is not None else 0.05)
    except BaseException:
        if proc.poll() is None:
            kill_job(proc)
        raise
    run.returncode, run.wall_seconds = proc.returncode, time.monotonic() - t0
    events += [e for e in tail.new() if e.get("rank") == 0]
    load_records(run)
    run.samples = presave_samples(run)
    return events, aimed, kill_at, w0


def median(values: list[float], default: float) -> float:
    """The median of ``values``, ``default`` when empty."""
    return statistics.median(values) if values else default


def phase_durations(events: list[dict[str, Any]], first: str, second: str) -> list[float]:
    """Seconds from each rank-0 ``first`` event to the next ``second`` event of the same step."""
    out, start = [], {}
    for e in events:
        if e["phase"] == first:
            start[e["step"]] = e["t"]
        elif e["phase"] == second and e["step"] in start:
            out.append(e["t"] - start.pop(e["step"]))
    return out
