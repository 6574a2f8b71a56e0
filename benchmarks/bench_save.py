"""Save benchmark: naive ``torch.save`` vs distckpt blocking / async saves, side by side.

Usage (from the repository root)::

    python -m benchmarks.bench_save --out runs/bench_save
    python -m benchmarks.bench_save --sizes-mib 8 --world-sizes 1 2 --repeats 1 --no-train --out /tmp/b

Writes ``OUT/results.json``, ``OUT/results.md`` (printed too) and ``OUT/plot.png`` (when
matplotlib is installed: the ``bench`` extra). See ``benchmarks/README.md`` for every field.

What is saved: a synthetic FSDP2-like state -- a model of bias-free ``Linear`` layers sized so
that parameters + AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) total ``--sizes-mib`` for
the whole job; at world size > 1 every layer and the root are wrapped with ``fully_shard``
(built on the meta device, so each rank only ever holds its shard); the optimizer is stepped
once so its state exists.

Modes (per size and world size): ``naive_torch_save`` (FULL state dict gathered to rank 0,
``torch.save`` + fsync there), ``blocking`` (``async_mode="off"``), ``async_thread``,
``async_process``, ``async_thread_bgstage`` (thread + ``background_staging``). Beside them, a
plain sequential write + fsync of the same number of bytes into the same directory gives the
disk bandwidth (``disk_write_gbps``).

How it is measured, and why this way:

* **A fresh set of ranks per (mode, size, world size, round).** A mode's process state must
  not leak into another's timing or memory: distckpt's ``DefaultStager`` keeps its staging
  buffers for the life of the manager, DCP's process executor keeps a daemon process for the
  life of the rank, the allocator keeps freed arenas, and the RSS high-water mark
  (``ru_maxrss``) can only grow. So absolute times and peak RSS of a mode come from processes
  that ran that mode only. Ranks are forked from a ``forkserver`` that has already imported
  torch and distckpt, so a fresh set costs well under a second instead of seconds of imports;
  the per-process cost left (building the state, the warm-up save) is what we pay for
  isolation. (The alternative, one process per mode with all repeats inside, is cheaper but
  cannot rotate modes: all of a mode's samples would come from one stretch of time.)
* **Rounds rotate the modes.** Round ``r`` runs every mode (and the disk write) once, in an
  order rotated by ``r``, so slow drift on this noisy machine hits every mode alike. Ratios
  (async stall / blocking end-to-end, async / blocking end-to-end, blocking / disk bandwidth)
  are computed within each round and their median over rounds is reported.
* **Warm-up save per process.** Each process saves once before the measured saves
  (``--saves-per-process``, default 1); that first save (allocating staging buffers, starting
  DCP's checkpoint daemon for ``async_process``) is reported as ``first_save_s`` and kept out
  of the medians.
* ``stall_s`` = time ``save()`` blocked + ``wait_staged()`` (what the loop waits before its
  next ``optimizer.step()``). For the async modes ``--step-compute-s`` (0.25 s) of sleep sits
  between the two, standing for the next step's forward/backward: on a GPU node the CPU mostly
  waits for kernels then, and that window is what background staging hides its copy in.
  ``end_to_end_s`` = from the ``save()`` call until committed: the earlier of ``wait()``
  returning and the checkpoint directory appearing (the commit's rename; polled every 2 ms),
  so a compute window longer than the write does not inflate it. Both are per save the max
  over ranks; rows hold medians.
* **Disk reference.** ``--disk-probes`` (2) sequential writes + fsync of ``size_bytes`` from a
  RAM buffer of that size, placed among the modes of every round; the disk of this VM varies
  several-fold within seconds, so a single probe is not a reference.
* **Training interference** (``train_*`` rows): the project's launch model (``launch.model.GPT``)
  trained on random byte tokens, with no checkpointing, async saves every ``k`` steps and
  blocking saves every ``k`` steps, at world size 1 (one core spare for the background
  writer; every rank runs torch with one thread) and 2 (no spare core); again a fresh set of
  ranks per (mode, world size, round) with the modes rotated per round.

Every rank set runs under a hard timeout (the ranks and their children are killed); checkpoint
data is deleted after every rank set.

Defaults (``--sizes-mib 256 1024 --world-sizes 1 2 --repeats 3``, training 2 rounds) take about
7-11 minutes on the 2-core development box depending on what else runs there; world size 4
(``--world-sizes 1 2 4``) adds roughly half again and is left out of the default.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks._guest_memory import hold_page_reporting
from benchmarks._output import machine_info, prepare_dirs, write_outputs
from benchmarks._ranks import BenchError, run_ranks
from benchmarks._save_ranks import (
    _DISK,
    _MIB,
    _TRAIN_MODEL,
    ASYNC_MODES,
    COPY_LIMIT,
    SAVE_MODES,
    TRAIN_MODES,
    _copy_worker,
    _save_worker,
    _train_worker,
)
from benchmarks._save_report import _plot, _verdicts, render_markdown

__all__ = ["main", "SAVE_MODES", "TRAIN_MODES"]


_TARGETS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {
    "save": _save_worker,
    "train": _train_worker,
    "copy": _copy_worker,
}


_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "distckpt",
    "launch.model",
)


def _run_ranks(target: str, world_size: int, spec: dict[str, Any], *, timeout_s: float) -> list[Any]:
    """Run ``_TARGETS[target]`` on ``world_size`` fresh ranks; their values, or ``BenchError``."""
    return run_ranks(
        f"benchmarks._save_ranks:{_TARGETS[target].__name__}",
        world_size,
        spec,
        timeout_s=timeout_s,
        preload=_PRELOAD,
        label=f"{target} {spec.get('mode')}",
    )


def _disk_source(size_bytes: int):
    """A ``size_bytes`` buffer in RAM (touched, non-zero), written by the disk probe.

    The probe streams from DRAM like a checkpoint does; writing one small buffer over and
    over would read from the CPU cache and overstate what the disk path can do.
    """
    import torch

    buf = torch.empty(max(size_bytes, 1), dtype=torch.uint8)
    buf.fill_(0x5A)
    return memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs lack __buffer__


def _disk_write_seconds(directory: Path, source: memoryview, chunk_bytes: int = 16 * _MIB) -> float:
    """Seconds for one sequential write of ``source`` + fsync into a new file in ``directory``."""
    path = directory / f"disk-probe-{os.getpid()}.bin"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while offset < len(source):
                offset += os.write(fd, source[offset : offset + chunk_bytes])
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _rotated(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def _clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _log(msg: str) -> None:
    print(f"[bench_save {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _save_timeout(args: argparse.Namespace, size_bytes: int, world_size: int) -> float:
    """Per-rank-set limit: start-up allowance + 36 s per GiB per save (~10x what 2 cores need)."""
    saves = 1 + args.saves_per_process
    return min(args.timeout_s, 60.0 + world_size * 10.0 + 12.0 * saves * size_bytes / (1 << 30) * 3)


def _run_save_block(
    args,
    size_mib: float,
    world_size: int,
    modes: list[str],
    thread_counts: dict[str, int],
    data_dir: Path,
    with_disk: bool,
) -> dict[str, Any]:
    """All rounds of one (size, world size) block: ``{mode: [per-round sample]}``."""
    size_bytes = int(size_mib * _MIB)
    samples: dict[str, list[dict[str, Any] | None]] = {m: [] for m in modes}
    disk: list[float] = []  # per round: median of that round's probes
    copy: list[float | None] = []  # per round: the copy limit (max over ranks, median of copies)
    errors: dict[str, str] = {}
    items = list(modes) + ([COPY_LIMIT] if any(m in ASYNC_MODES for m in modes) else [])
    source = _disk_source(size_bytes) if with_disk else None
    if with_disk:  # probes spread through the round: the disk's speed drifts within seconds
        for k in range(args.disk_probes):
            items.insert(round((k + 0.5) * len(modes) / args.disk_probes) + k, f"{_DISK}#{k}")
    for r in range(args.repeats):
        probes = []
        for mode in _rotated(items, r):
            if mode in errors:
                continue
            root = data_dir / f"{mode.replace('#', '')}-{size_mib:g}MiB-ws{world_size}-r{r}"
            _clean(root)
            try:
                if mode.startswith(_DISK):
                    assert source is not None  # with_disk
                    probes.append(_disk_write_seconds(root, source))
                    continue
                if mode == COPY_LIMIT:
                    copy.append(
                        _copy_limit_s(
                            _run_ranks(
                                "copy",
                                world_size,
                                {"size_bytes": size_bytes},
                                timeout_s=_save_timeout(args, size_bytes, world_size),
                            )
                        )
                    )
                    _log(f"copy limit {size_mib:g} MiB ws={world_size} round {r}: {copy[-1]:.3f} s")
                    continue
                t0 = time.perf_counter()
                spec = {
                    "mode": mode.split("@")[0],
                    "size_bytes": size_bytes,
                    "root": str(root),
                    "saves_per_process": args.saves_per_process,
                    "thread_count": thread_counts[mode],
                    "step_compute_s": args.step_compute_s,
                }
                values = _run_ranks("save", world_size, spec, timeout_s=_save_timeout(args, size_bytes, world_size))
                sample = _save_sample(values)
                samples[mode].append(sample)
                _log(
                    f"{mode:22s} {size_mib:g} MiB ws={world_size} round {r}: "
                    f"stall {sample['stall_s']:.3f} s, e2e {sample['end_to_end_s']:.3f} s "
                    f"(rank set {time.perf_counter() - t0:.1f} s, "
                    f"state built in {sample['build_s']:.1f} s)"
                )
            except BenchError as e:
                _log(f"FAILED {mode} {size_mib:g} MiB ws={world_size}: {e}")
                if mode == COPY_LIMIT:  # keeps one entry per round; tried again next round
                    copy.append(None)
                    continue
                errors[mode] = str(e)
                samples[mode].append(None)
            finally:
                _clean(root)
        if probes:
            disk.append(_median(probes))
            _log(
                f"disk probe {size_mib:g} MiB round {r}: "
                + ", ".join(f"{size_bytes / t / 1e9:.2f}" for t in probes)
                + " GB/s"
            )
    return {"size_bytes": size_bytes, "samples": samples, "disk_s": disk, "copy_s": copy, "errors": errors}


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


def _run_train(args, data_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for world_size in args.train_world_sizes:
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in TRAIN_MODES}
        errors: dict[str, str] = {}
        for r in range(args.train_repeats):
            for mode in _rotated(list(TRAIN_MODES), r):
                if mode in errors:
                    continue
                root = data_dir / f"{mode}-ws{world_size}-r{r}"
                _clean(root)
                spec = {
                    "mode": mode,
                    "root": str(root),
                    "model": _TRAIN_MODEL,
                    "batch_per_rank": max(1, args.train_global_batch // world_size),
                    "warmup_steps": 3,
                    "steps": args.train_steps,
                    "every": args.train_every,
                    "async_mode": args.train_async_mode,
                    "thread_count": 1,
                }
                try:
                    t0 = time.perf_counter()
                    values = _run_ranks("train", world_size, spec, timeout_s=min(args.timeout_s, 600.0))
                    steps = values[0]["steps"]
                    elapsed = max(v["elapsed_s"] for v in values)
                    compute = max(sum(v["step_s"]) - v["stall_s"] for v in values)
                    inflight = [dt for dt in values[0]["inflight_step_s"]]
                    samples[mode].append(
                        {
                            "steps_per_s": steps / elapsed,
                            "compute_steps_per_s": steps / compute,
                            "inflight_steps_per_s": (len(inflight) / sum(inflight)) if inflight else float("nan"),
                            "inflight_steps": len(inflight),
                            "stall_s": max(v["stall_s"] for v in values),
                            "saves": values[0]["saves"],
                            "peak_rss_bytes": max(v["peak_rss_bytes"] for v in values),
                        }
                    )
                    _log(
                        f"{mode:14s} ws={world_size} round {r}: {steps / elapsed:.2f} steps/s, "
                        f"{len(inflight)} steps with a save in flight ({time.perf_counter() - t0:.1f} s)"
                    )
                except BenchError as e:
                    errors[mode] = str(e)
                    _log(f"FAILED {mode} ws={world_size}: {e}")
                finally:
                    _clean(root)
        base = samples["train_none"]
        for mode in TRAIN_MODES:
            s = samples[mode]
            row: dict[str, Any] = {
                "experiment": "train",
                "mode": mode,
                "world_size": world_size,
                "repeats": len(s),
                "save_every_steps": args.train_every,
                "async_mode": args.train_async_mode
                if mode == "train_async"
                else ("off" if mode == "train_blocking" else None),
                "model": dict(_TRAIN_MODEL),
                "global_batch": args.train_global_batch,
            }
            if not s:
                row["error"] = errors.get(mode, "no samples")
                rows.append(row)
                continue
            row.update(
                {
                    "steps_per_s": _median([x["steps_per_s"] for x in s]),
                    "stall_s": _median([x["stall_s"] for x in s]),
                    "saves": s[0]["saves"],
                    "inflight_steps": _median([x["inflight_steps"] for x in s]),
                    "inflight_steps_per_s": _median([x["inflight_steps_per_s"] for x in s]),
                    "peak_rss_bytes": max(x["peak_rss_bytes"] for x in s),
                    "steps_per_s_samples": [x["steps_per_s"] for x in s],
                }
            )
            paired = list(zip(s, base))
            row["throughput_ratio"] = _median([a["steps_per_s"] / b["steps_per_s"] for a, b in paired])
            if mode == "train_async":
                row["inflight_throughput_ratio"] = _median(
                    [a["inflight_steps_per_s"] / b["compute_steps_per_s"] for a, b in paired]
                )
            rows.append(row)
    return rows


# ============================================================================ CLI
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_save",
        description="Benchmark naive torch.save vs distckpt blocking/async saves on CPU/gloo ranks.",
        epilog="example: python -m benchmarks.bench_save --sizes-mib 64 --world-sizes 1 2 --repeats 2 "
        "--no-train --out /tmp/bench",
    )
    p.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=[256, 1024],
        help="model + AdamW state of the whole job, MiB (default: 256 1024)",
    )
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=[1, 2],
        help="ranks (default: 1 2; add 4 for an oversubscribed 2-core box, ~+50%% run time)",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every mode once (default: 3)")
    p.add_argument(
        "--saves-per-process",
        type=int,
        default=1,
        help="measured saves per rank set, after its warm-up save (default: 1)",
    )
    p.add_argument(
        "--step-compute-s",
        type=float,
        default=0.25,
        help="async modes: seconds between save() and wait_staged() standing for the next "
        "step's forward/backward (a sleep: on a GPU node the CPU waits for kernels) "
        "(default: 0.25)",
    )
    p.add_argument(
        "--disk-probes",
        type=int,
        default=2,
        help="plain sequential write + fsync probes per round, spread among the modes (default: 2)",
    )
    p.add_argument("--modes", nargs="+", default=list(SAVE_MODES), choices=SAVE_MODES, help="save modes")
    p.add_argument("--out", default="runs/bench_save", help="output directory (results.json/.md, plot.png)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="where checkpoints are written (default: OUT/data; removed after each rank set)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="upper limit per rank set (seconds)")
    p.add_argument(
        "--leave-page-reporting",
        action="store_true",
        help="do not hold a VM's free page reporting during the run (see benchmarks/_guest_memory.py)",
    )
    p.add_argument(
        "--no-thread-count",
        action="store_true",
        help="skip the blocking thread_count 1 vs 4 comparison at world size 1",
    )
    p.add_argument(
        "--thread-counts", type=int, nargs="+", default=[1, 4], help="thread_count values compared (default: 1 4)"
    )
    p.add_argument(
        "--thread-count-repeats",
        type=int,
        default=None,
        help="rounds of the thread_count comparison (default: --repeats)",
    )
    p.add_argument(
        "--no-save", action="store_true", help="skip the save matrix (run only the thread_count and/or training parts)"
    )
    p.add_argument("--no-train", action="store_true", help="skip the training-interference part")
    p.add_argument("--train-world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--train-steps", type=int, default=24, help="measured training steps per run (default: 24)")
    p.add_argument("--train-every", type=int, default=6, help="save every k steps (default: 6)")
    p.add_argument("--train-repeats", type=int, default=2, help="rounds of the training part (default: 2)")
    p.add_argument("--train-global-batch", type=int, default=8)
    p.add_argument("--train-async-mode", choices=("thread", "process"), default="thread")
    args = p.parse_args(argv)
    for name in ("repeats", "saves_per_process", "disk_probes", "train_steps", "train_every", "train_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.thread_count_repeats is not None and args.thread_count_repeats < 1:
        p.error("--thread-count-repeats must be >= 1")
    if any(w < 1 for w in args.world_sizes + args.train_world_sizes):
        p.error("world sizes must be >= 1")
    if any(s <= 0 for s in args.sizes_mib):
        p.error("--sizes-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every rank set succeeded, 1 otherwise."""
    args = _parse(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    out, data_dir = prepare_dirs(args)
    import torch

    import distckpt

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    load_start = os.getloadavg()
    finding = None
    default_tc = {m: 1 for m in SAVE_MODES}
    with hold_page_reporting(not args.leave_page_reporting) as guest:
        try:
            for size_mib in [] if args.no_save else args.sizes_mib:
                for ws in args.world_sizes:
                    block = _run_save_block(args, size_mib, ws, list(args.modes), default_tc, data_dir, with_disk=True)
                    rows += _save_rows(block, ws, default_tc)
            if not args.no_thread_count and len(args.thread_counts) > 1:
                size_mib = max(args.sizes_mib)
                tc_modes = [f"blocking@tc{n}" for n in args.thread_counts]
                tcs = {m: int(m.split("@tc")[1]) for m in tc_modes}
                tc_args = argparse.Namespace(**vars(args))
                tc_args.repeats = args.thread_count_repeats or args.repeats
                block = _run_save_block(tc_args, size_mib, 1, tc_modes, tcs, data_dir, with_disk=False)
                tc_rows = _save_rows(block, 1, tcs)
                base_mode = tc_modes[0]
                for row in tc_rows:
                    row["experiment"] = "thread_count"
                    row["mode"] = f"blocking_tc{row['thread_count']}"
                    own = block["samples"][f"blocking@tc{row['thread_count']}"]
                    base = block["samples"][base_mode]
                    row["e2e_over_tc1"] = _median(
                        [
                            a["end_to_end_s"] / b["end_to_end_s"]
                            for a, b in zip(own, base)
                            if a is not None and b is not None
                        ]
                    )
                rows += tc_rows
                ok = [r for r in tc_rows if "error" not in r]
                base = block["samples"][base_mode]
                if len(ok) == len(tc_rows) and len(ok) > 1:
                    best = min(ok, key=lambda r: r["e2e_over_tc1"])
                    parts = []
                    for r in ok[1:]:
                        own = block["samples"][f"blocking@tc{r['thread_count']}"]
                        wins = sum(
                            a is not None and b is not None and a["end_to_end_s"] < b["end_to_end_s"]
                            for a, b in zip(own, base)
                        )
                        parts.append(
                            f"thread_count={r['thread_count']} took x{r['e2e_over_tc1']:.2f} the time of "
                            f"thread_count={args.thread_counts[0]} (median of per-round ratios; faster in "
                            f"{wins}/{r['repeats']} rounds)"
                        )
                    finding = (
                        f"Blocking save, {size_mib:g} MiB, world size 1: "
                        + "; ".join(parts)
                        + f". Faster by the paired ratio: thread_count={best['thread_count']}."
                    )
            if not args.no_train:
                rows += _run_train(args, data_dir)
        finally:
            _clean(data_dir)
    results: dict[str, Any] = {
        "results": rows,
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": argv_list,
            "args": vars(args),
            "torch_version": torch.__version__,
            "distckpt_version": distckpt.__version__,
            "machine": machine_info(out),
            "data_dir": str(data_dir),
            "wall_s": time.perf_counter() - t_start,
            "thread_count_finding": finding,
            "notes": notes,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "page_reporting": guest,
        },
    }
    busy = max(load_start[0], results["meta"]["loadavg_end"][0])
    if busy > (os.cpu_count() or 1):
        notes.append(
            f"1-min load average reached {busy:.1f} on {os.cpu_count()} CPUs: other processes shared "
            "the cores during this run, so absolute times are inflated and no core was truly spare; "
            "ratios are paired within rounds to limit the damage."
        )
    results["meta"]["verdicts"] = _verdicts(rows)
    write_outputs(out, results, render_markdown, _plot)
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    # Run through the importable module so that spawned ranks pickle ``benchmarks.bench_save.*``.
    from benchmarks.bench_save import main as _main

    sys.exit(_main())
