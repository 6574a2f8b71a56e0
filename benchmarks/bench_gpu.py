"""GPU benchmark: saves and loads of CUDA-resident state on one GPU, in one prepared run.

Usage (from the repository root; ``make bench-gpu`` runs the first)::

    python -m benchmarks.bench_gpu --out benchmarks/results/gpu
    python -m benchmarks.bench_gpu --dry-run          # print what would run; needs no GPU

Without CUDA it prints ``no CUDA: nothing measured`` and exits 0 without writing anything.
With CUDA it writes ``OUT/results.json``, ``OUT/results.md`` (printed too) and ``OUT/plot.png``
(``benchmarks/_output.py``), in under 8 minutes: no new rank set starts after ``--budget-s``
(420 s) and none runs past ``--budget-s`` + 60 s; cells left out are listed in the results.

What runs, world size 1 (rank 0 on ``cuda:0``), a fresh rank process per cell
(``benchmarks/_ranks.py``: hard timeout, checkpoint data deleted after every cell):

* ``copy``: device-to-host copy bandwidth of a ``min(size, 1 GiB)`` buffer into pinned memory
  (non-blocking + synchronize) and into pageable memory, and host-to-device from pinned: the
  ceiling the staging copy is compared with, measured in the same run.
* ``save``: ``bench_save``'s save worker (``benchmarks/_save_ranks.py``) with its state -- a model
  of bias-free ``Linear`` layers + AdamW, ``--sizes-gib`` (1 and 4) of parameters and optimizer
  state -- built on the GPU; modes ``blocking``, ``async_thread``, ``async_process`` and
  ``async_thread_bgstage`` (thread + background staging). One warm-up save per process
  (allocates the pinned staging buffers; reported as ``first_save_s``) then ``--repeats``
  measured saves. ``stall_s`` is what the training loop waits (``save()`` + ``wait_staged()``,
  with ``--step-compute-s`` of simulated forward/backward between them); ``stall_share`` is it
  over the blocking save's end-to-end time. ``staging_gbps`` is the state's bytes over the
  manifest's ``stage`` time (save call until the write starts: state_dict + D2H copy into the
  pinned buffers) for ``async_thread`` / ``async_process``, and ``staging_of_pinned`` that over
  the measured pinned-copy bandwidth.
* ``load``: ``bench_load``'s workers (``benchmarks/_load_ranks.py``): a checkpoint of
  ``--sizes-gib`` of model parameters written once, then loaded into CUDA tensors cold (page
  cache evicted) and warm, by ``dcp.load`` with ``distckpt.dcp.FileSystemReader`` (the fast
  reader, ``verify=False``) and with DCP's ``FileSystemReader``; every load is checked bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._output import machine_info, prepare_dirs, pyplot, save_figure, write_outputs
from benchmarks._ranks import BenchError, run_ranks

__all__ = ["main", "plan", "render_markdown", "SAVE_MODES", "LOAD_READERS"]

SAVE_MODES = ("blocking", "async_thread", "async_process", "async_thread_bgstage")
STAGED_MODES = ("async_thread", "async_process")  # the D2H copy happens inside save()
LOAD_READERS = ("fast", "stock")
_GIB = 1 << 30
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "distckpt",
    "distckpt.dcp",
)
_WORKERS = {
    "copy": "benchmarks.bench_gpu:copy_bandwidth_worker",
    "save": "benchmarks._save_ranks:_save_worker",
    "write": "benchmarks._load_ranks:_save_worker",
    "load": "benchmarks._load_ranks:_load_worker",
}


def copy_bandwidth_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank side of the ``copy`` cell: D2H into pinned and pageable memory, H2D from pinned (GB/s)."""
    import torch

    cuda = spec["device"] == "cuda"
    n, reps = spec["size_bytes"], spec.get("reps", 5)
    src = torch.ones(n, dtype=torch.uint8, device=spec["device"])
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.empty(n, dtype=torch.uint8)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def gbps(dst: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> float:
        dst.copy_(source, non_blocking=non_blocking)  # warm-up: first touch, pinning
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(source, non_blocking=non_blocking)
        sync()
        return n * reps / (time.perf_counter() - t) / 1e9

    out = {
        "d2h_pinned_gbps": gbps(pinned, src, True),
        "d2h_pageable_gbps": gbps(pageable, src, False),
        "h2d_pinned_gbps": gbps(src, pinned, True),
        "copy_bytes": n,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(
            device_name=props.name,
            device_mem_gib=props.total_memory / _GIB,
            device_count=torch.cuda.device_count(),
            cuda_version=torch.version.cuda,
        )
    return out


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cells of a run, in order: ``{"kind": copy|save|write|load, "size_gib", ...}``."""
    cells: list[dict[str, Any]] = [{"kind": "copy", "size_gib": min(1.0, max(args.sizes_gib))}]
    for size in args.sizes_gib:
        cells += [{"kind": "save", "size_gib": size, "mode": m} for m in args.modes]
    if not args.no_load:
        for size in args.sizes_gib:
            cells.append({"kind": "write", "size_gib": size})
            cells += [{"kind": "load", "size_gib": size, "reader": r} for r in args.readers]
    return cells


def _spec(cell: dict[str, Any], args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    size = int(cell["size_gib"] * _GIB)
    if cell["kind"] == "copy":
        return {"device": args.device, "size_bytes": size}
    if cell["kind"] == "save":
        from distckpt import SaveConfig

        return {
            "device": args.device,
            "size_bytes": size,
            "mode": cell["mode"],
            "root": str(data_dir / "save"),
            "thread_count": SaveConfig.thread_count,
            "saves_per_process": args.repeats,
            "step_compute_s": args.step_compute_s,
        }
    ckpt = str(data_dir / f"load-{cell['size_gib']:g}")
    if cell["kind"] == "write":
        return {"device": args.device, "size_bytes": size, "wrapper": "plain", "dir": ckpt, "save_thread_count": 4}
    return {
        "device": args.device,
        "size_bytes": size,
        "dir": ckpt,
        "reader": cell["reader"],
        "thread_count": None,
    }


def _row(cell: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    row = dict(cell)
    if cell["kind"] == "copy":
        row.update(value)
    elif cell["kind"] == "save":
        saves = value["saves"]
        measured = saves[1:] or saves
        row.update(
            first_save_s=saves[0]["end_to_end_s"],
            state_bytes=value["local_state_bytes"],
            stall_s=statistics.median(s["stall_s"] for s in measured),
            end_to_end_s=statistics.median(s["end_to_end_s"] for s in measured),
            timings_s=value["timings_s"],
            peak_rss_bytes=value["peak_rss_bytes"],
        )
        stage = value["timings_s"].get("stage")
        if cell["mode"] in STAGED_MODES and stage:
            row["staging_gbps"] = value["local_state_bytes"] / stage / 1e9
    elif cell["kind"] == "write":
        row.update(save_s=value["save_s"], state_bytes=value["state_bytes"])
    else:
        for load in value["loads"]:
            row[f"{load['cache']}_s"] = load["load_s"]
            row[f"{load['cache']}_bad"] = load["bad"]
        row["state_bytes"] = value["local_state_bytes"]
    return row


def _derive(rows: list[dict[str, Any]]) -> None:
    """Ratios between cells of the same run: stall share of blocking, staging vs pinned copy,
    fast vs stock load."""
    ok = [r for r in rows if "error" not in r]
    pinned = next((r["d2h_pinned_gbps"] for r in ok if r["kind"] == "copy"), None)
    for r in ok:
        if r["kind"] == "save":
            blocking = next(
                (b for b in ok if b["kind"] == "save" and b["mode"] == "blocking" and b["size_gib"] == r["size_gib"]),
                None,
            )
            if blocking is not None:
                r["stall_share"] = r["stall_s"] / blocking["end_to_end_s"]
                r["e2e_over_blocking"] = r["end_to_end_s"] / blocking["end_to_end_s"]
            if pinned and "staging_gbps" in r:
                r["staging_of_pinned"] = r["staging_gbps"] / pinned
        if r["kind"] == "load" and r["reader"] != "stock":
            stock = next(
                (s for s in ok if s["kind"] == "load" and s["reader"] == "stock" and s["size_gib"] == r["size_gib"]),
                None,
            )
            if stock is not None:
                r["cold_speedup_vs_stock"] = stock["cold_s"] / r["cold_s"]
                r["warm_speedup_vs_stock"] = stock["warm_s"] / r["warm_s"]


def _fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def render_markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (copy bandwidth, saves, loads, errors and cells left out)."""
    meta, rows = results["meta"], results["results"]
    lines = [
        f"# GPU benchmark ({meta.get('date', '')})",
        "",
        f"{meta.get('device_name', '?')}, torch {meta.get('torch_version', '?')}, "
        f"distckpt {meta.get('distckpt_version', '?')}, world size 1, "
        f"wall {_fmt(meta.get('wall_s'), '.0f')} s",
        "",
    ]
    copy = next((r for r in rows if r["kind"] == "copy" and "error" not in r), None)
    if copy:
        lines += [
            f"Copy bandwidth ({copy['copy_bytes'] / _GIB:g} GiB): "
            f"D2H pinned {copy['d2h_pinned_gbps']:.1f} GB/s, "
            f"D2H pageable {copy['d2h_pageable_gbps']:.1f} GB/s, "
            f"H2D pinned {copy['h2d_pinned_gbps']:.1f} GB/s",
            "",
        ]
    saves = [r for r in rows if r["kind"] == "save" and "error" not in r]
    if saves:
        lines += [
            "| size GiB | mode | stall s | stall / blocking | end-to-end s | e2e / blocking | first save s "
            "| staging GB/s | staging / pinned copy |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in saves:
            lines.append(
                f"| {r['size_gib']:g} | {r['mode']} | {_fmt(r['stall_s'])} "
                f"| {_fmt(r.get('stall_share'), '.1%')} "
                f"| {_fmt(r['end_to_end_s'])} | {_fmt(r.get('e2e_over_blocking'), '.2f')} "
                f"| {_fmt(r['first_save_s'])} | {_fmt(r.get('staging_gbps'), '.1f')} "
                f"| {_fmt(r.get('staging_of_pinned'), '.0%')} |"
            )
        lines.append("")
    loads = [r for r in rows if r["kind"] == "load" and "error" not in r]
    if loads:
        lines += [
            "| size GiB | reader | cold s | warm s | cold vs stock | warm vs stock | bitwise |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in loads:
            bad = r.get("cold_bad", []) + r.get("warm_bad", [])
            lines.append(
                f"| {r['size_gib']:g} | {r['reader']} | {_fmt(r['cold_s'])} | {_fmt(r['warm_s'])} "
                f"| {_fmt(r.get('cold_speedup_vs_stock'), '.2f')} "
                f"| {_fmt(r.get('warm_speedup_vs_stock'), '.2f')} "
                f"| {'yes' if not bad else 'NO: ' + ', '.join(bad[:3])} |"
            )
        lines.append("")
    if not saves and not loads and not copy:
        lines += ["(no results)", ""]
    for r in rows:
        if "error" in r:
            lines.append(
                f"- FAILED {r['kind']} {r.get('mode', r.get('reader', ''))} {r['size_gib']:g} GiB: "
                f"{r['error'].splitlines()[0]}"
            )
    for cell in meta.get("skipped_cells", []):
        lines.append(f"- not run (past --budget-s): {cell}")
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def _plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    saves = [r for r in results["results"] if r["kind"] == "save" and "stall_share" in r and r["mode"] != "blocking"]
    loads = [r for r in results["results"] if r["kind"] == "load" and "error" not in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    short = {"async_thread": "thread", "async_process": "process", "async_thread_bgstage": "thread+bg"}
    ax1.bar([f"{short[r['mode']]}\n{r['size_gib']:g} GiB" for r in saves], [100 * r["stall_share"] for r in saves])
    ax1.set_ylabel("stall, % of blocking end-to-end")
    ax1.set_title("async saves of CUDA state")
    ax1.tick_params(axis="x", labelsize=7)
    ax2.bar([f"{r['reader']}\n{r['size_gib']:g} GiB" for r in loads], [r["cold_s"] for r in loads])
    ax2.set_ylabel("cold load into CUDA, s")
    ax2.set_title("fast reader vs stock dcp.load")
    save_figure(fig, path)
    return True


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu", description="Save/load benchmark with CUDA-resident state on one GPU."
    )
    p.add_argument("--out", default="benchmarks/results/gpu", help="output directory (results.json/.md, plot.png)")
    p.add_argument("--data-dir", default=None, help="checkpoints (default: OUT/data; removed at the end)")
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0], help="state sizes (default: 1 4)")
    p.add_argument("--modes", nargs="+", default=list(SAVE_MODES), choices=SAVE_MODES)
    p.add_argument("--readers", nargs="+", default=list(LOAD_READERS), choices=LOAD_READERS)
    p.add_argument("--repeats", type=int, default=2, help="measured saves per process after the warm-up (default: 2)")
    p.add_argument(
        "--step-compute-s",
        type=float,
        default=0.25,
        help="simulated forward/backward between save() and wait_staged() (default: 0.25)",
    )
    p.add_argument("--no-load", action="store_true", help="skip the load cells")
    p.add_argument("--timeout-s", type=float, default=240.0, help="hard limit per rank set (seconds)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new cell after this many seconds")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu only to test this script on a machine without a GPU",
    )
    p.add_argument("--dry-run", action="store_true", help="print the cells that would run and exit")
    args = p.parse_args(argv)
    if any(s <= 0 for s in args.sizes_gib) or args.repeats < 1:
        p.error("--sizes-gib must be > 0 and --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every cell succeeded (or without CUDA: nothing run), else 1."""
    args = _parse(argv)
    cells = plan(args)
    if args.dry_run:
        for cell in cells:
            print(" ".join(f"{k}={v}" for k, v in cell.items()))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing measured (benchmarks.bench_gpu needs a GPU; nothing written)")
        return 0
    import distckpt

    t_start = time.perf_counter()
    out, data_dir = prepare_dirs(args)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    try:
        for cell in cells:
            label = " ".join(f"{k}={v}" for k, v in cell.items())
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                skipped.append(label)
                continue
            # The last cell may run at most 60 s past the budget: the run stays under budget + 60 s.
            timeout_s = max(30.0, min(args.timeout_s, args.budget_s + 60.0 - elapsed))
            try:
                value = run_ranks(
                    _WORKERS[cell["kind"]],
                    1,
                    _spec(cell, args, data_dir),
                    timeout_s=timeout_s,
                    preload=_PRELOAD,
                    label=label,
                )[0]
                rows.append(_row(cell, value))
            except BenchError as e:
                rows.append({**cell, "error": str(e)})
            print(
                f"[bench_gpu {time.perf_counter() - t_start:6.1f} s] {label}: "
                + ("FAILED" if "error" in rows[-1] else "ok"),
                file=sys.stderr,
                flush=True,
            )
            if cell["kind"] == "save":
                shutil.rmtree(data_dir / "save", ignore_errors=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    _derive(rows)
    copy = next((r for r in rows if r["kind"] == "copy" and "error" not in r), {})
    results = {
        "results": rows,
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv),
            "args": vars(args),
            "torch_version": torch.__version__,
            "distckpt_version": distckpt.__version__,
            "device_name": copy.get("device_name", args.device),
            "cuda_version": copy.get("cuda_version"),
            "machine": machine_info(out),
            "wall_s": time.perf_counter() - t_start,
            "skipped_cells": skipped,
            "notes": [],
        },
    }
    write_outputs(out, results, render_markdown, _plot)
    return 1 if any("error" in r for r in rows) or skipped else 0


if __name__ == "__main__":
    # Run through the importable module so that the ranks import ``benchmarks.bench_gpu``.
    from benchmarks.bench_gpu import main as _main

    sys.exit(_main())
