"""Load benchmark: DCP's stock ``FileSystemReader`` vs distckpt's ``FastFileSystemReader``.

Usage (from the repository root)::

    python -m benchmarks.bench_load --size-mib 1024 --world-sizes 1 2 --out runs/bench_load
    python -m benchmarks.bench_load --size-mib 16 --world-sizes 1 2 --rounds 1 --out /tmp/bl   # smoke run

Writes ``OUT/results.json``, ``OUT/results.md`` (printed too) and ``OUT/plot.png`` (when
matplotlib is installed). Library use: ``from benchmarks.bench_load import main; main([...]) -> int``
(0 when every load succeeded and every loaded state was bitwise equal to the saved one).

What is loaded: a model of ``Linear(width, width)`` layers (weights + biases: a big item and a
small item per layer, DCP's common mix) sized to ``--size-mib`` for the whole job, plus an
``extra`` dict with a 0-dim tensor and a non-tensor value (a ``BYTE_IO`` item). Every value is
a deterministic function of its global index (``weight[r, c] = base[c] + r`` with ``base``
random integers < 2**22, exact in float32), so any rank can compute the expected values of its
own shard at any world size, and every load is checked **bitwise** (the target is zeroed before
each load, so a load that does nothing fails the check).

Checkpoints (written once, before the loads, with ``dcp.save`` and ``distckpt.dcp.FileSystemWriter``:
DCP's writer + per-file fsync + xxh3-128 of each file in a hash sidecar; ``--save-thread-count`` files per
rank, by default ``SaveConfig.thread_count`` (4), as ``CheckpointManager`` writes them;
1 is what a plain ``dcp.save`` writes):

* ``fsdp2-ws<W>``: FSDP2 (``fully_shard`` per layer + root; a plain module at W = 1) saved by W
  ranks, for every W loaded below;
* ``ddp-ws<F>``: the same model wrapped in ``DistributedDataParallel`` at ``--reshard-from``
  ranks (replicated; DCP writes each tensor once).

Cells (one line each in ``results.md``):

* ``same``: saved at W, loaded at W (FSDP2), for W in ``--world-sizes`` and every reshard target;
* ``reshard``: saved at ``--reshard-from`` (FSDP2), loaded at each of ``--reshard-to`` (FSDP2);
* ``ddp_to_fsdp2``: saved by DDP at ``--reshard-from``, loaded by FSDP2 at the same world size;
* ``replicated``: a DDP-style state of each of ``--replicated-sizes-mib`` loaded by every rank at
  each of ``--replicated-world-sizes``, ``load.read_once`` on and off (``benchmarks/_replicated.py``;
  ``--only-replicated`` runs this cell alone).

Readers (rotated within each round so drift hits them alike; cells with the same load world
size run back to back per reader, so paired samples are close in time), each through a plain
``dcp.load`` (``DefaultLoadPlanner``): ``stock`` (torch's ``FileSystemReader``), and
``distckpt.dcp.FileSystemReader`` as ``safe_verify`` (``fast=False``: each file checked against
the hash sidecar, then the stock read; distckpt's path with ``load.fast_reader: false``), ``fast``
(``verify=False``: the fast reader, no hashes) and ``fast_verify`` (the defaults: the fast
reader with the sidecar's hashes and block digests, verified from the bytes read; a rank that
needs part of a file reads only its verified blocks). The manager's own load loop (cyclic GC
paused, per-rank plans) is measured through ``CheckpointManager.load`` by the replicated cell.

How one sample is measured: a fresh set of spawned gloo ranks (forkserver with torch preloaded;
hard timeout) builds the target (meta device -> FSDP2 -> ``to_empty`` -> zero-filled, i.e. the
memory is touched as after model init), then does a **cold** load and a **warm** load:

* cold: rank 0 evicts the checkpoint's files from the page cache, then all ranks pass a
  barrier. Eviction uses ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file (the files are
  fsynced, so their pages are clean and are dropped, and nothing else on a shared machine is
  touched), checks with ``mincore`` that at most 2% of the pages are still resident, and only
  otherwise writes ``1`` to ``/proc/sys/vm/drop_caches`` (root). The method used and the
  resident fraction afterwards are recorded (``cold_method``, ``cold_resident_frac``). The
  virtual disk's host may still cache: "cold" means not in this machine's page cache. On a VM
  that reports free pages to its host, the run holds that reporting (``--leave-page-reporting``
  to not), else a cold read lands in memory the host must fault in again, at ~0.5 GB/s here,
  whatever the reader: ``benchmarks/_guest_memory.py`` has the measurement; ``page_reporting``
  in the results records what was done;
* warm: the target is zeroed and the same load runs again with the files in the page cache;
* ``load_s``: from a barrier before ``dcp.load`` to a barrier after it (the slowest rank),
  including planning (DCP's plan gather and scatter and final gather); ``read_data_s``: the
  reader's ``read_data`` alone (slowest rank).

The physical reference, per checkpoint and round: ``disk_read_gbps`` is one plain sequential
read of all of the checkpoint's files (16 MiB ``readv``, cold, one thread) -- the "raw
sequential read"; ``disk_read_par_gbps`` reads the files in parallel, one thread per file.

Ratios are taken within a round, then the median over rounds: ``speedup_vs_stock`` (stock
``load_s`` / this ``load_s``), ``read_over_disk`` (cold ``read_gbps`` / that round's
``disk_read_gbps``), ``reshard_ratio`` (this cell's ``load_s`` / the ``same`` cell's ``load_s``
at the same load world size, same reader and cache state).

Read amplification (``fast`` and ``fast_verify``; cold load of the first round, summed over
ranks): ``bytes_read`` (the reader's ``read_bytes`` counter: every byte read from the files),
``bytes_needed`` (its ``needed_bytes``: the bytes of the items the ranks' plans read -- the
narrowed shard of each tensor, whole bytes items) and ``read_amplification`` = read / needed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks._guest_memory import hold_page_reporting
from benchmarks._load_ranks import _data_files, _evict, _load_worker, _save_worker
from benchmarks._load_report import _cell_key, _median, _plot, _rows, _verdicts, render_markdown
from benchmarks._output import machine_info, prepare_dirs, write_outputs
from benchmarks._ranks import BenchError, run_ranks
from benchmarks._replicated import plot_replicated as _plot_replicated
from benchmarks._replicated import render_replicated, run_replicated
from distckpt import SaveConfig

__all__ = ["main", "READERS", "render_markdown"]

READERS = ("stock", "safe_verify", "fast", "fast_verify")
_MIB = 1 << 20
_DISK = "disk"


_TARGETS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {"save": _save_worker, "load": _load_worker}
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "distckpt",
    "distckpt.dcp",
)


def _run_ranks(target: str, world_size: int, spec: dict[str, Any], *, timeout_s: float) -> list[Any]:
    """Run ``_TARGETS[target]`` on ``world_size`` fresh ranks; their values, or ``BenchError``."""
    return run_ranks(
        f"benchmarks._load_ranks:{_TARGETS[target].__name__}",
        world_size,
        spec,
        timeout_s=timeout_s,
        preload=_PRELOAD,
        label=f"{target} {spec.get('reader', spec.get('wrapper'))}",
    )


def _raw_read_seconds(paths: list[str], parallel: bool) -> float:
    """Cold plain read of ``paths``: one sequential reader, or one thread per file."""
    _evict(paths)

    def read(p: str) -> None:
        buf = bytearray(16 * _MIB)
        view = memoryview(buf)
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.readv(fd, [view]):
                pass
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    if parallel and len(paths) > 1:
        threads = [threading.Thread(target=read, args=(p,)) for p in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for p in paths:
            read(p)
    return time.perf_counter() - t0


def _rotated(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def _log(msg: str) -> None:
    print(f"[bench_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timeout(args: argparse.Namespace, world_size: int) -> float:
    return min(args.timeout_s, 90.0 + 15.0 * world_size + 40.0 * args.size_mib / 1024 * max(world_size, 2))


def _save_all(args, data_dir: Path, ckpts: dict[str, tuple[str, int]]) -> dict[str, dict[str, Any]]:
    """Write every checkpoint once: ``{name: {dir, files, data_bytes, save_s, ...}}``."""
    out = {}
    for name, (wrapper, ws) in ckpts.items():
        d = data_dir / name
        shutil.rmtree(d, ignore_errors=True)
        spec = {
            "wrapper": wrapper,
            "dir": str(d),
            "size_bytes": int(args.size_mib * _MIB),
            "save_thread_count": args.save_thread_count,
        }
        values = _run_ranks("save", ws, spec, timeout_s=_timeout(args, ws))
        files = _data_files(str(d))
        data_bytes = sum(os.path.getsize(p) for p in files)
        out[name] = {
            "dir": str(d),
            "files": files,
            "data_bytes": data_bytes,
            "save_s": max(v["save_s"] for v in values),
            "state_bytes": values[0]["state_bytes"],
            "wrapper": wrapper,
            "world_size": ws,
        }
        _log(f"saved {name}: {len(files)} files, {data_bytes / _MIB:.1f} MiB in {out[name]['save_s']:.2f} s")
    return out


def _cells(args) -> list[dict[str, Any]]:
    cells = []
    same = list(
        dict.fromkeys(list(args.world_sizes) + ([] if args.no_reshard else [args.reshard_from, *args.reshard_to]))
    )
    for ws in same:
        cells.append({"scenario": "same", "ckpt": f"fsdp2-ws{ws}", "saved_world_size": ws, "world_size": ws})
    if not args.no_reshard:
        for ws in args.reshard_to:
            if ws != args.reshard_from:
                cells.append(
                    {
                        "scenario": "reshard",
                        "ckpt": f"fsdp2-ws{args.reshard_from}",
                        "saved_world_size": args.reshard_from,
                        "world_size": ws,
                    }
                )
    if not args.no_ddp:
        cells.append(
            {
                "scenario": "ddp_to_fsdp2",
                "ckpt": f"ddp-ws{args.reshard_from}",
                "saved_world_size": args.reshard_from,
                "world_size": args.reshard_from,
            }
        )
    return cells


def _run_loads(args, saved: dict[str, dict[str, Any]], cells: list[dict[str, Any]]):
    """``samples[cell][reader] = [per-round sample or None]``; ``disk[ckpt] = [(seq_s, par_s)]``.

    Cells are grouped by load world size; within a group, each reader (rotated per round) runs
    every cell of the group back to back (order alternating per round), so the samples that
    ratios pair -- reshard vs same-world, reader vs stock -- are taken close together in time.
    """
    samples: dict[str, dict[str, list[dict[str, Any] | None]]] = {
        _cell_key(c): {r: [] for r in args.readers} for c in cells
    }
    disk: dict[str, list[tuple[float, float]]] = {name: [] for name in saved}
    errors: dict[str, str] = {}
    groups: dict[int, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(c["world_size"], []).append(c)
    for r in range(args.rounds):
        probed: set[str] = set()
        for ws, group in groups.items():
            for item in _rotated(list(args.readers) + [_DISK], r):
                if item == _DISK:
                    for ckpt in dict.fromkeys(c["ckpt"] for c in group):
                        if ckpt in probed:
                            continue
                        ck = saved[ckpt]
                        seq = _raw_read_seconds(ck["files"], parallel=False)
                        par = _raw_read_seconds(ck["files"], parallel=True)
                        disk[ckpt].append((seq, par))
                        probed.add(ckpt)
                        _log(
                            f"disk {ckpt} round {r}: sequential {ck['data_bytes'] / seq / 1e9:.2f} GB/s, "
                            f"parallel {ck['data_bytes'] / par / 1e9:.2f} GB/s"
                        )
                    continue
                for cell in group if r % 2 == 0 else group[::-1]:
                    key = _cell_key(cell)
                    ck = saved[cell["ckpt"]]
                    spec = {
                        "dir": ck["dir"],
                        "reader": item,
                        "size_bytes": int(args.size_mib * _MIB),
                        "thread_count": args.thread_count,
                    }
                    try:
                        values = _run_ranks("load", ws, spec, timeout_s=_timeout(args, ws))
                        sample = _load_sample(values)
                        samples[key][item].append(sample)
                        bad = sample["bad"]
                        _log(
                            f"{key:22s} {item:12s} round {r}: cold {sample['cold_s']:.3f} s "
                            f"(read_data {sample['cold_read_data_s']:.3f}), warm {sample['warm_s']:.3f} s "
                            f"(read_data {sample['warm_read_data_s']:.3f})" + (f"  MISMATCH {bad[:3]}" if bad else "")
                        )
                    except BenchError as e:
                        errors[f"{key}/{item}"] = str(e)
                        samples[key][item].append(None)
                        _log(f"FAILED {key} {item}: {e}")
        # A checkpoint no group used this round (cannot happen with _cells) is not probed.
    return samples, disk, errors


def _load_sample(values: list[dict[str, Any]]) -> dict[str, Any]:
    loads = {c: [v["loads"][i] for v in values] for i, c in enumerate(("cold", "warm"))}
    stats: dict[str, int] = {}
    for v in values:
        for k, x in v["loads"][0]["stats"].items():
            stats[k] = stats.get(k, 0) + x
    cold0 = loads["cold"][0]
    return {
        "cold_s": max(x["load_s"] for x in loads["cold"]),
        "warm_s": max(x["load_s"] for x in loads["warm"]),
        "cold_read_data_s": max(x["read_data_s"] or 0.0 for x in loads["cold"]),
        "warm_read_data_s": max(x["read_data_s"] or 0.0 for x in loads["warm"]),
        "bad": sorted({b for c in loads.values() for x in c for b in x["bad"]}),
        "cold_method": cold0["cold_method"],
        "cold_resident_frac": cold0["cold_resident_frac"],
        "peak_rss_bytes": max(v["peak_rss_bytes"] for v in values),
        "rss_extra_bytes": max(v["peak_rss_bytes"] - v["rss_before_load_bytes"] for v in values),
        "rss_extra_copies": max(
            (v["peak_rss_bytes"] - v["rss_before_load_bytes"]) / max(v["local_state_bytes"], 1) for v in values
        ),
        "local_state_bytes": max(v["local_state_bytes"] for v in values),
        "global_state_bytes": values[0]["global_state_bytes"],
        "stats": stats,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_load",
        description="Benchmark DCP's stock FileSystemReader vs distckpt's FastFileSystemReader (CPU/gloo ranks).",
        epilog="example: python -m benchmarks.bench_load --size-mib 1024 --world-sizes 1 2 --out runs/bench_load",
    )
    p.add_argument("--size-mib", type=float, default=1024, help="state of the whole job, MiB (default: 1024)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], help="same-world cells (default: 1 2)")
    p.add_argument("--reshard-from", type=int, default=2, help="world size of the resharded checkpoints (default: 2)")
    p.add_argument(
        "--reshard-to",
        type=int,
        nargs="+",
        default=[1, 3, 4],
        help="load world sizes of the reshard cells (default: 1 3 4)",
    )
    p.add_argument("--no-reshard", action="store_true", help="skip the reshard cells")
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP -> FSDP2 cell")
    p.add_argument(
        "--replicated-sizes-mib", type=float, nargs="*", default=[256, 1024], help="replicated cell sizes (none: skip)"
    )
    p.add_argument("--replicated-world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--only-replicated", action="store_true", help="run the replicated cell only")
    p.add_argument("--readers", nargs="+", default=list(READERS), choices=READERS)
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every reader once per cell (default: 3)")
    p.add_argument(
        "--thread-count",
        type=int,
        default=None,
        help="FastFileSystemReader thread_count per rank (default: as the manager, 2 streams per node "
        "divided among the ranks, at least 1)",
    )
    p.add_argument(
        "--save-thread-count",
        type=int,
        default=SaveConfig.thread_count,
        help="writer threads (files) per rank of the checkpoints loaded (default: "
        f"{SaveConfig.thread_count}, CheckpointManager's; 1 = plain dcp.save's)",
    )
    p.add_argument("--out", default="runs/bench_load", help="output directory")
    p.add_argument("--data-dir", default=None, help="checkpoints (default: OUT/data; removed at the end)")
    p.add_argument("--keep-data", action="store_true", help="keep the checkpoints")
    p.add_argument("--timeout-s", type=float, default=600.0, help="upper limit per rank set (seconds)")
    p.add_argument(
        "--leave-page-reporting",
        action="store_true",
        help="do not hold a VM's free page reporting during the run (see benchmarks/_guest_memory.py)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if any(w < 1 for w in [*args.world_sizes, args.reshard_from, *args.reshard_to]):
        p.error("world sizes must be >= 1")
    if args.size_mib <= 0:
        p.error("--size-mib must be positive")
    if args.save_thread_count < 1:
        p.error("--save-thread-count must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every load succeeded and matched the saved state bitwise."""
    args = _parse(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    out, data_dir = prepare_dirs(args)
    import torch

    load_start = os.getloadavg()
    cells = [] if args.only_replicated else _cells(args)
    ckpts: dict[str, tuple[str, int]] = {}
    for c in cells:
        wrapper = "ddp" if c["ckpt"].startswith("ddp") else "fsdp2"
        ckpts[c["ckpt"]] = (wrapper, c["saved_world_size"])
    rows: list[dict[str, Any]] = []
    replicated: list[dict[str, Any]] = []
    notes: list[str] = []
    rc = 0
    guest: dict[str, Any] = {}
    try:
        with hold_page_reporting(not args.leave_page_reporting) as guest:
            _log(f"guest free page reporting: {guest['state']}")
            saved = _save_all(args, data_dir, ckpts) if cells else {}
            samples, disk, errors = _run_loads(args, saved, cells) if cells else ({}, {}, {})
            replicated = run_replicated(args, data_dir, _log)
        rows = (_rows(args, saved, cells, samples, disk, errors) if cells else []) + replicated
        if errors:
            rc = 1
            notes += [f"{k}: {v.splitlines()[0][:300]}" for k, v in errors.items()]
    except BenchError as e:
        rc = 1
        notes.append(f"aborted: {str(e)[:2000]}")
        _log(f"aborted: {e}")
    finally:
        if not args.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
    if any(r.get("bitwise_equal") is False or "error" in r for r in rows):
        rc = 1
    cold = [r for r in rows if r.get("cache") == "cold" and "cold_method" in r]
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": argv_list,
        "size_mib": args.size_mib,
        "rounds": args.rounds,
        "readers": list(args.readers),
        "thread_count": args.thread_count,
        "save_thread_count": args.save_thread_count,
        "machine": machine_info(data_dir.parent),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "data_dir": str(data_dir),
        "loadavg_start": tuple(round(x, 2) for x in load_start),
        "loadavg_end": tuple(round(x, 2) for x in os.getloadavg()),
        "cold_method": cold[0]["cold_method"] if cold else None,
        "cold_resident_frac": _median([r.get("cold_resident_frac") for r in cold]) if cold else None,
        "page_reporting": guest,
        "wall_s": time.perf_counter() - t_start,
        "notes": notes,
    }
    plain = [r for r in rows if r.get("scenario") != "replicated"]
    meta["verdicts"] = _verdicts(plain, args) if plain else {}
    results = {"meta": meta, "results": rows}
    write_outputs(
        out,
        results,
        lambda res: (render_markdown(dict(res, results=plain)) if plain else "") + render_replicated(rows),
        lambda res, path: _plot(dict(res, results=plain), path) if plain else _plot_replicated(rows, path),
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
