"""The chaos run's command line and driver: a reference job, then killed and restarted
segments on one checkpoint root, each inspected after it ends (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distckpt import ConfigError
from distckpt._ondisk.layout import checkpoint_name
from distckpt._storage.commit import verify
from launch.config import load_job_config
from launch.jobs import REPO, Run
from launch.s3_server import committed_locations
from tests.chaos.aim import (
    PHASE_WEIGHTS,
    choose_aim,
    classify_phase,
    describe_disk,
    inspect_root,
    inspect_s3_root,
    lost_checkpoints,
    next_world_size,
)
from tests.chaos.report import build_report, load_model_tensors, param_diff, print_summary
from tests.chaos.runner import KillRecord, Segment, median, phase_durations, run_job

__all__ = ["SMALL_MODEL", "main"]

SMALL_MODEL = ["model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.dropout=0.1"]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos",
        description="Chaos test: SIGKILL a training job at random instants inside "
        "checkpoint saves, restart, check (tests/chaos/__init__.py).",
        epilog="example: python -m tests.chaos --kills 30 --out runs/chaos",
    )
    p.add_argument("--kills", type=int, default=30, help="SIGKILLs to inflict (default 30)")
    p.add_argument("--out", default="runs/chaos", help="output directory (default runs/chaos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    p.add_argument("--steps", type=int, default=0, help="T, the target step; 0: interval * (2 * kills + 4) (default 0)")
    p.add_argument("--interval", type=int, default=2, help="checkpoint every this many steps (default 2)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoint.retention.keep_last (default 2)")
    p.add_argument("--epoch-steps", type=int, default=10, help="cut the corpus to this many steps per epoch")
    p.add_argument("--global-batch", type=int, default=8, help="G, constant across world sizes (default 8)")
    p.add_argument("--seq-len", type=int, default=32, help="model.seq_len and data.seq_len (default 32)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="to restart with")
    p.add_argument("--ref-world-size", type=int, default=2, help="world size of the reference and start")
    p.add_argument(
        "--fixed-kills", type=int, default=-1, help="restarts kept at the reference world size first; -1: kills // 3"
    )
    p.add_argument(
        "--change-prob",
        type=float,
        default=0.5,
        help="probability that a later restart changes the world size (default 0.5)",
    )
    p.add_argument("--pause-ms", type=float, default=40.0, help="LAUNCH_CHAOS_PAUSE_S in killed segments, ms")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |param diff| after a world-size change")
    p.add_argument("--run-timeout-s", type=float, default=180.0, help="timeout of each torchrun job")
    p.add_argument("--config", default="launch/configs/ddp.yaml", help="job YAML")
    p.add_argument(
        "--storage",
        choices=("posix", "s3"),
        default="posix",
        help="s3: the chaos root is s3://distckpt-chaos/checkpoints on a SeaweedFS server started "
        "on loopback (the reference run stays on local disk)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="the memory tier on: one elastic job of two simulated nodes, random worker crashes and "
        "node losses, each recovered from memory (tests/chaos/nodes.py)",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="--memory: workers per node (default 1)")
    p.add_argument(
        "--param-tolerance",
        type=float,
        default=1e-3,
        help="--memory: max |param - reference| of a committed checkpoint (default 1e-3; see tests/chaos/nodes.py)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="section.key=value",
        help="extra override for every job (repeatable; wins over the defaults)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the chaos test; returns 0 when every requirement holds, 1 when one fails, 2 on bad input."""
    args = _parse_args(argv)
    if args.memory:
        from tests.chaos.nodes import run_memory

        return run_memory(args, SMALL_MODEL)
    if args.storage != "s3":
        return _run(args)
    from launch.s3_server import S3Server

    with S3Server() as server:  # stopped (and its data removed) whatever happens
        server.create_bucket("distckpt-chaos")
        os.environ.update(server.env())  # the torchrun jobs inherit endpoint and keys
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    n, interval, g = args.kills, args.interval, args.global_batch
    steps = args.steps or interval * (2 * n + 4)
    if args.fixed_kills < 0:
        args.fixed_kills = n // 3
    bad = [w for w in args.world_sizes + [args.ref_world_size] if w < 1 or g % w]
    if n < 0 or steps < 2 * interval or args.keep_last < 1 or bad:
        print(
            f"error: need --kills >= 0, --steps >= 2 * --interval, --keep-last >= 1 and world sizes "
            f"dividing --global-batch {g} (bad: {bad})",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out).resolve()
    overrides = [
        *SMALL_MODEL,
        f"model.seq_len={args.seq_len}",
        f"data.seq_len={args.seq_len}",
        f"data.global_batch_size={g}",
        f"data.max_bytes={args.epoch_steps * g * (args.seq_len + 1)}",
        f"train.steps={steps}",
        f"train.warmup_steps={steps // 6}",
        "train.log_every=1000",
        f"checkpoint.schedule.interval_steps={interval}",
        f"checkpoint.retention.keep_last={args.keep_last}",
        *args.overrides,
    ]
    try:
        cfg = load_job_config(REPO / args.config, overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keep_last = cfg.checkpoint.retention.keep_last or args.keep_last
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
        ref_events, _, _, _ = run_job(
            ref, cmd_tail + ["checkpoint.retention.keep_last=null"], timeout_s=args.run_timeout_s
        )
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if ref.returncode != 0 or ref.last_step != steps:
        print((ref.out / "torchrun.log").read_text()[-4000:], file=sys.stderr)
        print(f"error: the reference run failed (exit {ref.returncode}, step {ref.last_step})", file=sys.stderr)
        return 1
    start_ev = ref.event("start") or {}
    info = {
        "global_batch_size": g,
        "sampler_seed": cfg.data.seed,
        "dataset_len": start_ev.get("dataset_len", 0),
        "steps_per_epoch": start_ev.get("steps_per_epoch", 1),
    }
    write_durations = phase_durations(ref_events, "write", "manifest")
    step_s = median([m["step_seconds"] for m in ref.metrics.values() if not m["checkpoint_seconds"]], 0.01)
    log(
        f"reference: done in {ref.wall_seconds:.1f} s; {info['steps_per_epoch']} steps/epoch, "
        f"write phase {median(write_durations, 0.0) * 1e3:.0f} ms, {step_s * 1e3:.0f} ms/step"
    )
    ref_cache: dict[int, dict[str, torch.Tensor]] = {}

    def ref_params(step: int) -> dict[str, torch.Tensor]:
        if step not in ref_cache:
            ref_cache[step] = load_model_tensors(ref.ckpt_root / checkpoint_name(step))
        return ref_cache[step]

    # 2. chaos segments
    root: Any = out / "chaos" / "checkpoints"
    weights, inspect = PHASE_WEIGHTS, inspect_root
    if args.storage == "s3":  # S3's commit has no rename phase
        root, inspect = "s3://distckpt-chaos/checkpoints", inspect_s3_root
        weights = {k: v for k, v in PHASE_WEIGHTS.items() if k != "rename"}

    def ckpt(step: int) -> Any:
        """The checkpoint of ``step`` in the chaos root (a directory, or an S3 data prefix)."""
        if args.storage == "s3":
            return committed_locations(root)[step]
        return root / checkpoint_name(step)

    def problems_of(step: int) -> list[str]:
        if args.storage == "s3":
            from distckpt._storage import open_store

            return [str(p)[:300] for p in open_store(root).verify(ckpt(step))]
        return [str(p)[:300] for p in verify(root / checkpoint_name(step))]

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
                d = param_diff(load_model_tensors(ckpt(s)), ref_params(s))
            except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be read fails the check
                d, error = math.inf, f"{type(e).__name__}: {e}"[:300]
                log(f"cannot compare step {s} with the reference: {error}")
            same = segment.lineage == frozenset({args.ref_world_size})
            diffs.append(
                {
                    "step": s,
                    "segment": segment.index,
                    "lineage": sorted(segment.lineage),
                    "bitwise_expected": same,
                    "max_abs_param_diff": d,
                    "error": error,
                }
            )
            out_diffs[str(s)] = d
        return out_diffs

    index = 0
    while True:
        last = len(kills) >= n
        if index > 0:
            world_size = next_world_size(rng, index, world_size, args, changed, last)
            changed = changed or world_size != segments[-1].world_size
            if kills:
                kills[-1].world_size_after = world_size
        aim = None
        if not last:
            aim = choose_aim(
                rng, expected_resume, steps, interval, pause, median(write_durations, 0.05), step_s, weights
            )
            if aim is None:
                log(f"no save left after step {expected_resume}: stopping at {len(kills)} kills")
                last = True
        parent = segments[-1].run if segments else None
        run = Run(f"seg{index:02d}", world_size, out / "chaos" / f"seg{index:02d}", root, parent=parent)
        seg = Segment(index=index, world_size=world_size, run=run, aim=aim, expected_resume=expected_resume)
        segments.append(seg)
        what = (
            f"kill at {aim.phase} (event {aim.event} #{aim.occurrence} + {aim.offset_s * 1e3:.0f} ms)"
            if aim
            else f"to step {steps}"
        )
        log(f"{run.name}: {world_size} ranks, expect resume from {expected_resume}; {what}")
        try:
            events, aimed, kill_at, started = run_job(
                run, cmd_tail, timeout_s=args.run_timeout_s, pause_s=pause if aim else 0.0, aim=aim
            )
        except TimeoutError as e:
            seg.error = str(e)
            log(f"error: {e}")
            break
        seg.phase_events = events
        write_durations += [d - pause for d in phase_durations(events, "write", "manifest")] if aim else []
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
        disk = inspect(root)
        lost = lost_checkpoints(prev_valid, disk["valid"], keep_last)
        lost_total += lost
        new_diffs = compare_new(seg, disk["valid"])
        newest = disk["valid"][-1] if disk["valid"] else None
        problems = problems_of(newest) if newest is not None else []
        if problems:
            verify_failed_steps.add(newest)
        if run.killed:
            save_events = [e for e in events if e["phase"] in ("stage", "write")]
            save_step = save_events[-1]["step"] if save_events else None
            if save_step is not None and any(e["phase"] == "committed" and e["step"] == save_step for e in events):
                save_step = None  # that save completed: the kill fell between saves
            last_ev = (events[-1]["phase"], events[-1]["step"]) if events else None
            k = KillRecord(
                kill=len(kills) + 1,
                segment=index,
                world_size_before=world_size,
                phase_aimed=aim.phase,
                occurrence=aim.occurrence,
                offset_aimed_s=round(aim.offset_s, 4),
                offset_actual_s=round(kill_at - aimed["t"], 4) if aimed else None,
                instant_s=round(kill_at - started, 3),
                event_step=aimed["step"] if aimed else None,
                save_step=save_step,
                last_event=f"{last_ev[0]}@{last_ev[1]}" if last_ev else None,
                phase_hit=classify_phase(disk, save_step, last_ev, keep_last),
                disk=dict(disk, invalid=sorted(disk["invalid"])),  # reasons: see end_of_run_disk
                last_step_trained=max(run.samples, default=0),
                newest_committed=newest,
                verify_problems=problems,
                lost=lost,
                param_diffs=new_diffs,
            )
            seg.kill = k
            kills.append(k)
            log(
                f"{run.name}: killed at {k.instant_s:.2f} s, aimed {k.phase_aimed} -> hit {k.phase_hit} "
                f"(save {save_step}, last event {k.last_event}); {describe_disk(disk)}"
            )
        else:
            log(
                f"{run.name}: exit {run.returncode} at step {run.last_step}, resumed from {observed} "
                f"({run.wall_seconds:.1f} s); {describe_disk(disk)}"
            )
        if lost:
            log(f"LOST committed checkpoints {lost} (valid before: {prev_valid}, now: {disk['valid']})")
        if not resume_ok:
            log(f"WRONG RESUME: expected {expected_resume}, resumed from {observed}")
        prev_valid, expected_resume = disk["valid"], newest
        index += 1
        if not run.killed or seg.error:
            break

    # 3. analysis
    end_disk = inspect(root)
    total = time.monotonic() - t_start
    settings = {
        "steps": steps,
        "interval_steps": interval,
        "keep_last": keep_last,
        "global_batch_size": g,
        "steps_per_epoch": info["steps_per_epoch"],
        "dataset_len": info["dataset_len"],
        "world_sizes": args.world_sizes,
        "ref_world_size": args.ref_world_size,
        "fixed_kills": args.fixed_kills,
        "pause_ms": args.pause_ms,
        "seed": args.seed,
        "tolerance": args.tolerance,
        "config": args.config,
        "overrides": overrides,
        "storage": args.storage,
    }
    reference = {
        "world_size": ref.nproc,
        "wall_seconds": round(ref.wall_seconds, 2),
        "write_phase_ms": round(median(phase_durations(ref_events, "write", "manifest"), 0) * 1e3, 1),
        "step_ms": round(step_s * 1e3, 2),
    }
    report = build_report(
        args,
        segments=segments,
        kills=kills,
        diffs=diffs,
        lost_total=lost_total,
        verify_failed_steps=verify_failed_steps,
        lineage_of=lineage_of,
        steps=steps,
        info=info,
        settings=settings,
        end_disk=end_disk,
        reference=reference,
        wall_seconds=total,
    )
    report["storage"] = args.storage
    ok = report["ok"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_summary(report)
    print(f"\n{'PASS' if ok else 'FAIL'}: {len(kills)} kills, total {total:.1f} s; report in {out / 'report.json'}")
    return 0 if ok else 1
