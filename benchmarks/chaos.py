"""Chaos test: SIGKILL a training job at random instants inside checkpoint saves, restart, check.

Usage (from the repository root)::

    python -m benchmarks.chaos --kills 30 --out runs/chaos            # ~5 min on 2 cores
    python -m benchmarks.chaos --kills 5 --out /tmp/chaos             # the CI size, ~1 min

Library code: ``from benchmarks.chaos import main; main([...]) -> int`` (0 when every
requirement holds, 1 when one fails, 2 on bad arguments).

What it runs (every job is ``torchrun --standalone -m launch.train`` under a timeout, with a small
model, a checkpoint every ``--interval`` steps, ``keep_last=--keep-last`` so retention deletes
happen, and a corpus cut to ``--epoch-steps`` steps per epoch so epochs are crossed):

1. ``reference``: one uninterrupted job at ``--ref-world-size`` ranks to step ``T``, keeping
   every checkpoint, so any checkpoint of the chaos root can be compared with the same step.
2. ``chaos``: segments sharing one checkpoint root. Segment ``i`` is SIGKILLed as a whole
   (torchrun and every worker: ``launch.demo.kill_job``) at an instant drawn from a seeded RNG
   and aimed at one phase of a save (``stage``, ``write``, ``manifest``, ``rename``,
   ``latest``, ``retention``; rarely ``train``, between saves), then segment ``i + 1``
   restarts, the first ``--fixed-kills`` restarts at the reference world size, later ones
   sometimes at another of ``--world-sizes`` (the global batch stays ``--global-batch``).
   After ``--kills`` kills a last segment trains to ``T`` undisturbed.

Aiming. distckpt appends a JSON line ``{"phase", "rank", "step", "t"}`` to
``$DISTCKPT_EVENT_LOG`` just before each phase acts. The killer tails that file (1 ms poll);
on the aimed rank-0 event (the first or second one of the segment) it waits a random offset
inside the phase's window and kills. Most transitions take well under a millisecond here, so
killed segments run with ``LAUNCH_CHAOS_PAUSE_S=--pause-ms`` (a hook in ``launch/train.py``):
each event and each directory fsync of the commit protocol is followed by that pause, so every
intermediate on-disk state lasts long enough to be hit. Timing only; no bytes change.

What a kill hit is read from the disk right after it (``phase_hit``): no staging directory yet
-> ``stage``; staging without DCP's ``.metadata`` -> ``write``; with ``.metadata`` but without
the manifest -> ``manifest``; with the manifest -> ``rename``; renamed but ``latest`` still
names the previous one -> ``latest``; a retention victim still present (whole, or already
without its manifest) -> ``retention``; else ``train``.

Checks (``DIR/report.json``; the process exits 1 when one fails):

* ``wrong_resumes``: each restart must resume the newest committed checkpoint present at the
  kill (``distckpt.commit.find_committed`` right after the kill; ``resumed`` in the next
  segment's ``events.jsonl``), or start fresh when there was none.
* ``corrupt_loads``: a restart whose load failed, or a resume from a checkpoint that fails a
  full hash verification (``distckpt.commit.verify``) at the kill.
* ``lost_committed_checkpoints``: a checkpoint valid at one inspection and gone at the next
  without ``--keep-last`` newer valid ones (the only reason retention deletes).
* ``duplicated_samples``, ``skipped_samples``: the demo's accounting (``launch.demo``) over
  the kept history of the final segment. Sample ids come from ``presave.rank*.jsonl``, written
  before each save (``LAUNCH_CHAOS_PRESAVE_SAMPLES``): ``samples.rank*.jsonl`` is written
  after it, and a kill between the commit and that record would lose a kept step's ids.
* parameters: every checkpoint found at an inspection is compared with the reference's
  checkpoint of the same step (model tensors read in this process with distckpt's safe
  reader, ``dcp.load(no_dist=True)``). Bitwise (``0.0``) where every segment in its lineage
  ran at the reference world size, ``<= --tolerance`` otherwise. ``max_abs_param_diff`` is the
  final step's; ``max_abs_param_diff_same_world_size`` / ``_changed_world_size`` the maxima
  over all compared checkpoints of each kind.
* every killed segment was killed by us, the last one exited 0 at step ``T``, and ``kills``
  reached ``--kills``.

Reported, not required: ``orphaned_checkpoint_dirs`` (``step-*`` directories without a
manifest at the end; a retention delete first renames the checkpoint ``.deleting-step-*``,
which the next start removes, so none are expected) and ``leftover_entries`` (other names in
the root, e.g. a ``latest`` tmp file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `launch` is a folder, not an installed package
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

from distckpt import ConfigError  # noqa: E402
from distckpt.commit import find_committed, verify  # noqa: E402
from distckpt.engine import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata  # noqa: E402
from distckpt.layout import LATEST, MANIFEST, checkpoint_name, is_deleting, is_staging, parse_step  # noqa: E402
from distckpt.manifest import Manifest  # noqa: E402
from launch.config import load_job_config  # noqa: E402
from launch.demo import (  # noqa: E402
    Run,
    check_timeout,
    kept_history,
    kill_job,
    load_records,
    read_jsonl,
    sample_accounting,
    start_train,
)
from launch.train import CHAOS_PAUSE_ENV, CHAOS_PRESAVE_ENV  # noqa: E402

__all__ = ["main", "classify_phase", "lost_checkpoints", "load_model_tensors", "param_diff"]

# Aiming weights: mostly inside a save, the commit transitions as often as the long write.
PHASE_WEIGHTS = {"stage": 1.0, "write": 2.0, "manifest": 1.5, "rename": 1.5, "latest": 1.5,
                 "retention": 2.0, "train": 0.5}
SMALL_MODEL = ["model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.dropout=0.1"]


# ---------------------------------------------------------------- records
@dataclass
class Aim:
    """Where to kill a segment.

    Attributes:
        phase: aimed phase (a key of :data:`PHASE_WEIGHTS`).
        event: the rank-0 distckpt event that opens the window (``committed`` for ``train``).
        occurrence: kill at the ``occurrence``-th such event of the segment (1-based).
        offset_s: seconds after the event's timestamp.
    """

    phase: str
    event: str
    occurrence: int
    offset_s: float


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


# ---------------------------------------------------------------- disk inspection
def inspect_root(root: Path) -> dict[str, Any]:
    """What a checkpoint root holds now.

    Returns:
        ``{"valid": [steps], "invalid": {step: reason}, "staging": [{name, step, files,
        metadata, manifest, manifest_tmp}], "latest": name or None, "other": [names],
        "deleting": [steps of .deleting- directories]}``;
        ``valid`` per :func:`distckpt.commit.find_committed` (manifest readable, every listed
        file present with its size).
    """
    valid, invalid = [], {}
    for step, _, result in find_committed(root):
        if isinstance(result, Manifest):
            valid.append(step)
        else:
            invalid[step] = str(result)[:200]
    staging, other, deleting = [], [], []
    if root.is_dir():
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_dir() and is_deleting(entry.name):  # a retention delete in progress
                deleting.append(int(entry.name.split("-")[2]))
            elif entry.is_dir() and is_staging(entry.name):
                names = set(os.listdir(entry.path))
                staging.append({
                    "name": entry.name, "step": int(entry.name.split("-")[2]), "files": len(names),
                    "metadata": ".metadata" in names, "manifest": MANIFEST in names,
                    "manifest_tmp": any(n.startswith(f".{MANIFEST}.tmp") for n in names)})
            elif parse_step(entry.name) is None and entry.name not in (LATEST, ".lock"):
                other.append(entry.name)
    latest = None
    try:
        latest = (root / LATEST).read_text().strip()
    except OSError:
        pass
    return {"valid": sorted(valid), "invalid": invalid, "staging": staging, "latest": latest, "other": other,
            "deleting": deleting}


def classify_phase(disk: dict[str, Any], save_step: int | None, last_event: tuple[str, int | None] | None,
                   keep_last: int) -> str:
    """The save phase a kill interrupted, read from the disk (see the module docstring).

    Args:
        disk: :func:`inspect_root` right after the kill.
        save_step: step of the save in flight (its last rank-0 ``stage``/``write`` event), or
            ``None`` when no save had started in the segment.
        last_event: ``(phase, step)`` of the last rank-0 event before the kill.
        keep_last: the retention setting.
    """
    if save_step is None:
        return "train"
    staging = [s for s in disk["staging"] if s["step"] == save_step]
    if save_step not in disk["valid"]:
        if not staging:
            return "stage"  # state gathered in memory; nothing on disk yet
        s = staging[0]
        if s["manifest"]:
            return "rename"
        if s["manifest_tmp"] or s["metadata"]:  # DCP writes .metadata after every rank's data
            return "manifest"
        return "write"
    if disk["latest"] != checkpoint_name(save_step):
        return "latest"
    if last_event is not None and last_event[0] == "retention" and last_event[1] is not None:
        victim = last_event[1]
        if victim in disk["valid"] or victim in disk["invalid"] or victim in disk.get("deleting", ()):
            return "retention"  # before the delete, or renamed .deleting- and files still there
    if len([v for v in disk["valid"] if v <= save_step]) > keep_last:
        return "retention"  # latest replaced, retention has more to delete
    return "train"


def lost_checkpoints(before: list[int], after: list[int], keep_last: int) -> list[int]:
    """Valid steps of ``before`` missing from ``after`` that retention had no right to delete.

    Retention deletes a checkpoint only when ``keep_last`` newer committed ones exist.
    """
    now = set(after)
    return sorted(s for s in set(before) - now if sum(1 for t in now if t > s) < keep_last)


def describe_disk(disk: dict[str, Any]) -> str:
    """One line for the printed table."""
    parts = [f"valid={disk['valid']}"]
    if disk["invalid"]:
        parts.append(f"invalid={sorted(disk['invalid'])}")
    for s in disk["staging"]:
        parts.append(f"staging@{s['step']}({s['files']} files{', .metadata' if s['metadata'] else ''}"
                     f"{', manifest' if s['manifest'] else ''}{', manifest.tmp' if s['manifest_tmp'] else ''})")
    parts.append(f"latest={disk['latest']}")
    return " ".join(parts)


# ---------------------------------------------------------------- parameters
def load_model_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a committed checkpoint, FULL, read in this process.

    Uses distckpt's safe reader (allow-list metadata unpickler, manifest size + hash check of
    each file read) with ``dcp.load(..., no_dist=True)``: no process group needed.
    """
    path = Path(path)
    metadata = read_dcp_metadata(path)
    target = {k: torch.empty(md.size, dtype=md.properties.dtype)
              for k, md in metadata.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    manifest = Manifest.read(path)
    reader = SafeFileSystemReader(path, expected_files={f.path: (f.size_bytes, f.hash) for f in manifest.files})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return target


def param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max |a - b|`` over all tensors (float64); ``inf`` when keys or shapes differ."""
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for k, x in a.items():
        y = b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


# ---------------------------------------------------------------- jobs
def _presave_samples(run: Run) -> dict[int, list[int]]:
    """Global sample ids per step every rank recorded before its save (see module doc)."""
    per_rank = [{r["step"]: r["ids"] for r in read_jsonl(run.out / f"presave.rank{rank}.jsonl")}
                for rank in range(run.nproc)]
    complete = set.intersection(*(set(p) for p in per_rank)) if per_rank else set()
    return {s: [i for p in per_rank for i in p[s]] for s in sorted(complete)}


def run_job(run: Run, cmd_tail: list[str], *, timeout_s: float, pause_s: float = 0.0,
            aim: Aim | None = None) -> tuple[list[dict[str, Any]], dict[str, Any] | None, float | None, float]:
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
    """
    phase_log = run.out / "phases.jsonl"
    t0, w0 = time.monotonic(), time.time()
    proc = start_train(run, cmd_tail, DISTCKPT_EVENT_LOG=str(phase_log),
                       **{CHAOS_PRESAVE_ENV: "1", CHAOS_PAUSE_ENV: str(pause_s)})
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
    run.samples = _presave_samples(run)
    return events, aimed, kill_at, w0


def _median(values: list[float], default: float) -> float:
    return statistics.median(values) if values else default


def _phase_durations(events: list[dict[str, Any]], first: str, second: str) -> list[float]:
    """Seconds from each rank-0 ``first`` event to the next ``second`` event of the same step."""
    out, start = [], {}
    for e in events:
        if e["phase"] == first:
            start[e["step"]] = e["t"]
        elif e["phase"] == second and e["step"] in start:
            out.append(e["t"] - start.pop(e["step"]))
    return out


# ---------------------------------------------------------------- driver
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python -m benchmarks.chaos --kills 30 --out runs/chaos")
    p.add_argument("--kills", type=int, default=30, help="SIGKILLs to inflict (default 30)")
    p.add_argument("--out", default="runs/chaos", help="output directory (default runs/chaos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    p.add_argument("--steps", type=int, default=0,
                   help="T, the target step; 0: interval * (2 * kills + 4) (default 0)")
    p.add_argument("--interval", type=int, default=2, help="checkpoint every this many steps (default 2)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoint.keep_last (default 2)")
    p.add_argument("--epoch-steps", type=int, default=10, help="cut the corpus to this many steps per epoch")
    p.add_argument("--global-batch", type=int, default=8, help="G, constant across world sizes (default 8)")
    p.add_argument("--seq-len", type=int, default=32, help="model.seq_len and data.seq_len (default 32)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="to restart with")
    p.add_argument("--ref-world-size", type=int, default=2, help="world size of the reference and start")
    p.add_argument("--fixed-kills", type=int, default=-1,
                   help="restarts kept at the reference world size first; -1: kills // 3")
    p.add_argument("--change-prob", type=float, default=0.5,
                   help="probability that a later restart changes the world size (default 0.5)")
    p.add_argument("--pause-ms", type=float, default=40.0, help="LAUNCH_CHAOS_PAUSE_S in killed segments, ms")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |param diff| after a world-size change")
    p.add_argument("--run-timeout-s", type=float, default=180.0, help="timeout of each torchrun job")
    p.add_argument("--config", default="launch/configs/ddp.yaml", help="job YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.key=value",
                   help="extra override for every job (repeatable; wins over the defaults)")
    return p.parse_args(argv)


def _choose_aim(rng: random.Random, resume: int | None, steps: int, interval: int, pause: float,
                write_s: float, step_s: float) -> Aim | None:
    """Draw phase, occurrence and offset; ``None`` when no save is left before ``steps``."""
    start = resume or 0
    saves_left = (steps - start + interval - 1) // interval  # the save at `steps` included
    if saves_left < 1:
        return None
    phases = [p for p in PHASE_WEIGHTS if p != "train" or saves_left >= 2]
    phase = rng.choices(phases, weights=[PHASE_WEIGHTS[p] for p in phases])[0]
    limit = saves_left - 1 if phase == "train" else saves_left
    occurrence = 2 if limit >= 2 and rng.random() < 0.25 else 1
    u = rng.random()
    if phase == "write":  # the pause, then DCP writes for ~write_s
        offset, event = pause + u * write_s, "write"
    elif phase == "retention":  # before the delete, then after its .deleting- rename
        offset, event = u * 2 * pause, "retention"
    elif phase == "train":  # the steps after a commit, before the next save
        offset, event = u * max(0.005, (interval - 1) * step_s), "committed"
    else:
        offset, event = u * pause, phase
    return Aim(phase=phase, event=event, occurrence=occurrence, offset_s=offset)


def _next_world_size(rng: random.Random, restart: int, prev: int, args: argparse.Namespace,
                     changed_so_far: bool, last: bool) -> int:
    """The reference world size for the first ``fixed_kills`` restarts, then sometimes another;
    the last segment changes it if no restart has (so every run covers resharding)."""
    others = [w for w in args.world_sizes if w != prev]
    if restart <= args.fixed_kills or not others:
        return prev
    if rng.random() < args.change_prob or (last and not changed_so_far):
        return rng.choice(others)
    return prev


def main(argv: list[str] | None = None) -> int:
    """Run the chaos test; returns 0 when every requirement holds, 1 when one fails, 2 on bad input."""
    args = _parse_args(argv)
    t_start = time.monotonic()
    n, interval, g = args.kills, args.interval, args.global_batch
    steps = args.steps or interval * (2 * n + 4)
    if args.fixed_kills < 0:
        args.fixed_kills = n // 3
    bad = [w for w in args.world_sizes + [args.ref_world_size] if w < 1 or g % w]
    if n < 0 or steps < 2 * interval or args.keep_last < 1 or bad:
        print(f"error: need --kills >= 0, --steps >= 2 * --interval, --keep-last >= 1 and world sizes "
              f"dividing --global-batch {g} (bad: {bad})", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    overrides = [*SMALL_MODEL, f"model.seq_len={args.seq_len}", f"data.seq_len={args.seq_len}",
                 f"data.global_batch_size={g}", f"data.max_bytes={args.epoch_steps * g * (args.seq_len + 1)}",
                 f"train.steps={steps}", f"train.warmup_steps={steps // 6}", "train.log_every=1000",
                 f"checkpoint.interval_steps={interval}", f"checkpoint.keep_last={args.keep_last}",
                 *args.overrides]
    try:
        cfg = load_job_config(REPO / args.config, overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keep_last = cfg.checkpoint.keep_last or args.keep_last
    for name in ("reference", "chaos"):
        shutil.rmtree(out / name, ignore_errors=True)  # only what an earlier chaos run in --out made
    (out / "report.json").unlink(missing_ok=True)
    cmd_tail = ["--config", str(REPO / args.config), *overrides]
    rng = random.Random(args.seed)
    pause = args.pause_ms / 1000.0

    def log(msg: str) -> None:
        print(f"[chaos {time.monotonic() - t_start:6.1f}s] {msg}", flush=True)

    # 1. reference: uninterrupted, every checkpoint kept.
    ref = Run("reference", args.ref_world_size, out / "reference", out / "reference" / "checkpoints")
    log(f"reference: {ref.nproc} ranks to step {steps} ...")
    try:
        ref_events, _, _, _ = run_job(ref, cmd_tail + ["checkpoint.keep_last=null"], timeout_s=args.run_timeout_s)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if ref.returncode != 0 or ref.last_step != steps:
        print((ref.out / "torchrun.log").read_text()[-4000:], file=sys.stderr)
        print(f"error: the reference run failed (exit {ref.returncode}, step {ref.last_step})", file=sys.stderr)
        return 1
    start_ev = ref.event("start") or {}
    info = {"global_batch_size": g, "sampler_seed": cfg.data.seed, "dataset_len": start_ev.get("dataset_len", 0),
            "steps_per_epoch": start_ev.get("steps_per_epoch", 1)}
    write_durations = _phase_durations(ref_events, "write", "manifest")
    step_s = _median([m["step_seconds"] for m in ref.metrics.values() if not m["checkpoint_seconds"]], 0.01)
    log(f"reference: done in {ref.wall_seconds:.1f} s; {info['steps_per_epoch']} steps/epoch, "
        f"write phase {_median(write_durations, 0.0) * 1e3:.0f} ms, {step_s * 1e3:.0f} ms/step")
    ref_cache: dict[int, dict[str, torch.Tensor]] = {}

    def ref_params(step: int) -> dict[str, torch.Tensor]:
        if step not in ref_cache:
            ref_cache[step] = load_model_tensors(ref.ckpt_root / checkpoint_name(step))
        return ref_cache[step]

    # 2. chaos segments
    root = out / "chaos" / "checkpoints"
    segments: list[Segment] = []
    kills: list[KillRecord] = []
    lineage_of: dict[int, frozenset[int]] = {}  # committed step -> world sizes in its history
    diffs: list[dict[str, Any]] = []
    lost_total: list[int] = []
    verify_failed_steps: set[int] = set()
    prev_valid: list[int] = []
    expected_resume: int | None = None
    world_size, changed = args.ref_world_size, False

    def compare_new(segment: Segment, valid: list[int]) -> dict[str, float]:
        """Compare the checkpoints this segment committed with the reference's."""
        out_diffs = {}
        for s in valid:
            if s in lineage_of:
                continue
            lineage_of[s] = segment.lineage
            error = None
            try:
                d = param_diff(load_model_tensors(root / checkpoint_name(s)), ref_params(s))
            except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be read fails the check
                d, error = math.inf, f"{type(e).__name__}: {e}"[:300]
                log(f"cannot compare step {s} with the reference: {error}")
            same = segment.lineage == frozenset({args.ref_world_size})
            diffs.append({"step": s, "segment": segment.index, "lineage": sorted(segment.lineage),
                          "bitwise_expected": same, "max_abs_param_diff": d, "error": error})
            out_diffs[str(s)] = d
        return out_diffs

    index = 0
    while True:
        last = len(kills) >= n
        if index > 0:
            world_size = _next_world_size(rng, index, world_size, args, changed, last)
            changed = changed or world_size != segments[-1].world_size
            if kills:
                kills[-1].world_size_after = world_size
        aim = None
        if not last:
            aim = _choose_aim(rng, expected_resume, steps, interval, pause,
                              _median(write_durations, 0.05), step_s)
            if aim is None:
                log(f"no save left after step {expected_resume}: stopping at {len(kills)} kills")
                last = True
        parent = segments[-1].run if segments else None
        run = Run(f"seg{index:02d}", world_size, out / "chaos" / f"seg{index:02d}", root, parent=parent)
        seg = Segment(index=index, world_size=world_size, run=run, aim=aim, expected_resume=expected_resume)
        segments.append(seg)
        what = (f"kill at {aim.phase} (event {aim.event} #{aim.occurrence} + {aim.offset_s * 1e3:.0f} ms)"
                if aim else f"to step {steps}")
        log(f"{run.name}: {world_size} ranks, expect resume from {expected_resume}; {what}")
        try:
            events, aimed, kill_at, started = run_job(run, cmd_tail, timeout_s=args.run_timeout_s,
                                             pause_s=pause if aim else 0.0, aim=aim)
        except TimeoutError as e:
            seg.error = str(e)
            log(f"error: {e}")
            break
        seg.phase_events = events
        write_durations += [d - pause for d in _phase_durations(events, "write", "manifest")] if aim else []
        observed = run.resumed_from
        resume_ok = observed == expected_resume
        base = lineage_of.get(observed, frozenset()) if observed is not None else frozenset()
        seg.lineage = base | {world_size}
        if kills:
            kills[-1].resumed_from, kills[-1].resume_ok = observed, resume_ok
        if not run.killed and run.returncode != 0:
            seg.error = f"exit {run.returncode}"
            log(f"{run.name}: exit {run.returncode} without a kill; log tail:")
            print((run.out / "torchrun.log").read_text()[-3000:], file=sys.stderr)
        disk = inspect_root(root)
        lost = lost_checkpoints(prev_valid, disk["valid"], keep_last)
        lost_total += lost
        new_diffs = compare_new(seg, disk["valid"])
        newest = disk["valid"][-1] if disk["valid"] else None
        problems = [str(p)[:300] for p in verify(root / checkpoint_name(newest))] if newest is not None else []
        if problems:
            verify_failed_steps.add(newest)
        if run.killed:
            save_events = [e for e in events if e["phase"] in ("stage", "write")]
            save_step = save_events[-1]["step"] if save_events else None
            if save_step is not None and any(e["phase"] == "committed" and e["step"] == save_step for e in events):
                save_step = None  # that save completed: the kill fell between saves
            last_ev = (events[-1]["phase"], events[-1]["step"]) if events else None
            k = KillRecord(
                kill=len(kills) + 1, segment=index, world_size_before=world_size, phase_aimed=aim.phase,
                occurrence=aim.occurrence, offset_aimed_s=round(aim.offset_s, 4),
                offset_actual_s=round(kill_at - aimed["t"], 4) if aimed else None,
                instant_s=round(kill_at - started, 3), event_step=aimed["step"] if aimed else None,
                save_step=save_step, last_event=f"{last_ev[0]}@{last_ev[1]}" if last_ev else None,
                phase_hit=classify_phase(disk, save_step, last_ev, keep_last),
                disk=dict(disk, invalid=sorted(disk["invalid"])),  # reasons: see end_of_run_disk
                last_step_trained=max(run.samples, default=0), newest_committed=newest,
                verify_problems=problems, lost=lost, param_diffs=new_diffs)
            seg.kill = k
            kills.append(k)
            log(f"{run.name}: killed at {k.instant_s:.2f} s, aimed {k.phase_aimed} -> hit {k.phase_hit} "
                f"(save {save_step}, last event {k.last_event}); {describe_disk(disk)}")
        else:
            log(f"{run.name}: exit {run.returncode} at step {run.last_step}, resumed from {observed} "
                f"({run.wall_seconds:.1f} s); {describe_disk(disk)}")
        if lost:
            log(f"LOST committed checkpoints {lost} (valid before: {prev_valid}, now: {disk['valid']})")
        if not resume_ok:
            log(f"WRONG RESUME: expected {expected_resume}, resumed from {observed}")
        prev_valid, expected_resume = disk["valid"], newest
        index += 1
        if not run.killed or seg.error:
            break

    # 3. analysis
    final = segments[-1]
    final_ok = (not final.run.killed and final.run.returncode == 0 and final.run.last_step == steps
                and final.error is None)
    dup, skip = sample_accounting(kept_history(final.run), steps, info) if final_ok else (-1, -1)
    resumes = sum(1 for s in segments if s.run.resumed_from is not None)
    wrong_resumes = sum(1 for s in segments if s.run.resumed_from != s.expected_resume)
    failed_runs = sum(1 for s in segments if s.error is not None)
    # A restart that should have resumed, did not get to log it, and was not killed by us.
    load_failed = sum(1 for s in segments if not s.run.killed and s.expected_resume is not None
                      and s.run.resumed_from is None)
    corrupt_resumes = sum(1 for s in segments if s.run.resumed_from in verify_failed_steps)
    corrupt_loads = load_failed + corrupt_resumes
    final_diff = None
    if final_ok and steps in lineage_of:
        final_diff = next(d["max_abs_param_diff"] for d in diffs if d["step"] == steps)
    same = [d["max_abs_param_diff"] for d in diffs if d["bitwise_expected"]]
    other = [d["max_abs_param_diff"] for d in diffs if not d["bitwise_expected"]]
    final_bitwise = final.lineage == frozenset({args.ref_world_size})
    ws_changes = sum(1 for a, b in zip(segments, segments[1:]) if a.world_size != b.world_size)
    reqs: list[dict[str, Any]] = []

    def req(what: str, ok: bool, value: Any) -> None:
        reqs.append({"what": what, "ok": bool(ok), "value": value})

    req(f"kills >= {n}", len(kills) >= n, len(kills))
    req(f"final segment exited 0 at step {steps}", final_ok,
        {"returncode": final.run.returncode, "last_step": final.run.last_step, "error": final.error})
    req("failed_runs == 0 (every job either finished or was killed by us)", failed_runs == 0, failed_runs)
    req("wrong_resumes == 0 (resumed the newest committed checkpoint present at the kill)",
        wrong_resumes == 0, wrong_resumes)
    req("corrupt_loads == 0", corrupt_loads == 0, corrupt_loads)
    req("lost_committed_checkpoints == 0", not lost_total, len(lost_total))
    req("duplicated_samples == 0", dup == 0, dup)
    req("skipped_samples == 0", skip == 0, skip)
    req("same world size lineage: params bitwise equal to the reference", all(d == 0.0 for d in same),
        max(same, default=None))
    req(f"changed world size lineage: |params - reference| <= {args.tolerance:g}",
        all(d <= args.tolerance for d in other), max(other, default=None))
    req(f"final params {'bitwise' if final_bitwise else f'within {args.tolerance:g}'} of the reference",
        final_diff is not None and (final_diff == 0.0 if final_bitwise else final_diff <= args.tolerance),
        final_diff)
    ok = all(r["ok"] for r in reqs)
    end_disk = inspect_root(root)
    total = time.monotonic() - t_start
    report = {
        "kills": len(kills), "resumes": resumes, "corrupt_loads": corrupt_loads,
        "lost_committed_checkpoints": len(lost_total), "duplicated_samples": dup, "skipped_samples": skip,
        "max_abs_param_diff": final_diff, "final_bitwise_expected": final_bitwise,
        "max_abs_param_diff_same_world_size": max(same, default=None),
        "max_abs_param_diff_changed_world_size": max(other, default=None),
        "checkpoints_compared": len(diffs), "wrong_resumes": wrong_resumes, "failed_runs": failed_runs,
        "world_size_changes": ws_changes, "segments": len(segments),
        # Not requirements: what kills left behind that nothing cleans up (see module doc).
        "orphaned_checkpoint_dirs": sorted(end_disk["invalid"]), "leftover_entries": end_disk["other"],
        "phases_aimed": dict(Counter(k.phase_aimed for k in kills)),
        "phases_hit": dict(Counter(k.phase_hit for k in kills)),
        "ok": ok, "requirements": reqs, "wall_seconds": round(total, 1),
        "settings": {"steps": steps, "interval_steps": interval, "keep_last": keep_last,
                     "global_batch_size": g, "steps_per_epoch": info["steps_per_epoch"],
                     "dataset_len": info["dataset_len"], "world_sizes": args.world_sizes,
                     "ref_world_size": args.ref_world_size, "fixed_kills": args.fixed_kills,
                     "pause_ms": args.pause_ms, "seed": args.seed, "tolerance": args.tolerance,
                     "config": args.config, "overrides": overrides},
        "end_of_run_disk": end_disk,
        "per_kill": [asdict(k) for k in kills],
        "per_segment": [{"segment": s.index, "world_size": s.world_size, "expected_resume": s.expected_resume,
                         "resumed_from": s.run.resumed_from, "killed": s.run.killed,
                         "returncode": s.run.returncode, "last_step": s.run.last_step,
                         "lineage": sorted(s.lineage), "wall_seconds": round(s.run.wall_seconds, 2),
                         "error": s.error} for s in segments],
        "param_diffs": diffs,
        "reference": {"world_size": ref.nproc, "wall_seconds": round(ref.wall_seconds, 2),
                      "write_phase_ms": round(_median(_phase_durations(ref_events, "write", "manifest"), 0) * 1e3, 1),
                      "step_ms": round(step_s * 1e3, 2)},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    _print_summary(report)
    print(f"\n{'PASS' if ok else 'FAIL'}: {len(kills)} kills, total {total:.1f} s; report in {out / 'report.json'}")
    return 0 if ok else 1


def _print_summary(report: dict[str, Any]) -> None:
    print()
    head = ["kill", "seg", "ranks", "aimed", "hit", "save", "+ms", "newest", "resumed", "ok"]
    rows = [head]
    for k in report["per_kill"]:
        rows.append([str(k["kill"]), str(k["segment"]), f"{k['world_size_before']}->{k['world_size_after']}",
                     k["phase_aimed"], k["phase_hit"], str(k["save_step"]),
                     "-" if k["offset_actual_s"] is None else f"{k['offset_actual_s'] * 1e3:.0f}",
                     str(k["newest_committed"]), str(k["resumed_from"]), "ok" if k["resume_ok"] else "NO"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    keys = ["kills", "resumes", "corrupt_loads", "lost_committed_checkpoints", "duplicated_samples",
            "skipped_samples", "max_abs_param_diff", "max_abs_param_diff_same_world_size",
            "max_abs_param_diff_changed_world_size", "wrong_resumes", "world_size_changes"]
    print("  ".join(f"{k}={report[k]}" for k in keys))
    print(f"phases aimed: {report['phases_aimed']}")
    print(f"phases hit:   {report['phases_hit']}")
    if report["orphaned_checkpoint_dirs"] or report["leftover_entries"]:
        print(f"  [warn] left in the root at the end: step dirs without a manifest "
              f"{report['orphaned_checkpoint_dirs']}, other entries {report['leftover_entries']}")
    for r in report["requirements"]:
        print(f"  [{'ok' if r['ok'] else 'FAIL'}] {r['what']}: {r['value']}")


if __name__ == "__main__":
    sys.exit(main())
