"""Report side of ``bench_load``: per-cell rows with paired ratios, goal verdicts, the markdown
table and the plot."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Sequence

from benchmarks._guest_memory import describe_hold
from benchmarks._output import pyplot, save_figure

_MIB = 1 << 20


def _median(xs: Sequence[float | None]) -> float:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else float("nan")


def _cell_key(c: dict[str, Any]) -> str:
    return f"{c['scenario']}:{c['saved_world_size']}->{c['world_size']}"


def _rows(args, saved, cells, samples, disk, errors) -> list[dict[str, Any]]:
    rows = []
    same_key = {c["world_size"]: _cell_key(c) for c in cells if c["scenario"] == "same"}
    for cell in cells:
        key = _cell_key(cell)
        ck = saved[cell["ckpt"]]
        probes = disk[cell["ckpt"]]
        disk_seq = [ck["data_bytes"] / s / 1e9 for s, _ in probes]
        disk_par = [ck["data_bytes"] / p / 1e9 for _, p in probes]
        for reader in args.readers:
            per_round = samples[key][reader]
            ok = [s for s in per_round if s is not None]
            for cache in ("cold", "warm"):
                row: dict[str, Any] = {
                    "scenario": cell["scenario"],
                    "cell": key,
                    "reader": reader,
                    "cache": cache,
                    "saved_world_size": cell["saved_world_size"],
                    "world_size": cell["world_size"],
                    "size_mib": args.size_mib,
                    "rounds": len(ok),
                    "disk_read_gbps": _median(disk_seq),
                    "disk_read_par_gbps": _median(disk_par),
                    "checkpoint_bytes": ck["data_bytes"],
                }
                if not ok:
                    row["error"] = next((v for k, v in errors.items() if k == f"{key}/{reader}"), "no samples")
                    rows.append(row)
                    continue
                fld = f"{cache}_s"
                load_s = _median([s[fld] for s in ok])
                state_bytes = ok[0]["global_state_bytes"]
                row.update(
                    {
                        "load_s": load_s,
                        "read_data_s": _median([s[f"{cache}_read_data_s"] for s in ok]),
                        "read_gbps": state_bytes / load_s / 1e9,
                        "state_bytes": state_bytes,
                        "local_state_bytes": ok[0]["local_state_bytes"],
                        "peak_rss_bytes": max(s["peak_rss_bytes"] for s in ok),
                        "rss_extra_bytes": max(s["rss_extra_bytes"] for s in ok),
                        "rss_extra_copies": max(s["rss_extra_copies"] for s in ok),
                        "bitwise_equal": all(not s["bad"] for s in ok),
                        "load_s_samples": [s[fld] if s else None for s in per_round],
                    }
                )
                rfld = f"{cache}_read_data_s"
                row["read_data_gbps"] = state_bytes / row["read_data_s"] / 1e9
                if cache == "cold":
                    row["cold_method"] = ok[0]["cold_method"]
                    row["cold_resident_frac"] = _median([s["cold_resident_frac"] for s in ok])
                    for name, f in (("read_over_disk", fld), ("read_data_over_disk", rfld)):
                        row[name] = _median(
                            [
                                (state_bytes / s[f] / 1e9) / disk_seq[i]
                                for i, s in enumerate(per_round)
                                if s is not None and i < len(disk_seq)
                            ]
                        )
                if ok[0]["stats"]:
                    row["reader_stats"] = ok[0]["stats"]
                if ok[0]["stats"].get("needed_bytes"):  # the fast reader's counters, summed over ranks
                    row["bytes_read"] = ok[0]["stats"]["read_bytes"]
                    row["bytes_needed"] = ok[0]["stats"]["needed_bytes"]
                    row["read_amplification"] = row["bytes_read"] / row["bytes_needed"]
                if not row["bitwise_equal"]:
                    row["error"] = "loaded state differs from the saved one: " + ", ".join(
                        sorted({b for s in ok for b in s["bad"]})[:5]
                    )

                def paired(other: list, f: str, mine_over_other: bool, per_round: list = per_round) -> float:
                    vals = [
                        (s[f] / other[i][f]) if mine_over_other else (other[i][f] / s[f])
                        for i, s in enumerate(per_round)
                        if s is not None and i < len(other) and other[i] is not None
                    ]
                    return _median(vals)

                if "stock" in samples[key] and reader != "stock":
                    row["speedup_vs_stock"] = paired(samples[key]["stock"], fld, False)
                    row["speedup_vs_stock_read_data"] = paired(samples[key]["stock"], rfld, False)
                if cell["scenario"] != "same" and cell["world_size"] in same_key:
                    base = samples[same_key[cell["world_size"]]][reader]
                    row["reshard_ratio"] = paired(base, fld, True)
                    row["reshard_ratio_read_data"] = paired(base, rfld, True)
                rows.append(row)
    return rows


def _find(rows, **kw) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items()) and "error" not in r), None)


def _verdicts(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Goal lines; each names the end-to-end ``dcp.load`` figure first and the reader's own
    (``read_data``) figure in brackets."""
    nan = float("nan")
    out = []
    for ws in args.world_sizes:
        fast = _find(rows, scenario="same", world_size=ws, reader="fast", cache="cold")
        if fast is None or "speedup_vs_stock" not in fast:
            out.append(f"cold load >= 2x stock at ws={ws}: NOT MEASURED")
            continue
        sp, spr = fast["speedup_vs_stock"], fast.get("speedup_vs_stock_read_data", nan)
        out.append(
            f"cold load >= 2x stock throughput at {args.size_mib:g} MiB ws={ws}: "
            f"{'MET' if sp >= 2 else 'MISSED'} (x{sp:.2f}, fast {fast['read_gbps']:.2f} GB/s; "
            f"read_data alone x{spr:.2f}, {fast['read_data_gbps']:.2f} GB/s)"
        )
        rod, rodr = fast.get("read_over_disk", nan), fast.get("read_data_over_disk", nan)
        out.append(
            f"cold load >= 70% of raw sequential read at ws={ws}: "
            f"{'MET' if rod >= 0.7 else 'MISSED'} ({rod:.0%} of {fast['disk_read_gbps']:.2f} GB/s; "
            f"read_data alone {rodr:.0%})"
        )
        fv = _find(rows, scenario="same", world_size=ws, reader="fast_verify", cache="cold")
        if fv is not None and "read_over_disk" in fv:
            out.append(
                f"  (fast_verify at ws={ws}, hashes checked: x{fv.get('speedup_vs_stock', nan):.2f} of stock "
                f"[read_data x{fv.get('speedup_vs_stock_read_data', nan):.2f}], "
                f"{fv['read_over_disk']:.0%} of raw "
                f"[read_data {fv.get('read_data_over_disk', nan):.0%}])"
            )
    rr = [r for r in rows if r["reader"] == "fast" and "reshard_ratio" in r and "error" not in r]
    if rr:
        worst = max(rr, key=lambda r: r["reshard_ratio"])
        worst_rd = max(rr, key=lambda r: r.get("reshard_ratio_read_data", nan))
        out.append(
            f"reshard_ratio <= 1.2 (fast, all reshard cells, cold and warm): "
            f"{'MET' if worst['reshard_ratio'] <= 1.2 else 'MISSED'} (worst {worst['reshard_ratio']:.2f} at "
            f"{worst['cell']} {worst['cache']}; read_data alone worst "
            f"{worst_rd.get('reshard_ratio_read_data', nan):.2f} at {worst_rd['cell']} {worst_rd['cache']})"
        )
    fr = [r for r in rows if r["reader"] in ("fast", "fast_verify") and "error" not in r and r["cache"] == "cold"]
    if fr:
        worst = max(fr, key=lambda r: r["rss_extra_copies"])
        out.append(
            f"peak RSS <= one extra copy of the local state (fast readers): "
            f"{'MET' if worst['rss_extra_copies'] <= 1.0 else 'MISSED'} (worst "
            f"{worst['rss_extra_copies']:.2f} copies = {worst['rss_extra_bytes'] / _MIB:.0f} MiB above the "
            f"built state at {worst['cell']} {worst['reader']})"
        )
    bad = [r for r in rows if r.get("bitwise_equal") is False]
    out.append("every load bitwise equal to the saved state: " + ("MET" if not bad and rows else "MISSED"))
    return out


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def render_markdown(results: dict[str, Any]) -> str:
    meta, rows = results["meta"], results["results"]
    lines = [
        f"# bench_load: {meta.get('size_mib', '?')} MiB, {meta['date']}",
        "",
        f"Machine: {meta['machine'].get('cpu_count')} CPUs, {meta['machine'].get('mem_total_gib', 0):.1f} GiB, "
        f"{meta['machine'].get('data_fs', '')}; torch {meta['torch_version']}; load average "
        f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end; wall {meta['wall_s']:.0f} s.",
        f"Cold cache method: {meta.get('cold_method')} (median resident fraction after eviction: "
        f"{_fmt(meta.get('cold_resident_frac'), '.3f')}). Files per saving rank: "
        f"{meta.get('save_thread_count', 1)}. Rounds: {meta.get('rounds')}; readers rotated per "
        "round; ratios paired within a round, median over rounds.",
        f"Guest free page reporting: {describe_hold(meta.get('page_reporting'))}.",
        "",
    ]
    lines += ["## Goals", ""] + [f"- {v}" for v in meta.get("verdicts", [])] + [""]
    if not rows:
        lines.append("(no load results)")
        return "\n".join(lines) + "\n"
    lines += [
        "## Loads",
        "",
        "| cell | reader | cold s | cold read_data s | cold GB/s | warm s | warm read_data s | warm GB/s | "
        "x stock (cold/warm) | x stock, read_data (cold/warm) | cold / raw seq (load / read_data) | "
        "raw seq GB/s | raw par GB/s | reshard_ratio (cold/warm) | reshard_ratio, read_data (cold/warm) | "
        "peak RSS MiB | extra RSS / local state | read / needed MiB (amplification) | bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    for cell in cells:
        for reader in dict.fromkeys(r["reader"] for r in rows if r["cell"] == cell):
            c: dict[str, Any] = next(
                (r for r in rows if r["cell"] == cell and r["reader"] == reader and r["cache"] == "cold"), {}
            )
            w: dict[str, Any] = next(
                (r for r in rows if r["cell"] == cell and r["reader"] == reader and r["cache"] == "warm"), {}
            )
            if "load_s" not in c:
                lines.append(f"| {cell} | {reader} | ERROR: {str(c.get('error', ''))[:80]} ||||||||||||||||||")
                continue
            lines.append(
                f"| {cell} | {reader} | {_fmt(c['load_s'])} | {_fmt(c.get('read_data_s'))} | "
                f"{_fmt(c['read_gbps'], '.2f')} | "
                f"{_fmt(w.get('load_s'))} | {_fmt(w.get('read_data_s'))} | {_fmt(w.get('read_gbps'), '.2f')} | "
                f"{_fmt(c.get('speedup_vs_stock'), '.2f')} / {_fmt(w.get('speedup_vs_stock'), '.2f')} | "
                f"{_fmt(c.get('speedup_vs_stock_read_data'), '.2f')} / "
                f"{_fmt(w.get('speedup_vs_stock_read_data'), '.2f')} | "
                f"{_fmt(c.get('read_over_disk'), '.2f')} / {_fmt(c.get('read_data_over_disk'), '.2f')} | "
                f"{_fmt(c['disk_read_gbps'], '.2f')} | {_fmt(c['disk_read_par_gbps'], '.2f')} | "
                f"{_fmt(c.get('reshard_ratio'), '.2f')} / {_fmt(w.get('reshard_ratio'), '.2f')} | "
                f"{_fmt(c.get('reshard_ratio_read_data'), '.2f')} / {_fmt(w.get('reshard_ratio_read_data'), '.2f')} | "
                f"{c['peak_rss_bytes'] / _MIB:.0f} | {_fmt(c['rss_extra_copies'], '.2f')} | "
                + (
                    f"{c['bytes_read'] / _MIB:.0f} / {c['bytes_needed'] / _MIB:.0f} ({c['read_amplification']:.2f}) | "
                    if "read_amplification" in c
                    else "- | "
                )
                + f"{'yes' if c.get('bitwise_equal') and w.get('bitwise_equal') else 'NO'} |"
            )
    lines += [
        "",
        "Fields: see the module docstring of `benchmarks/bench_load.py`. `read_data` columns time the "
        "reader's `read_data` alone (slowest rank); the others the whole `dcp.load` between barriers "
        "(planning included: DCP's plan exchange). `extra RSS / local state` = "
        "(peak RSS - RSS after the target state was built) / this rank's state bytes, max over ranks. "
        "`read / needed`: bytes the fast reader read from the files vs the bytes of the items the ranks' "
        "plans need (cold load of the first round, summed over ranks; `read_amplification` in the JSON).",
    ]
    notes = meta.get("notes") or []
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in results["results"] if "error" not in r and r["cache"] == "cold"]
    if not rows:
        return False
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    readers = list(dict.fromkeys(r["reader"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cells)), 5))
    width = 0.8 / (len(readers) + 1)
    for i, reader in enumerate(readers):
        ys = [
            next((r["read_gbps"] for r in rows if r["cell"] == c and r["reader"] == reader), float("nan"))
            for c in cells
        ]
        ax.bar([j + (i - len(readers) / 2) * width for j in range(len(cells))], ys, width, label=reader)
    ys = [next((r["disk_read_gbps"] for r in rows if r["cell"] == c), float("nan")) for c in cells]
    ax.bar(
        [j + (len(readers) / 2) * width for j in range(len(cells))],
        ys,
        width,
        color="grey",
        label="raw sequential read",
    )
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([c.replace(":", "\n") for c in cells], fontsize=8)
    ax.set_ylabel("cold load, GB/s of state")
    ax.set_title(f"DCP load throughput, {results['meta'].get('size_mib')} MiB, cold page cache")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True
