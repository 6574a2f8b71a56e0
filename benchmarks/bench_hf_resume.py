"""The Hugging Face Trainer's own ``resume_from_checkpoint`` vs ``DistckptTrainer``, side by side
on the same job: time to resume, exactness, duplicated and skipped samples.

``python -m benchmarks.bench_hf_resume --out DIR`` (about 4 minutes on 2 cores: 10 torchrun
launches of ``launch/hf_job.py``) writes ``DIR/results.json``, ``DIR/results.md`` (also printed)
and ``DIR/plot.png``.

How it measures. The job is ``launch/hf_job.py``: a 2-layer GPT-2 from a config on 96 random
sequences, global batch 8 (12 steps an epoch), 30 steps, a save every 5 steps, cosine LR with
warm-up, no dropout, CPU/gloo. For each mode -- ``hf`` (``transformers.Trainer``, its checkpoint
directories, ``train(resume_from_checkpoint=True)``) and ``distckpt`` (``DistckptTrainer``, async
saves) -- one uninterrupted run at 2 ranks is the reference; one run at 2 ranks is SIGKILLed at
the start of step 18 (mid-epoch 1, last checkpoint at step 15); its output is copied and resumed
once at 2 ranks and once at 4 ranks with 2 samples per rank (the same global batch). Per resumed
run: ``to_first_step_s`` (rank 0: from ``train()`` to the first training step, which includes
loading the checkpoint and, for ``hf``, fast-forwarding the data loader), ``launch_s`` (the whole
torchrun launch), ``bitwise`` (every rank's loss at every step equal to the reference's),
``max_abs_dloss`` (global loss per step vs the reference, over all 30 steps), ``duplicated`` /
``skipped`` samples over the two complete epochs, ``same_order`` (the global sample order equals
the reference's) and ``max_abs_dparam`` (final weights). Both modes replay steps 16-17 (done
after the last checkpoint, before the kill). Timings on this shared 2-core machine are noisy;
the run is one side-by-side pass, not a statistic.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._output import machine_info, pyplot, save_figure, write_outputs
from launch.hf_job import duplicates_and_skips, global_loss, run_job, sample_order, trajectory

KILL_AT, LAST_CKPT, STEPS = 18, 15, 30


def _compare(ref: Path, run: Path) -> dict[str, Any]:
    expected, got = trajectory(ref), trajectory(run)
    steps = sorted(expected)
    complete = sorted(got) == steps
    bitwise = complete and all(
        sorted(got[s]) == sorted(expected[s])
        and [got[s][r]["loss"] for r in sorted(got[s])] == [expected[s][r]["loss"] for r in sorted(expected[s])]
        for s in steps
    )
    dloss = max((abs(global_loss(got[s]) - global_loss(expected[s])) for s in steps if s in got), default=None)
    order = sample_order(got)
    dups, skips = duplicates_and_skips(order)
    final_ref, final_run = torch.load(ref / "final.pt"), torch.load(run / "final.pt")
    timing = sorted(run.glob("timing-*.json"), key=lambda p: p.stat().st_mtime)[-1]
    return {
        "steps_recorded": len(got),
        "bitwise": bitwise,
        "max_abs_dloss": dloss,
        "duplicated": dups,
        "skipped": skips,
        "same_order": order == sample_order(expected),
        "max_abs_dparam": max((final_ref[k] - final_run[k]).abs().max().item() for k in final_ref),
        "to_first_step_s": json.loads(timing.read_text())["to_first_step_s"],
    }


def run_mode(mode: str, work: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Reference, kill, resume at 2 and at 4 ranks for ``mode``; one row per resumed run."""
    common = ["--mode", mode, "--max-steps", str(STEPS), "--save-steps", "5"]
    if mode == "distckpt":
        common.append("--async-save")
    resume = ["--resume"] if mode == "hf" else []
    ref, killed = work / f"{mode}-ref", work / f"{mode}-killed"
    rc, _ = run_job(ref, 2, *common, timeout_s=timeout_s)
    if rc != 0:
        raise RuntimeError(f"{mode}: the reference run failed ({rc}); see {ref}-torchrun.log")
    rc, _ = run_job(killed, 2, *common, "--kill-at-step", str(KILL_AT), timeout_s=timeout_s)
    if rc == 0:
        raise RuntimeError(f"{mode}: the run meant to be killed at step {KILL_AT} finished")
    rows = []
    for world in (2, 4):
        run = work / f"{mode}-resumed-{world}"
        shutil.copytree(killed, run)
        extra = ["--per-device", "2"] if world == 4 else []
        rc, launch_s = run_job(run, world, *common, *resume, *extra, timeout_s=timeout_s)
        row: dict[str, Any] = {"mode": mode, "world_from": 2, "world_to": world, "returncode": rc, "launch_s": launch_s}
        if rc == 0:
            row.update(_compare(ref, run))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run both modes; write the outputs; 0 when every distckpt row is exact."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_hf_resume")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per torchrun launch")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    started = time.perf_counter()
    rows = run_mode("hf", work, args.timeout_s) + run_mode("distckpt", work, args.timeout_s)
    meta = {
        "date": datetime.date.today().isoformat(),
        "args": vars(args),
        "machine": machine_info(out),
        "loadavg_end": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "job": f"launch/hf_job.py, {STEPS} steps, kill at step {KILL_AT} (last checkpoint {LAST_CKPT})",
    }
    shutil.rmtree(work, ignore_errors=True)
    results = {"results": rows, "meta": meta}
    write_outputs(out, results, render_markdown, plot)
    ours = [r for r in rows if r["mode"] == "distckpt"]
    exact = all(r["returncode"] == 0 and r["duplicated"] == r["skipped"] == 0 for r in ours)
    return 0 if exact and ours[0].get("bitwise") else 1


def render_markdown(results: dict[str, Any]) -> str:
    """The table of ``results.md``."""
    meta = results["meta"]
    lines = [
        f"# HF Trainer resume: Trainer's own vs distckpt ({meta['date']}, {meta['job']}; "
        f"{meta['seconds']:.0f} s, load average at the end {meta['loadavg_end'][0]:.1f})",
        "",
        "| resume | ranks | to first step s | launch s | bitwise | max \\|dloss\\| | dup | skip | same order "
        "| max \\|dparam\\| |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["results"]:
        name = "Trainer `resume_from_checkpoint`" if r["mode"] == "hf" else "distckpt `DistckptTrainer`"
        if r["returncode"] != 0:
            lines.append(f"| {name} | {r['world_from']} -> {r['world_to']} | failed (exit {r['returncode']}) |||||||")
            continue
        lines.append(
            f"| {name} | {r['world_from']} -> {r['world_to']} | {r['to_first_step_s']:.2f} | {r['launch_s']:.1f} | "
            f"{r['bitwise']} | {r['max_abs_dloss']:.2e} | {r['duplicated']} | {r['skipped']} | {r['same_order']} | "
            f"{r['max_abs_dparam']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Time to first step and max |dloss| per resumed run."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in results["results"] if r["returncode"] == 0]
    labels = [f"{r['mode']}\n{r['world_from']}->{r['world_to']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(labels, [r["to_first_step_s"] for r in rows], color=["C1" if r["mode"] == "hf" else "C0" for r in rows])
    a.set_ylabel("train() to first step (s)")
    b.bar(
        labels, [max(r["max_abs_dloss"], 1e-9) for r in rows], color=["C1" if r["mode"] == "hf" else "C0" for r in rows]
    )
    b.set_yscale("log")
    b.set_ylabel("max |loss - reference| (1e-9 = exact)")
    fig.suptitle(f"HF Trainer resume after SIGKILL at step {KILL_AT} ({results['meta']['date']})", fontsize=9)
    save_figure(fig, path)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
