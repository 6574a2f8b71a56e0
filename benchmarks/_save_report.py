"""Report side of ``bench_save``: goal verdicts, the markdown table and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks._guest_memory import describe_hold
from benchmarks._output import pyplot, save_figure
from benchmarks._save_ranks import _MIB, _RSS_SLACK_BYTES, _TRAIN_MODEL, SAVE_MODES, TRAIN_MODES


# ============================================================================ report
def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def _mib(x: Any) -> str:
    return "-" if x is None else f"{x / _MIB:.0f}"


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per goal: met / missed, by how much."""
    save = [r for r in rows if r["experiment"] == "save" and "error" not in r]
    out = []

    def find(mode, size_bytes, ws):
        return next(
            (r for r in save if r["mode"] == mode and r["size_bytes"] == size_bytes and r["world_size"] == ws), None
        )

    sizes = sorted({r["size_bytes"] for r in save})
    if not sizes:
        return ["no save results"]
    target = min(sizes, key=lambda s: abs(s - (1 << 30)))
    tag = f"{target / _MIB:g} MiB" + ("" if target == 1 << 30 else " (largest size run; goal is at 1 GiB)")
    for mode, limit in (("async_thread", 0.10), ("async_process", 0.10), ("async_thread_bgstage", 0.03)):
        r = find(mode, target, 2)
        if r is None or "stall_over_blocking_e2e" not in r:
            out.append(f"- stall {mode} <= {limit:.0%} of blocking e2e at {tag}, ws=2: not measured")
            continue
        v = r["stall_over_blocking_e2e"]
        copy = r.get("stall_over_copy_limit")
        bound = ""
        blocking = find("blocking", target, 2)
        if copy is not None and blocking is not None and mode != "async_thread_bgstage":
            # Staging in the loop cannot beat copying the local state once.
            floor = r["copy_limit_s"] / blocking["end_to_end_s"]
            bound = f"; stall = {copy:.2f}x the measured copy limit, which alone is {floor:.1%} of blocking" + (
                ": the goal is below what this machine's memory copy allows" if floor > limit else ""
            )
        elif copy is not None:
            bound = f"; stall = {copy:.2f}x the measured copy limit"
        out.append(
            f"- stall {mode} <= {limit:.0%} of blocking e2e at {tag}, ws=2: "
            f"**{'met' if v <= limit else 'missed'}** ({v:.1%}"
            + ("" if v <= limit else f", {v / limit:.1f}x the limit")
            + bound
            + ")"
        )
    worst = [
        (r["e2e_over_blocking_e2e"], r)
        for r in save
        if r.get("e2e_over_blocking_e2e") is not None and math.isfinite(r["e2e_over_blocking_e2e"])
    ]
    if worst:
        bad = [(v, r) for v, r in worst if v > 1.2]
        v, r = max(worst, key=lambda x: x[0])
        out.append(
            f"- async e2e <= 1.2x blocking: **{'met' if not bad else 'missed'}** (met in "
            f"{len(worst) - len(bad)}/{len(worst)} cells); worst {v:.2f}x "
            f"({r['mode']}, {r['size_mib']:g} MiB, ws={r['world_size']})"
        )
    for ws in (1, 2):
        cells = [
            r
            for r in save
            if r["mode"] == "blocking" and r["world_size"] == ws and r.get("write_over_disk") is not None
        ]
        if not cells:
            out.append(f"- blocking write >= 85% of disk bandwidth at ws={ws}: not measured")
            continue
        parts = ", ".join(f"{r['size_mib']:g} MiB {r['write_over_disk']:.0%}" for r in cells)
        ok = all(r["write_over_disk"] >= 0.85 for r in cells)
        out.append(f"- blocking write >= 85% of disk bandwidth at ws={ws}: **{'met' if ok else 'missed'}** ({parts})")
    dist_rows = [r for r in save if r["mode"] != "naive_torch_save"]
    if dist_rows:
        slack = _RSS_SLACK_BYTES
        over = [r for r in dist_rows if r["rss_over_budget_bytes"] > slack]
        worst_r = max(dist_rows, key=lambda r: r["rss_over_budget_bytes"] / max(r["local_state_bytes"], 1))
        big = max(dist_rows, key=lambda r: (r["size_bytes"], r["rss_over_budget_bytes"]))
        out.append(
            f"- peak RSS <= baseline + local state + one staging copy per rank (+{slack // _MIB} MiB slack): "
            f"**{'met' if not over else 'missed'}** (within budget in {len(dist_rows) - len(over)}/{len(dist_rows)} "
            f"distckpt cells); worst relative: {worst_r['mode']} {worst_r['size_mib']:g} MiB "
            f"ws={worst_r['world_size']} "
            f"{worst_r['rss_over_budget_bytes'] / _MIB:+.0f} MiB vs budget "
            f"({worst_r['rss_over_budget_bytes'] / max(worst_r['local_state_bytes'], 1):+.0%} of its local state); "
            f"at the largest size the worst is {big['mode']} ws={big['world_size']} "
            f"{big['rss_over_budget_bytes'] / _MIB:+.0f} MiB"
            + (
                "; over: "
                + ", ".join(
                    f"{r['mode']} {r['size_mib']:g} MiB ws={r['world_size']} "
                    f"{r['rss_over_budget_bytes'] / _MIB:+.0f} MiB"
                    for r in over
                )
                if over
                else ""
            )
        )
    train = [r for r in rows if r["experiment"] == "train" and r["mode"] == "train_async" and "error" not in r]
    for r in train:
        v = r.get("inflight_throughput_ratio")
        spare = "a core spare" if r["world_size"] == 1 else "no spare core"
        goal = " (goal: >= 95%)" if r["world_size"] == 1 else " (no goal: informative)"
        verdict = (
            ""
            if r["world_size"] != 1
            else (f"**{'met' if v is not None and math.isfinite(v) and v >= 0.95 else 'missed'}** ")
        )
        out.append(
            f"- training throughput while an async save is in flight, ws={r['world_size']} ({spare})"
            f"{goal}: {verdict}{_fmt(v, '.0%')} of no-checkpoint steps/s "
            f"({_fmt(r.get('inflight_steps'), '.0f')} steps in flight); whole run incl. stalls "
            f"{_fmt(r['throughput_ratio'], '.0%')}"
        )
    return out


def render_markdown(results: dict[str, Any]) -> str:
    rows, meta = results["results"], results["meta"]
    lines = [
        f"# distckpt save benchmark ({meta['date']})",
        "",
        f"{meta['machine']['cpu_count']} CPUs, {meta['machine']['mem_total_gib']:.0f} GiB RAM, "
        f"torch {meta['torch_version']}, distckpt {meta['distckpt_version']}, data dir "
        f"`{meta['data_dir']}` ({meta['machine'].get('data_fs', '?')}); wall time "
        f"{meta['wall_s']:.0f} s; load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_start'])}, at end "
        f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_end'])}; "
        f"args `{' '.join(meta['argv']) or '(defaults)'}`",
        "",
        f"Guest free page reporting: {describe_hold(meta.get('page_reporting'))}.",
        "",
        "Medians over rounds (each round: every mode once in a fresh set of ranks, order rotated). "
        "stall = save() + wait_staged(); e2e = save() until committed; ratios computed per round. "
        "RSS budget = baseline RSS before the state was built + 2 x local state.",
        "",
    ]
    save = [r for r in rows if r["experiment"] == "save"]
    header = (
        "| size MiB | ws | mode | stall s | e2e s | write GB/s | disk GB/s | write/disk | stall/blk e2e "
        "| copy limit s | stall/copy | e2e/blk e2e | first save s | peak RSS MiB | RSS budget MiB "
        "| bg RSS MiB | n |"
    )
    lines += ["## Save", "", header, "|" + "---|" * (header.count("|") - 1)]
    for r in save:
        if "error" in r:
            lines.append(
                f"| {r['size_mib']:g} | {r['world_size']} | {r['mode']} | FAILED: "
                f"{r['error'].splitlines()[0][:120]} |" + " |" * 13
            )
            continue
        lines.append(
            f"| {r['size_mib']:g} | {r['world_size']} | {r['mode']} | {_fmt(r['stall_s'])} | "
            f"{_fmt(r['end_to_end_s'])} | {_fmt(r['write_gbps'], '.2f')} | {_fmt(r['disk_write_gbps'], '.2f')} | "
            f"{_fmt(r.get('write_over_disk'), '.0%')} | {_fmt(r.get('stall_over_blocking_e2e'), '.1%')} | "
            f"{_fmt(r.get('copy_limit_s'))} | {_fmt(r.get('stall_over_copy_limit'), '.2f')} | "
            f"{_fmt(r.get('e2e_over_blocking_e2e'), '.2f')} | {_fmt(r['first_save_s'])} | "
            f"{_mib(r['peak_rss_bytes'])} | {_mib(r['rss_budget_bytes'])} | {_mib(r['bg_peak_rss_bytes'])} | "
            f"{r['repeats']} |"
        )
    tc = [r for r in rows if r["experiment"] == "thread_count"]
    if tc:
        lines += [
            "",
            "## thread_count (blocking, world size 1)",
            "",
            "| size MiB | thread_count | e2e s | write GB/s | e2e / thread_count=1 | n |",
            "|---|---|---|---|---|---|",
        ]
        for r in tc:
            if "error" in r:
                lines.append(f"| {r['size_mib']:g} | {r['thread_count']} | FAILED | | | |")
                continue
            lines.append(
                f"| {r['size_mib']:g} | {r['thread_count']} | {_fmt(r['end_to_end_s'])} | "
                f"{_fmt(r['write_gbps'], '.2f')} | {_fmt(r.get('e2e_over_tc1'), '.2f')} | {r['repeats']} |"
            )
        if meta.get("thread_count_finding"):
            lines += ["", meta["thread_count_finding"]]
    train = [r for r in rows if r["experiment"] == "train"]
    if train:
        m = _TRAIN_MODEL
        lines += [
            "",
            "## Training interference",
            "",
            f"launch.model.GPT d_model={m['d_model']} n_layer={m['n_layer']} seq_len={m['seq_len']}, "
            f"global batch {train[0]['global_batch']}, one torch thread per rank, save every "
            f"{train[0]['save_every_steps']} steps; throughput ratio = steps/s vs train_none in the same "
            "round; in-flight ratio = steps/s of steps that began while an async save was in flight "
            "(their own compute time) vs train_none's.",
            "",
            "| ws | mode | steps/s | throughput ratio | in-flight steps/s | in-flight ratio | stall s (total) "
            "| saves | n |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in train:
            if "error" in r:
                lines.append(f"| {r['world_size']} | {r['mode']} | FAILED | | | | | | |")
                continue
            label = f"{r['mode']} ({r['async_mode']})" if r["mode"] == "train_async" else r["mode"]
            lines.append(
                f"| {r['world_size']} | {label} "
                f"| {_fmt(r['steps_per_s'], '.2f')} | {_fmt(r['throughput_ratio'], '.1%')} | "
                f"{_fmt(r.get('inflight_steps_per_s'), '.2f') if r['mode'] == 'train_async' else '-'} | "
                f"{_fmt(r.get('inflight_throughput_ratio'), '.1%')} | {_fmt(r['stall_s'])} | "
                f"{r['saves']} | {r['repeats']} |"
            )
    lines += ["", "## Goals", ""] + meta.get("verdicts", [])
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    save = [r for r in results["results"] if r["experiment"] == "save" and "error" not in r]
    train = [r for r in results["results"] if r["experiment"] == "train" and "error" not in r]
    cells = sorted({(r["size_mib"], r["world_size"]) for r in save})
    fig, axes = plt.subplots(1, 2 if train else 1, figsize=(14 if train else 10, 5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(SAVE_MODES), 1)
    for i, mode in enumerate(SAVE_MODES):
        stall = [
            next(
                (r["stall_s"] for r in save if r["mode"] == mode and (r["size_mib"], r["world_size"]) == c),
                float("nan"),
            )
            for c in cells
        ]
        e2e = [
            next(
                (r["end_to_end_s"] for r in save if r["mode"] == mode and (r["size_mib"], r["world_size"]) == c),
                float("nan"),
            )
            for c in cells
        ]
        xs = [j + (i - len(SAVE_MODES) / 2 + 0.5) * width for j in range(len(cells))]
        bars = ax.bar(xs, e2e, width, alpha=0.35, label=f"{mode} e2e")
        ax.bar(
            xs, stall, width, color=bars.patches[0].get_facecolor()[:3] if bars.patches else None, label=f"{mode} stall"
        )
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{s:g} MiB\nws={w}" for s, w in cells])
    ax.set_yscale("log")
    ax.set_ylabel("seconds (solid: stall, light: end-to-end)")
    ax.set_title("Save: training stall and end-to-end time")
    ax.legend(fontsize=7, ncol=2)
    if train:
        ax2 = axes[0][1]
        wss = sorted({r["world_size"] for r in train})
        for i, mode in enumerate(TRAIN_MODES):
            ys = [
                next((r["throughput_ratio"] for r in train if r["mode"] == mode and r["world_size"] == w), float("nan"))
                for w in wss
            ]
            ax2.bar([j + (i - 1) * 0.25 for j in range(len(wss))], ys, 0.25, label=mode)
        ax2.axhline(0.95, color="k", linestyle="--", linewidth=0.8, label="95% goal")
        ax2.set_xticks(range(len(wss)))
        ax2.set_xticklabels([f"ws={w}" for w in wss])
        ax2.set_ylabel("steps/s relative to train_none")
        ax2.set_title("Training throughput with checkpointing")
        ax2.legend(fontsize=8)
    save_figure(fig, path)
    return True
