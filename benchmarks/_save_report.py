"""Report side of ``bench_save``: goal verdicts, the markdown table and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks._guest_memory import describe_hold
from benchmarks._output import pyplot, save_figure
from benchmarks._save_ranks import _MIB, _RSS_SLACK_BYTES, _TRAIN_MODEL, ASYNC_MODES, SAVE_MODES, TRAIN_MODES


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


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _copy_limit_s(values: list[dict[str, Any]]) -> float:
    """Per copy the slowest rank (staging waits for it too), median over copies."""
    n = len(values[0]["copy_s"])
    return _median([max(v["copy_s"][i] for v in values) for i in range(n)])


def _save_sample(values: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank set -> one sample: per save max over ranks, then median over measured saves."""
    n = len(values[0]["saves"])

    def per_save(key: str, i: int) -> float:
        return max(v["saves"][i][key] for v in values)

    measured = range(1, n)
    return {
        "stall_s": _median([per_save("stall_s", i) for i in measured]),
        "end_to_end_s": _median([per_save("end_to_end_s", i) for i in measured]),
        "call_s": _median([per_save("call_s", i) for i in measured]),
        "first_save_s": per_save("end_to_end_s", 0),
        "first_save_stall_s": per_save("stall_s", 0),
        "peak_rss_bytes": max(v["peak_rss_bytes"] for v in values),
        "bg_peak_rss_bytes": max(v["bg_peak_rss_bytes"] for v in values),
        "rss_budget_bytes": max(v["baseline_rss_bytes"] + 2 * v["local_state_bytes"] for v in values),
        "rss_over_budget_bytes": max(
            v["peak_rss_bytes"] - v["baseline_rss_bytes"] - 2 * v["local_state_bytes"] for v in values
        ),
        "baseline_rss_bytes": max(v["baseline_rss_bytes"] for v in values),
        "local_state_bytes": max(v["local_state_bytes"] for v in values),
        "global_state_bytes": values[0]["global_state_bytes"],
        "timings_s": values[0]["timings_s"],
        "build_s": max(v["build_s"] for v in values),
    }


def _save_rows(block: dict[str, Any], world_size: int, thread_counts: dict[str, int]) -> list[dict[str, Any]]:
    """Rows of one (size, world size) block; ratios are paired within rounds."""
    size_bytes = block["size_bytes"]
    disk_gbps = size_bytes / _median(block["disk_s"]) / 1e9 if block["disk_s"] else float("nan")
    by_mode = block["samples"]  # {mode: [sample or None (failed) per round]}

    def round_value(mode: str, r: int, key: str) -> float | None:
        s = by_mode.get(mode, [])
        return s[r][key] if r < len(s) and s[r] is not None else None

    def paired(mode: str, other: str, key: str, other_key: str) -> list[float]:
        n = max(len(by_mode.get(mode, [])), len(by_mode.get(other, [])))
        out = []
        for r in range(n):
            a, b = round_value(mode, r, key), round_value(other, r, other_key)
            if a is not None and b is not None:
                out.append(a / b)
        return out

    rows = []
    for mode, per_round in by_mode.items():
        samples = [s for s in per_round if s is not None]
        row: dict[str, Any] = {
            "experiment": "save",
            "mode": mode,
            "size_bytes": size_bytes,
            "size_mib": size_bytes / _MIB,
            "world_size": world_size,
            "thread_count": thread_counts[mode],
            "repeats": len(samples),
            "disk_write_gbps": disk_gbps,
        }
        if not samples:
            row["error"] = block["errors"].get(mode, "no samples")
            rows.append(row)
            continue
        if mode in block["errors"]:
            row["warning"] = "failed in some rounds: " + block["errors"][mode].splitlines()[0][:300]
        e2e = _median([s["end_to_end_s"] for s in samples])
        row.update(
            {
                "stall_s": _median([s["stall_s"] for s in samples]),
                "end_to_end_s": e2e,
                "write_gbps": size_bytes / e2e / 1e9,
                "save_call_s": _median([s["call_s"] for s in samples]),
                "first_save_s": _median([s["first_save_s"] for s in samples]),
                "first_save_stall_s": _median([s["first_save_stall_s"] for s in samples]),
                "peak_rss_bytes": max(s["peak_rss_bytes"] for s in samples),
                "rss_budget_bytes": max(s["rss_budget_bytes"] for s in samples),
                "rss_over_budget_bytes": max(s["rss_over_budget_bytes"] for s in samples),
                "baseline_rss_bytes": max(s["baseline_rss_bytes"] for s in samples),
                "bg_peak_rss_bytes": max(s["bg_peak_rss_bytes"] for s in samples),
                "local_state_bytes": samples[0]["local_state_bytes"],
                "state_bytes": samples[0]["global_state_bytes"],
                "stall_s_samples": [s["stall_s"] for s in samples],
                "end_to_end_s_samples": [s["end_to_end_s"] for s in samples],
            }
        )
        timings = [s["timings_s"] for s in samples if s["timings_s"]]
        for key in ("stage", "write", "commit"):
            if timings:
                row[f"manifest_{key}_s"] = _median([t.get(key, float("nan")) for t in timings])
        copies = block.get("copy_s", [])
        if mode in ASYNC_MODES and any(c is not None for c in copies):
            row["copy_limit_s"] = _median([c for c in copies if c is not None])
            row["stall_over_copy_limit"] = _median(
                [
                    s / c
                    for r, c in enumerate(copies)
                    if c is not None and (s := round_value(mode, r, "stall_s")) is not None
                ]
            )
        if mode in ASYNC_MODES and "blocking" in by_mode:
            row["stall_over_blocking_e2e"] = _median(paired(mode, "blocking", "stall_s", "end_to_end_s"))
            row["e2e_over_blocking_e2e"] = _median(paired(mode, "blocking", "end_to_end_s", "end_to_end_s"))
        if block["disk_s"]:
            ratios = [
                block["disk_s"][r] / e
                for r in range(len(block["disk_s"]))
                if (e := round_value(mode, r, "end_to_end_s")) is not None
            ]
            row["write_over_disk"] = _median(ratios)  # == write_gbps / disk_gbps, per round
        rows.append(row)
    return rows
