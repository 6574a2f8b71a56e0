"""Scale: distckpt's per-step and coordination costs as the world size W grows, side by side with
plain torch.distributed collectives at the same W, plus probes of the pure pieces up to W = 16,384.

``python -m benchmarks.bench_scale --out DIR`` (defaults: W = 2, 4, 8, 16, 32 forked gloo ranks,
about 5-10 minutes on 2 cores; ``--quick``: W = 2, 4 and small probes, under a minute) writes
``DIR/results.json``, ``DIR/results.md`` (also printed) and ``DIR/plot.png``; ``--render-only``
rebuilds the last two from ``DIR/results.json`` (the goals need the default W = 2..32).

Ranks. One rank set per W (``benchmarks._ranks``), simulated nodes of 4 ranks
(``DISTCKPT_NODE_ID``), a tiny state (a two-layer MLP with AdamW: I/O is negligible) and all the
phases of ``benchmarks._scale_ranks`` in it: plain ``barrier`` / ``all_reduce`` /
``all_gather_object``; ``maybe_save`` on a step with nothing due (after a sleep standing for the
GPU's compute) with the default schedule, ``interval_steps: auto`` and preemption off; a blocking
save (coordination = save - a plain write + fsync of the same bytes by the same ranks); a load;
the memory tier's start-up, snapshot stall and restore after a crash. This machine runs W ranks
on 2 cores: every figure grows with W partly because the machine is oversubscribed, so each
distckpt figure is also divided by the plain collectives' cost at the same W (the geometric mean
of the three medians; ``vs plain``) and its growth is read from that ratio.

Growth. The exponent of a figure is the least-squares slope of log(seconds) against log(W) over
the measured W; ``exponent_vs_<x>`` is the slope of log(seconds / x), x the geometric mean of the
plain collectives (``plain``) or each of them. The goals of issue 34 are checked against them
(``GOALS``; the restore's growth against the plain collective that grew least, the strictest).

Probes (single process, ``benchmarks._scale_probes``, which import the modules under test):
replica placement per rank (``NodeLayout.targets`` / ``sources``, ``assign_replicated``) and the
manifest a save commits at W with 8 GiB per rank (size, build and serialisation seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._output import commit, machine_info, prepare_dirs, pyplot, save_figure, write_outputs
from benchmarks._ranks import run_ranks
from benchmarks._scale_probes import manifest_probe, placement_probe

# (label, results key, how ranks combine: "median" of the per-rank values or their "max")
PHASES = (
    ("maybe_save, nothing due (default)", "step_default_s", "median"),
    ("maybe_save, nothing due (auto)", "step_auto_s", "median"),
    ("maybe_save, nothing due (preemption off)", "step_no_vote_s", "median"),
    ("save", "save_s", "max"),
    ("save I/O (plain write + fsync)", "io_s", "max"),
    ("save coordination (save - I/O)", "coord_s", "max"),
    ("load", "load_s", "max"),
    ("memory: snapshot stall", "stall_s", "max"),
    ("memory: manager construction", "construct_on_s", "max"),
    ("memory: tier start-up (construction on - off)", "startup_s", "max"),
    ("memory: restore", "restore_s", "max"),
)
PLAIN = ("barrier_s", "all_reduce_s", "all_gather_object_s")
GOALS = {  # issue 34's acceptance targets
    "step_w2_max_s": 1e-4,
    "step_growth_max": 1.5,  # at the largest W over W = 2
    "restore_max_s": 1.5,
    "restore_exponent_vs_plain_max": 1.1,  # against each plain collective
    "manifest_w1024_max_bytes": 1 << 20,
}


def growth_exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(seconds) against log(W) over ``(W, seconds)`` points (``None``
    with fewer than two points or a non-positive time)."""
    pts = [(w, t) for w, t in points if t is not None and t > 0]
    if len(pts) < 2:
        return None
    xs, ys = [math.log(w) for w, _ in pts], [math.log(t) for _, t in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def summarize(world_size: int, values: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per W from the ranks' values: each measurement's rank-0 value, median and max over ranks."""
    for v in values:
        v["coord_s"] = max(v["save_s"] - v["io_s"], 0.0)
        v["startup_s"] = v["construct_on_s"] - v["construct_off_s"]
        v.update(v.pop("plain"))
    row: dict[str, Any] = {"world_size": world_size, "restore_tiers": sorted({v["restore_tier"] for v in values})}
    for key in [k for _, k, _ in PHASES] + list(PLAIN) + ["construct_off_s", "construct_restart_s"]:
        per_rank = [v[key] for v in values]
        row[key] = {"rank0": per_rank[0], "median": statistics.median(per_rank), "max": max(per_rank)}
    row["plain_s"] = math.exp(statistics.fmean(math.log(row[k]["median"]) for k in PLAIN))
    return row


def value(row: dict[str, Any], key: str, how: str) -> float:
    return row[key][how]


def _plain(row: dict[str, Any], ref: str) -> float:
    return row["plain_s"] if ref == "plain_s" else row[ref]["median"]


def growth(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and plain collective: exponent, and exponent once the plain cost is divided out."""
    out: dict[str, Any] = {}
    for _, key, how in PHASES:
        pts = [(r["world_size"], value(r, key, how)) for r in rows]
        out[key] = {"exponent": growth_exponent(pts)}
        for ref in ("plain_s",) + PLAIN:  # the plain collectives' own growth divided out, one at a time
            rel = [(r["world_size"], value(r, key, how) / _plain(r, ref)) for r in rows]
            out[key][f"exponent_vs_{ref[:-2]}"] = growth_exponent(rel)
    for key in PLAIN:
        out[key] = {"exponent": growth_exponent([(r["world_size"], r[key]["median"]) for r in rows])}
    out["plain_s"] = {"exponent": growth_exponent([(r["world_size"], r["plain_s"]) for r in rows])}
    return out


def goals(results: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each acceptance target of issue 34 with whether this run meets it (skipped when not measured)."""
    rows, g = results["rows"], results["growth"]
    out = []
    by_w = {r["world_size"]: r for r in rows}
    if 2 in by_w:
        step2 = value(by_w[2], "step_default_s", "median")
        top = rows[-1]
        step_top = value(top, "step_default_s", "median")
        out.append(
            (f"maybe_save, nothing due, at W=2 <= 0.1 ms ({step2 * 1e3:.3f} ms)", step2 <= GOALS["step_w2_max_s"])
        )
        ratio = step_top / step2
        out.append(
            (
                f"maybe_save, nothing due, at W={top['world_size']} <= 1.5 x W=2 ({ratio:.2f} x)",
                ratio <= GOALS["step_growth_max"],
            )
        )
    if 32 in by_w:
        r = value(by_w[32], "restore_s", "max")
        out.append((f"memory restore at W=32 <= 1.5 s ({r:.2f} s)", r <= GOALS["restore_max_s"]))
    vs = {ref: g["restore_s"][f"exponent_vs_{ref[:-2]}"] for ref in PLAIN}
    if None not in vs.values():
        worst = max(vs, key=lambda ref: vs[ref])  # the plain collective that grew least: the strictest reading
        e = vs[worst]
        out.append(
            (
                f"memory restore growth / plain `{worst[:-2]}`'s (the strictest) <= W^1.1 (W^{e:.2f})",
                e <= GOALS["restore_exponent_vs_plain_max"],
            )
        )
    m = next((p for p in results["manifest"] if p["world_size"] == 1024), None)
    if m is not None:
        out.append(
            (
                f"manifest at W=1,024, 8 GiB per rank <= 1 MB ({m['manifest_bytes'] / 1e6:.1f} MB)",
                m["manifest_bytes"] <= GOALS["manifest_w1024_max_bytes"],
            )
        )
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _exp(e: float | None) -> str:
    return "-" if e is None else f"W^{e:.2f}"


def render(results: dict[str, Any]) -> str:
    """Markdown: phases by W (ms), plain collectives, growth, the probes and the goals."""
    meta, rows, g = results["meta"], results["rows"], results["growth"]
    ws = [r["world_size"] for r in rows]
    head = "| " + " | ".join(f"W={w}" for w in ws) + " |"
    lines = [
        f"# Scale ({meta['date']}, commit {meta.get('commit', '?')}, {meta['machine'].get('cpu_count')} CPUs, "
        f"{meta['seconds']:.0f} s)",
        "",
        "Milliseconds; `maybe_save` rows: median over ranks of each rank's median step; other rows: slowest rank. "
        "Growth: W^slope of a least-squares fit of log(time) on log(W); `/ x`: the same of time / x at each W "
        "(plain: geometric mean of the three plain collectives).",
        "",
        "| phase " + head + " growth | / plain | / barrier | / all_reduce | / all_gather_object |",
        "|---" * (len(ws) + 6) + "|",
    ]
    for label, key, how in PHASES:
        cells = " | ".join(_ms(value(r, key, how)) for r in rows)
        rel = " | ".join(_exp(g[key][f"exponent_vs_{ref[:-2]}"]) for ref in ("plain_s",) + PLAIN)
        lines.append(f"| {label} | {cells} | {_exp(g[key]['exponent'])} | {rel} |")
    for key in PLAIN:
        cells = " | ".join(_ms(r[key]["median"]) for r in rows)
        lines.append(f"| plain `{key[:-2]}` (median) | {cells} | {_exp(g[key]['exponent'])} | | | | |")
    cells = " | ".join(_ms(r["plain_s"]) for r in rows)
    lines.append(f"| plain, geometric mean of the three | {cells} | {_exp(g['plain_s']['exponent'])} | | | | |")
    lines.append("")
    lines.append(
        "maybe_save (default), rank 0 / max over ranks: "
        + ", ".join(
            f"W={r['world_size']}: {_ms(r['step_default_s']['rank0'])} / {_ms(r['step_default_s']['max'])}"
            for r in rows
        )
        + ". Memory restores served by: "
        + ", ".join(f"W={r['world_size']}: {'/'.join(r['restore_tiers'])}" for r in rows)
        + "."
    )
    lines += ["", "Probes (one process): placement per rank, ms (nodes of 4 ranks, one replica)", ""]
    lines += ["| W | targets | sources | assign_replicated (256 tensors) |", "|---|---|---|---|"]
    for p in results["placement"]:
        lines.append(
            f"| {p['world_size']:,} | {_ms(p['targets_s'])} | {_ms(p['sources_s'])} | {_ms(p['assign_replicated_s'])} |"
        )
    for name in ("targets_s", "sources_s", "assign_replicated_s"):
        e = growth_exponent([(p["world_size"], p[name]) for p in results["placement"] if p["world_size"] >= 64])
        lines.append(f"- `{name[:-2]}` growth from W = 64: {_exp(e)}")
    lines += ["", "Manifest of a save with 8 GiB per rank:", ""]
    lines += ["| W | manifest MB | per-rank digest files, MB in all | rank 0 build + to_json s |", "|---|---|---|---|"]
    for p in results["manifest"]:
        mb, digests = p["manifest_bytes"] / 1e6, p.get("digest_bytes", 0) / 1e6
        lines.append(f"| {p['world_size']:,} | {mb:.2f} | {digests:.1f} | {p['build_s']:.3f} |")
    lines += ["", "Goals (issue 34):", ""]
    lines += [f"- {text}: **{'met' if ok else 'missed'}**" for text, ok in goals(results)]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Left: each phase vs W, with the plain collectives; right: the same divided by plain."""
    plt = pyplot()
    if plt is None:
        return False
    rows = results["rows"]
    ws = [r["world_size"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8))
    for i, (label, key, how) in enumerate(PHASES):
        ys = [value(r, key, how) if value(r, key, how) > 0 else math.nan for r in rows]  # log axes
        style = {"color": plt.cm.tab20(i), "marker": "os^v"[i % 4], "markersize": 3, "label": label}
        axes[0].plot(ws, [y * 1e3 for y in ys], **style)
        axes[1].plot(ws, [y / r["plain_s"] for y, r in zip(ys, rows)], **style)
    for key in PLAIN:
        axes[0].plot(ws, [r[key]["median"] * 1e3 for r in rows], "--", color="gray", label=f"plain {key[:-2]}")
    for ax, ylabel in zip(axes, ("milliseconds", "x plain collectives at the same W")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size W (forked gloo ranks, 2 cores)")
        ax.set_ylabel(ylabel)
    axes[0].set_title(f"Scale ({results['meta']['date']})")
    axes[1].set_title("divided by the plain collectives' cost")
    handles, labels = axes[0].get_legend_handles_labels()
    axes[1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save_figure(fig, path)
    return True


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench_scale", help="output directory (default runs/bench_scale)")
    p.add_argument("--data-dir", default=None, help="checkpoints and memory snapshots (default OUT/data)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--steps", type=int, default=30, help="maybe_save steps per variant (default 30)")
    p.add_argument("--step-s", type=float, default=0.05, help="the compute of one step, slept (default 0.05)")
    p.add_argument("--reps", type=int, default=30, help="calls of each plain collective (default 30)")
    p.add_argument("--saves", type=int, default=3, help="timed saves per W (default 3)")
    p.add_argument("--constructs", type=int, default=3, help="managers built with memory on and off (default 3)")
    p.add_argument("--memory-steps", type=int, default=8, help="steps with a memory snapshot (default 8)")
    p.add_argument("--placement-sizes", type=int, nargs="+", default=[2, 16, 64, 256, 1024, 4096, 16384])
    p.add_argument("--manifest-sizes", type=int, nargs="+", default=[2, 16, 128, 1024])
    p.add_argument("--timeout-s", type=float, default=600.0, help="per rank set (default 600)")
    p.add_argument("--quick", action="store_true", help="smoke test: W = 2, 4, few steps, small probes")
    p.add_argument("--render-only", action="store_true", help="rebuild results.md and plot.png from results.json")
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.steps, args.reps, args.saves, args.memory_steps = [2, 4], 8, 5, 1, 3
        args.constructs = 1
        args.placement_sizes, args.manifest_sizes, args.timeout_s = [2, 64, 1024], [2, 16], min(args.timeout_s, 180)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every rank set finished and every restore came from memory, else 1."""
    args = _parse_args(argv)
    out, data = prepare_dirs(args)
    if args.render_only:
        results = json.loads((out / "results.json").read_text())
        results["growth"] = growth(results["rows"])
        write_outputs(out, results, render, plot)
        return 0
    started = time.perf_counter()
    rows = []
    for w in sorted(args.world_sizes):
        cell = data / f"w{w}"
        shutil.rmtree(cell, ignore_errors=True)
        spec = {k: getattr(args, k) for k in ("steps", "step_s", "reps", "saves", "memory_steps", "constructs")}
        t0 = time.perf_counter()
        values = run_ranks(
            "benchmarks._scale_ranks:rank_main",
            w,
            dict(spec, dir=str(cell)),
            timeout_s=args.timeout_s,
            preload=("torch", "torch.distributed", "torch.distributed.checkpoint", "distckpt"),
            label=f"bench_scale W={w}",
        )
        shutil.rmtree(cell, ignore_errors=True)
        rows.append(summarize(w, values))
        print(
            f"[bench_scale] W={w}: {time.perf_counter() - t0:.1f} s, load average {os.getloadavg()[0]:.1f}", flush=True
        )
    print("[bench_scale] probes ...", flush=True)
    placement = placement_probe(args.placement_sizes)
    manifest = manifest_probe(args.manifest_sizes)
    if args.data_dir is None:
        shutil.rmtree(data, ignore_errors=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "args": vars(args),
        "machine": machine_info(out),
        "loadavg_end": os.getloadavg(),
        "seconds": time.perf_counter() - started,
    }
    results = {"meta": meta, "rows": rows, "growth": growth(rows), "placement": placement, "manifest": manifest}
    write_outputs(out, results, render, plot)
    return 0 if all(r["restore_tiers"] == ["memory"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
