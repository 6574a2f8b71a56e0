"""``interval_steps: auto`` against fixed intervals: a simulation on failure traces, and one real
run of the demo job with injected kills.

``python -m benchmarks.bench_interval --out DIR`` (about 3-6 minutes on 2 cores, most of it the
real run; ``--skip-real`` leaves it out) writes ``DIR/results.json``, ``DIR/results.md`` (also
printed) and ``DIR/plot.png``.

Simulation. A trace is a sequence of failure times (inter-failure times exponential, or Weibull
with shape ``--weibull-shape`` < 1, failures clustering as on real clusters; mean ``M``), a save
cost ``C`` (each save's cost drawn around it, lognormal with ``--cost-sigma``) and a restart time
``R``. A policy computes for ``tau`` seconds, stalls ``C`` for a save, and so on; a failure loses
the work since the last completed save and costs ``R``. Every policy replays the same trace for
``--horizon-mtbf`` MTBFs of wall time; ``goodput`` = work saved by the end / wall time.
``fixed`` policies use one ``tau`` from a geometric grid around Young's optimum (plus
``--default-steps`` x ``--step-s``, the default ``interval_steps: 100`` at that step time);
``auto`` runs distckpt's own schedule state (``benchmarks._scale_probes.AutoIntervalProbe``, on a
simulated clock): it starts from the default prior ``mtbf_s`` (7.9 h, whatever the trace's ``M``),
measures ``C`` from its saves and counts each restart as a failure, as in a job. The sim uses no
overhead ceiling (``max_overhead: null``): the ceiling trades goodput for a bound on time spent
saving by design. The goals: ``auto`` within 1% of the best fixed interval in hindsight on every
trace, and its margin over the default.

Real run. ``launch/train.py`` (DDP, 2 ranks, CPU/gloo) with ``interval_steps: auto``, a short
prior MTBF (so that saves come every few seconds in a run of a minute) and ``max_overhead``;
the whole job is SIGKILLed ``--real-kills`` times, each 10-25 s after the run's first commit, and
restarted from the root. The overhead measured is the time the training loop spent in
``maybe_save`` over its time in steps plus saves (``metrics.jsonl``: ``checkpoint_seconds``,
``step_seconds``), over every run; the goal: within ``max_overhead``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._output import machine_info, pyplot, save_figure, write_outputs
from benchmarks._scale_probes import AutoIntervalProbe, daly_interval, young_interval

GOAL_GAP = 0.01  # auto within 1% of the best fixed interval
TRACES = (  # (distribution, M seconds, C seconds)
    ("exponential", 1800.0, 60.0),
    ("exponential", 3600.0, 5.0),
    ("exponential", 7200.0, 120.0),
    ("exponential", 28800.0, 30.0),
    ("weibull", 1800.0, 60.0),
    ("weibull", 3600.0, 5.0),
    ("weibull", 7200.0, 120.0),
    ("weibull", 28800.0, 30.0),
)


def failure_times(dist: str, mtbf_s: float, horizon_s: float, shape: float, rng: random.Random) -> list[float]:
    """Absolute failure times (seconds) up to ``horizon_s``: a renewal process whose inter-failure
    times are exponential or Weibull(``shape``) with mean ``mtbf_s``."""
    scale = mtbf_s / math.gamma(1.0 + 1.0 / shape)  # Weibull mean = scale * Gamma(1 + 1/k)
    t, out = 0.0, []
    while t < horizon_s:
        t += rng.expovariate(1.0 / mtbf_s) if dist == "exponential" else rng.weibullvariate(scale, shape)
        out.append(t)
    return out


class _Fixed:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    def start(self, now: float, saved: dict[str, Any] | None) -> None:
        pass

    def interval(self) -> float:
        return self.interval_s

    def snapshot(self) -> dict[str, Any] | None:
        return None

    def saved(self, cost_s: float) -> None:
        pass


def simulate(policy: Any, failures: list[float], cost_s: float, restart_s: float, horizon_s: float, seed: int) -> dict:
    """Replay ``failures`` against ``policy``; returns goodput and counts."""
    rng = random.Random(seed)  # the save costs: the same stream for every policy
    sigma = simulate.cost_sigma  # type: ignore[attr-defined]
    clock = getattr(policy, "clock", {"t": 0.0})
    t, done, saves, lost, index, saved = 0.0, 0.0, 0, 0.0, 0, None
    clock["t"] = t
    policy.start(t, None)
    while t < horizon_s:
        while index < len(failures) and failures[index] <= t:  # failed during the restart: restart again
            index += 1
        next_failure = failures[index] if index < len(failures) else math.inf
        tau = policy.interval()
        cost = cost_s * math.exp(rng.gauss(0.0, sigma))
        end = t + tau + cost
        if end <= next_failure and end <= horizon_s:
            clock["t"] = t + tau
            snap = policy.snapshot()
            t = clock["t"] = end
            done, saves = done + tau, saves + 1
            policy.saved(cost)
            saved = snap if snap is not None else saved
            continue
        if next_failure >= horizon_s:
            break  # the horizon ends the segment: its work is not saved
        lost += next_failure - t
        if hasattr(policy, "failing"):
            policy.failing(next_failure)
        t = clock["t"] = next_failure + restart_s
        index += 1
        policy.start(t, saved)
    return {"goodput": done / horizon_s, "saves": saves, "failures": index, "lost_s": lost}


def run_simulation(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every trace against ``auto`` and the fixed grid; returns (rows, per-trace summaries)."""
    simulate.cost_sigma = args.cost_sigma  # type: ignore[attr-defined]
    rows, summaries = [], []
    default_s = args.default_steps * args.step_s
    for i, (dist, mtbf, cost) in enumerate(TRACES):
        name = f"{dist} M={mtbf / 3600:g}h C={cost:g}s"
        horizon = args.horizon_mtbf * mtbf
        failures = failure_times(dist, mtbf, horizon, args.weibull_shape, random.Random(1000 + i))
        young = young_interval(cost, mtbf)
        grid = sorted({young * 10 ** (k / 20) for k in range(-24, 25)} | {default_s})
        fixed = []
        for tau in grid:
            r = simulate(_Fixed(tau), failures, cost, args.restart_s, horizon, seed=i)
            fixed.append({"trace": name, "policy": "fixed", "interval_s": tau, **r})
        auto = AutoIntervalProbe({"t": 0.0})
        r = simulate(auto, failures, cost, args.restart_s, horizon, seed=i)
        auto_row = {"trace": name, "policy": "auto", **r, "median_interval_s": statistics.median(auto.intervals)}
        rows += fixed + [auto_row]
        best = max(fixed, key=lambda x: x["goodput"])
        default = next(x for x in fixed if x["interval_s"] == default_s)
        summaries.append(
            {
                "trace": name,
                "distribution": dist,
                "mtbf_s": mtbf,
                "cost_s": cost,
                "mtbf_over_cost": mtbf / cost,
                "failures": r["failures"],
                "daly_s": daly_interval(cost, mtbf),
                "best_fixed_interval_s": best["interval_s"],
                "best_fixed_goodput": best["goodput"],
                "auto_goodput": auto_row["goodput"],
                "auto_median_interval_s": auto_row["median_interval_s"],
                "auto_gap": 1.0 - auto_row["goodput"] / best["goodput"],
                "default_interval_s": default_s,
                "default_goodput": default["goodput"],
                "auto_over_default": auto_row["goodput"] / default["goodput"] - 1.0,
            }
        )
    return rows, summaries


# ---------------------------------------------------------------- the real run
def run_real(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The demo job with ``interval_steps: auto`` and ``--real-kills`` SIGKILLs; see the module docstring."""
    repo = Path(__file__).resolve().parents[1]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from launch.jobs import Run, launch, read_jsonl

    base = out / "real"
    shutil.rmtree(base, ignore_errors=True)
    root = base / "ckpt"
    overrides = [
        f"train.steps={args.real_steps}",
        "train.log_every=20",
        "checkpoint.schedule.interval_steps=auto",
        f"checkpoint.schedule.mtbf_s={args.real_mtbf_s}",
        f"checkpoint.schedule.min_interval_s={args.real_min_interval_s}",
        f"checkpoint.schedule.max_overhead={args.real_max_overhead}",
        "checkpoint.retention.keep_last=2",
    ]
    rng = random.Random(7)
    runs = []
    for k in range(args.real_kills + 1):
        run = Run(name=f"run{k}", nproc=2, out=base / f"run{k}", ckpt_root=root)
        delay = rng.uniform(10.0, 25.0)  # seconds after this run's first commit

        def kill_when(metrics: list[dict[str, Any]], events: list[dict[str, Any]], delay: float = delay) -> bool:
            commits = [e for e in events if e["event"] == "checkpoint"]
            return bool(commits) and time.time() - commits[0]["time"] > delay

        launch(
            run,
            "launch/configs/ddp.yaml",
            overrides,
            timeout_s=600,
            kill_when=None if k == args.real_kills else kill_when,
        )
        if not run.killed and run.returncode != 0:
            raise RuntimeError(f"{run.name} exited {run.returncode}; log: {run.out / 'torchrun.log'}")
        metrics = read_jsonl(run.out / "metrics.jsonl")
        step_s = sum(m["step_seconds"] for m in metrics)
        save_s = sum(m["checkpoint_seconds"] for m in metrics)
        runs.append(
            {
                "run": run.name,
                "killed": run.killed,
                "returncode": run.returncode,
                "first_step": min((m["step"] for m in metrics), default=None),
                "last_step": max((m["step"] for m in metrics), default=None),
                "saves": sum(1 for m in metrics if m["checkpoint_seconds"] > 0),
                "step_s": step_s,
                "save_s": save_s,
                "overhead": save_s / (step_s + save_s) if step_s + save_s else 0.0,
            }
        )
    step_total, save_total = sum(r["step_s"] for r in runs), sum(r["save_s"] for r in runs)
    # The report a user gets for the root (`distckpt interval ROOT --json`).
    final = json.loads(
        subprocess.run(
            [sys.executable, "-m", "distckpt._cli", "interval", str(root), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    overhead = save_total / (step_total + save_total)
    return {
        "config": overrides,
        "runs": runs,
        "overhead": overhead,
        "max_overhead": args.real_max_overhead,
        "within_max_overhead": overhead <= args.real_max_overhead,
        "all_runs_ok": all(r["killed"] or r["returncode"] == 0 for r in runs) and runs[-1]["returncode"] == 0,
        "final_report": final,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_interval")
    p.add_argument("--horizon-mtbf", type=float, default=400.0, help="simulated wall time, in MTBFs of the trace")
    p.add_argument("--weibull-shape", type=float, default=0.7)
    p.add_argument("--cost-sigma", type=float, default=0.2, help="lognormal spread of each save's cost")
    p.add_argument("--restart-s", type=float, default=120.0)
    p.add_argument("--step-s", type=float, default=2.0, help="seconds per step, for the default interval")
    p.add_argument("--default-steps", type=int, default=100)
    p.add_argument("--skip-real", action="store_true", help="simulation only")
    p.add_argument("--real-steps", type=int, default=200)
    p.add_argument("--real-kills", type=int, default=3)
    p.add_argument("--real-mtbf-s", type=float, default=60.0, help="the prior mtbf_s of the real run")
    p.add_argument("--real-min-interval-s", type=float, default=5.0)
    p.add_argument("--real-max-overhead", type=float, default=0.02)
    args = p.parse_args(argv)
    logging.getLogger("distckpt").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows, summaries = run_simulation(args)
    sim_s = time.perf_counter() - started
    real = None if args.skip_real else run_real(args, out)
    meta = {
        "date": datetime.date.today().isoformat(),
        "args": vars(args),
        "machine": machine_info(out),
        "loadavg_end": os.getloadavg(),
        "simulation_seconds": sim_s,
        "seconds": time.perf_counter() - started,
    }
    results = {"results": rows, "traces": summaries, "real_run": real, "meta": meta}
    write_outputs(out, results, render_markdown, plot)
    sim_ok = all(s["auto_gap"] <= GOAL_GAP for s in summaries)
    real_ok = real is None or (real["within_max_overhead"] and real["all_runs_ok"])
    return 0 if sim_ok and real_ok else 1


def render_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    a = meta["args"]
    lines = [
        f"# Save interval: `auto` vs fixed ({meta['date']}; {a['horizon_mtbf']:g} MTBFs per trace, "
        f"restart {a['restart_s']:g} s, save cost spread {a['cost_sigma']:g}, Weibull shape {a['weibull_shape']:g})",
        "",
        "| trace | M/C | failures | Daly s | best fixed s | auto median s | goodput best fixed | goodput auto "
        f"| auto gap | goodput default ({a['default_steps']} steps x {a['step_s']:g} s) | auto vs default |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["traces"]:
        lines.append(
            f"| {s['trace']} | {s['mtbf_over_cost']:.0f} | {s['failures']} | {s['daly_s']:.0f} | "
            f"{s['best_fixed_interval_s']:.0f} | {s['auto_median_interval_s']:.0f} | {s['best_fixed_goodput']:.4f} | "
            f"{s['auto_goodput']:.4f} | {s['auto_gap']:+.2%} | {s['default_goodput']:.4f} | "
            f"{s['auto_over_default']:+.1%} |"
        )
    worst = max(s["auto_gap"] for s in results["traces"])
    lines += [
        "",
        f"- goal, auto within {GOAL_GAP:.0%} of the best fixed interval on every trace: "
        f"**{'met' if worst <= GOAL_GAP else 'missed'}** (worst gap {worst:+.2%})",
    ]
    real = results.get("real_run")
    if real:
        lines += [
            "",
            f"## Real run: demo job, 2 ranks, {len(real['runs']) - 1} kills",
            "",
            "| run | killed | steps | saves | time in steps s | time in saves s | overhead |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in real["runs"]:
            lines.append(
                f"| {r['run']} | {r['killed']} | {r['first_step']}-{r['last_step']} | {r['saves']} | "
                f"{r['step_s']:.1f} | {r['save_s']:.2f} | {r['overhead']:.2%} |"
            )
        f = real["final_report"]
        d = f["decision"]
        lines += [
            "",
            f"- overhead over all runs {real['overhead']:.2%}, max_overhead {real['max_overhead']:g}: "
            f"**{'met' if real['within_max_overhead'] else 'missed'}**",
            f"- the root's statistics at the end (`distckpt interval`): C = {f['cost_s']:.3f} s, "
            f"M = {f['mtbf_s']:.0f} s ({f['failures']} failures in {f['run_time_s']:.0f} s of run time, prior "
            f"{f['mtbf_prior_s']:g} s), interval {d['interval_s']:.2f} s by {d['formula']}, expected work lost "
            f"per failure {d['expected_loss_s']:.2f} s",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    traces = results["traces"]
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(traces) / cols), cols, figsize=(13, 6), squeeze=False)
    for ax, s in zip(axes.flat, traces):
        fixed = [r for r in results["results"] if r["trace"] == s["trace"] and r["policy"] == "fixed"]
        ax.plot([r["interval_s"] for r in fixed], [r["goodput"] for r in fixed], "-", color="C0", label="fixed")
        ax.axhline(s["auto_goodput"], color="C3", lw=1.2, label="auto")
        ax.axvline(s["auto_median_interval_s"], color="C3", ls=":", lw=1)
        ax.axvline(s["default_interval_s"], color="C7", ls="--", lw=1, label="default (100 steps)")
        ax.set_xscale("log")
        ax.set_ylim(max(0.0, s["best_fixed_goodput"] - 0.15), min(1.0, s["best_fixed_goodput"] + 0.02))
        ax.set_title(s["trace"], fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("interval s", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("goodput", fontsize=8)
    fig.suptitle(f"Goodput of fixed intervals and of auto ({results['meta']['date']})", fontsize=10)
    save_figure(fig, path)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
