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
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks._guest_memory import hold_page_reporting
from benchmarks._output import machine_info, prepare_dirs, write_outputs
from benchmarks._ranks import BenchError, run_ranks
from benchmarks._save_args import parse_args as _parse
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
from benchmarks._save_report import _copy_limit_s, _median, _plot, _save_rows, _save_sample, _verdicts, render_markdown

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
