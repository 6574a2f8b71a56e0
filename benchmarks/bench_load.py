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

Checkpoints (written once, before the loads, with distckpt's ``dcp_save``: DCP's
``FileSystemWriter`` + per-file fsync + xxh3-128 of each file):

* ``fsdp2-ws<W>``: FSDP2 (``fully_shard`` per layer + root; a plain module at W = 1) saved by W
  ranks, for every W loaded below;
* ``ddp-ws<F>``: the same model wrapped in ``DistributedDataParallel`` at ``--reshard-from``
  ranks (replicated; DCP writes each tensor once).

Cells (one line each in ``results.md``):

* ``same``: saved at W, loaded at W (FSDP2), for W in ``--world-sizes`` and every reshard target;
* ``reshard``: saved at ``--reshard-from`` (FSDP2), loaded at each of ``--reshard-to`` (FSDP2);
* ``ddp_to_fsdp2``: saved by DDP at ``--reshard-from``, loaded by FSDP2 at the same world size.

Readers (rotated within each round so drift hits them alike; cells with the same load world
size run back to back per reader, so paired samples are close in time): ``stock`` (torch's
``FileSystemReader``, plain ``dcp.load``), ``stock_gc_paused`` (the same under distckpt's
``gc_paused``, which every reader below also runs under, as ``dcp_load`` does: it separates the
gain of pausing the cyclic GC from the reader's own), ``safe_verify`` (distckpt's current ``SafeFileSystemReader`` with the
manifest hashes: a ``check_file`` pass, then the stock read), ``fast`` (``FastFileSystemReader``,
no hashes), ``fast_verify`` (``FastFileSystemReader`` with hashes, verified from the bytes read).
All use ``SafeLoadPlanner``.

How one sample is measured: a fresh set of spawned gloo ranks (forkserver with torch preloaded;
hard timeout) builds the target (meta device -> FSDP2 -> ``to_empty`` -> zero-filled, i.e. the
memory is touched as after model init), then does a **cold** load and a **warm** load:

* cold: rank 0 evicts the checkpoint's files from the page cache, then all ranks pass a
  barrier. Eviction uses ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file (the files are
  fsynced, so their pages are clean and are dropped, and nothing else on a shared machine is
  touched), checks with ``mincore`` that at most 2% of the pages are still resident, and only
  otherwise writes ``1`` to ``/proc/sys/vm/drop_caches`` (root). The method used and the
  resident fraction afterwards are recorded (``cold_method``, ``cold_resident_frac``). The
  virtual disk's host may still cache: "cold" means not in this machine's page cache;
* warm: the target is zeroed and the same load runs again with the files in the page cache;
* ``load_s``: from a barrier before ``dcp.load`` to a barrier after it (the slowest rank),
  including DCP's planning collectives, which are the same for every reader; ``read_data_s``:
  the reader's ``read_data`` alone (slowest rank).

The physical reference, per checkpoint and round: ``disk_read_gbps`` is one plain sequential
read of all of the checkpoint's files (16 MiB ``readv``, cold, one thread) -- the "raw
sequential read"; ``disk_read_par_gbps`` reads the files in parallel, one thread per file.

Ratios are taken within a round, then the median over rounds: ``speedup_vs_stock`` (stock
``load_s`` / this ``load_s``), ``read_over_disk`` (cold ``read_gbps`` / that round's
``disk_read_gbps``), ``reshard_ratio`` (this cell's ``load_s`` / the ``same`` cell's ``load_s``
at the same load world size, same reader and cache state).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

from benchmarks._ranks import BenchError, run_ranks

__all__ = ["main", "READERS", "render_markdown"]

READERS = ("stock", "stock_gc_paused", "safe_verify", "fast", "fast_verify")
_MIB = 1 << 20
_DISK = "disk"
_EXTRA = {"note": "bench_load", "epoch": 3}


# ============================================================================ state (rank side)
def _layer_count(size_bytes: int) -> tuple[int, int]:
    """``(width, layers)``: square ``Linear(width, width)`` layers (weight + bias) ~= size."""
    width = 1024 if size_bytes >= 64 * _MIB else 256
    per_layer = (width * width + width) * 4
    return width, max(1, round(size_bytes / per_layer))


def _model(width: int, layers: int):
    from torch import nn

    class BenchModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    return BenchModel()


def _expected(name: str, global_shape: tuple[int, ...], r0: int, r1: int):
    """Expected rows ``[r0, r1)`` of parameter ``name`` (a deterministic pattern, exact in fp32)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if len(global_shape) == 2:
        base = torch.randint(0, 1 << 22, (global_shape[1],), generator=g, dtype=torch.int64).to(torch.float32)
        return base[None, :] + torch.arange(r0, r1, dtype=torch.float32)[:, None]
    base = torch.randint(0, 1 << 22, (global_shape[0],), generator=g, dtype=torch.int64).to(torch.float32)
    return base[r0:r1] + 0.5


def _local_rows(p) -> tuple[Any, int, int]:
    """``(local tensor, first global row, last global row + 1)`` of a parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        r0 = offset[0] if len(offset) else 0
        return local, r0, r0 + (shape[0] if len(shape) else 1)
    return p.data, 0, p.shape[0]


def _fill(model) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            local, r0, r1 = _local_rows(p)
            if local.numel():
                local.copy_(_expected(name, tuple(p.shape), r0, r1))


def _zero(model, extra: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            _local_rows(p)[0].zero_()
    extra["step"].zero_()
    extra["note"], extra["epoch"] = "", -1


def _check(model, extra: dict[str, Any]) -> list[str]:
    """Names whose loaded values differ (bitwise) from the saved ones."""
    import torch

    bad = []
    for name, p in model.named_parameters():
        local, r0, r1 = _local_rows(p)
        if local.numel() and not torch.equal(local, _expected(name, tuple(p.shape), r0, r1)):
            bad.append(name)
    if int(extra["step"]) != 7:
        bad.append("extra.step")
    if extra["note"] != _EXTRA["note"] or extra["epoch"] != _EXTRA["epoch"]:
        bad.append("extra (bytes items)")
    return bad


def _build(spec: dict[str, Any], world_size: int, wrapper: str):
    """Model for ``wrapper`` in ``plain`` / ``fsdp2`` / ``ddp``; values zero (touched)."""
    import torch

    width, layers = _layer_count(spec["size_bytes"])
    if wrapper == "fsdp2" and world_size > 1:
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = _model(width, layers)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
    else:
        with torch.device("meta"):
            model = _model(width, layers)
        model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            _local_rows(p)[0].zero_()
    return model


def _state(model, wrapped=None) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    if wrapped is not None:  # DDP: the state dict API strips the "module." prefix
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(wrapped)
    else:
        sd = model.state_dict()
    extra = {"step": torch.tensor(0, dtype=torch.int64), "note": "", "epoch": -1}
    return {"model": sd, "extra": extra}, extra


def _local_bytes(model) -> tuple[int, int]:
    local = glob = 0
    for p in model.parameters():
        local += _local_rows(p)[0].numel() * p.element_size()
        glob += p.numel() * p.element_size()
    return local, glob


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _save_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from distckpt.engine.blocking import dcp_save

    wrapper = spec["wrapper"]
    model = _build(spec, world_size, "fsdp2" if wrapper == "fsdp2" else "plain")
    _fill(model)
    wrapped = None
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    state, extra = _state(model, wrapped)
    extra["step"].fill_(7)
    extra.update(_EXTRA)
    dist.barrier()
    t0 = time.perf_counter()
    written = dcp_save(state, spec["dir"], process_group=None)
    dist.barrier()
    return {"written": written, "save_s": time.perf_counter() - t0, "state_bytes": _local_bytes(model)[1]}


def _make_reader(name: str, directory: str, expected: dict[str, tuple[int, str]], thread_count: int):
    from torch.distributed.checkpoint import FileSystemReader

    from distckpt.engine.fast_reader import FastFileSystemReader
    from distckpt.engine.safe_io import SafeFileSystemReader

    if name in ("stock", "stock_gc_paused"):
        return FileSystemReader(directory)
    if name == "safe_verify":
        return SafeFileSystemReader(directory, expected_files=expected)
    if name == "fast":
        return FastFileSystemReader(directory, thread_count=thread_count)
    if name == "fast_verify":
        return FastFileSystemReader(directory, expected_files=expected, thread_count=thread_count)
    raise ValueError(f"unknown reader {name!r}")


def _data_files(directory: str) -> list[str]:
    return sorted(str(p) for p in Path(directory).iterdir() if p.is_file() and p.suffix == ".distcp")


def _evict(paths: list[str]) -> str:
    """Drop ``paths`` from the page cache; returns the method that did it.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file first (the files were fsynced, so their
    pages are clean and go; it touches nothing else on a shared machine); only if pages are
    left resident (``mincore``), ``echo 1 > /proc/sys/vm/drop_caches`` (root only).
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = _resident_fraction(paths)
    if left is not None and left <= 0.02:
        return "fadvise_dontneed"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise_dontneed (pages left resident)" if left is not None else "fadvise_dontneed (unchecked)"


def _resident_fraction(paths: list[str]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``), or ``None``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        total = resident = 0
        for p in paths:
            size = os.path.getsize(p)
            if size == 0:
                continue
            with open(p, "rb") as f:
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            try:
                buf = ctypes.c_char.from_buffer(mm)
                npages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * npages)()
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
                    return None
                resident += sum(1 for v in vec if v & 1)
                total += npages
                del buf
            finally:
                mm.close()
        return resident / total if total else 0.0
    except Exception:  # noqa: BLE001 - informative only
        return None


def _warm(paths: list[str]) -> None:
    buf = bytearray(16 * _MIB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _load_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from distckpt.engine.blocking import gc_paused
    from distckpt.engine.safe_io import SafeLoadPlanner

    baseline = _rss_bytes()
    model = _build(spec, world_size, "fsdp2")
    state, extra = _state(model)
    local_bytes, global_bytes = _local_bytes(model)
    rss_before = _rss_bytes()
    files = _data_files(spec["dir"])
    loads = []
    for cache in ("cold", "warm"):
        _zero(model, extra)
        dist.barrier()
        method, resident = None, None
        if rank == 0:
            if cache == "cold":
                method = _evict(files)
                resident = _resident_fraction(files)
            else:
                _warm(files)
        dist.barrier()
        t0 = time.perf_counter()
        reader = _make_reader(spec["reader"], spec["dir"], spec["expected"], spec["thread_count"])
        read_data, timing = reader.read_data, {}

        def timed_read_data(plan, planner, read_data=read_data, timing=timing):
            t = time.perf_counter()
            try:
                return read_data(plan, planner)
            finally:
                timing["s"] = time.perf_counter() - t

        reader.read_data = timed_read_data
        # Every reader but "stock" runs as distckpt's dcp_load does: automatic GC paused.
        with contextlib.nullcontext() if spec["reader"] == "stock" else gc_paused():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=None)
        dist.barrier()
        load_s = time.perf_counter() - t0
        bad = _check(model, extra)
        loads.append({"cache": cache, "load_s": load_s, "read_data_s": timing.get("s"), "bad": bad,
                      "cold_method": method,
                      "cold_resident_frac": resident, "stats": dict(getattr(reader, "last_stats", {}) or {})})
    return {"loads": loads, "peak_rss_bytes": _peak_rss_bytes(), "baseline_rss_bytes": baseline,
            "rss_before_load_bytes": rss_before, "local_state_bytes": local_bytes,
            "global_state_bytes": global_bytes}


_TARGETS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {"save": _save_worker, "load": _load_worker}


_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "distckpt",
            "distckpt.engine.fast_reader")


def _run_ranks(target: str, world_size: int, spec: dict[str, Any], *, timeout_s: float) -> list[Any]:
    """Run ``_TARGETS[target]`` on ``world_size`` fresh ranks; their values, or ``BenchError``."""
    return run_ranks(f"benchmarks.bench_load:{_TARGETS[target].__name__}", world_size, spec, timeout_s=timeout_s,
                     preload=_PRELOAD, label=f"{target} {spec.get('reader', spec.get('wrapper'))}")


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


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def _rotated(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def _log(msg: str) -> None:
    print(f"[bench_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timeout(args: argparse.Namespace, world_size: int) -> float:
    return min(args.timeout_s, 90.0 + 15.0 * world_size + 40.0 * args.size_mib / 1024 * max(world_size, 2))


def _save_all(args, data_dir: Path, ckpts: dict[str, tuple[str, int]]) -> dict[str, dict[str, Any]]:
    """Write every checkpoint once: ``{name: {dir, expected, files, data_bytes, save_s}}``."""
    out = {}
    for name, (wrapper, ws) in ckpts.items():
        d = data_dir / name
        shutil.rmtree(d, ignore_errors=True)
        spec = {"wrapper": wrapper, "dir": str(d), "size_bytes": int(args.size_mib * _MIB)}
        values = _run_ranks("save", ws, spec, timeout_s=_timeout(args, ws))
        expected: dict[str, tuple[int, str]] = {}
        for v in values:
            expected.update({k: tuple(x) for k, x in v["written"].items()})
        files = _data_files(str(d))
        data_bytes = sum(os.path.getsize(p) for p in files)
        out[name] = {"dir": str(d), "expected": expected, "files": files, "data_bytes": data_bytes,
                     "save_s": max(v["save_s"] for v in values), "state_bytes": values[0]["state_bytes"],
                     "wrapper": wrapper, "world_size": ws}
        _log(f"saved {name}: {len(files)} files, {data_bytes / _MIB:.1f} MiB in {out[name]['save_s']:.2f} s")
    return out


def _cells(args) -> list[dict[str, Any]]:
    cells = []
    same = list(dict.fromkeys(list(args.world_sizes) + ([] if args.no_reshard else
                                                         [args.reshard_from, *args.reshard_to])))
    for ws in same:
        cells.append({"scenario": "same", "ckpt": f"fsdp2-ws{ws}", "saved_world_size": ws, "world_size": ws})
    if not args.no_reshard:
        for ws in args.reshard_to:
            if ws != args.reshard_from:
                cells.append({"scenario": "reshard", "ckpt": f"fsdp2-ws{args.reshard_from}",
                              "saved_world_size": args.reshard_from, "world_size": ws})
    if not args.no_ddp:
        cells.append({"scenario": "ddp_to_fsdp2", "ckpt": f"ddp-ws{args.reshard_from}",
                      "saved_world_size": args.reshard_from, "world_size": args.reshard_from})
    return cells


def _cell_key(c: dict[str, Any]) -> str:
    return f"{c['scenario']}:{c['saved_world_size']}->{c['world_size']}"


def _run_loads(args, saved: dict[str, dict[str, Any]], cells: list[dict[str, Any]]):
    """``samples[cell][reader] = [per-round sample or None]``; ``disk[ckpt] = [(seq_s, par_s)]``.

    Cells are grouped by load world size; within a group, each reader (rotated per round) runs
    every cell of the group back to back (order alternating per round), so the samples that
    ratios pair -- reshard vs same-world, reader vs stock -- are taken close together in time.
    """
    samples: dict[str, dict[str, list[dict[str, Any] | None]]] = {
        _cell_key(c): {r: [] for r in args.readers} for c in cells}
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
                        _log(f"disk {ckpt} round {r}: sequential {ck['data_bytes'] / seq / 1e9:.2f} GB/s, "
                             f"parallel {ck['data_bytes'] / par / 1e9:.2f} GB/s")
                    continue
                for cell in (group if r % 2 == 0 else group[::-1]):
                    key = _cell_key(cell)
                    ck = saved[cell["ckpt"]]
                    spec = {"dir": ck["dir"], "expected": ck["expected"], "reader": item,
                            "size_bytes": int(args.size_mib * _MIB), "thread_count": args.thread_count}
                    try:
                        values = _run_ranks("load", ws, spec, timeout_s=_timeout(args, ws))
                        sample = _load_sample(values)
                        samples[key][item].append(sample)
                        bad = sample["bad"]
                        _log(f"{key:22s} {item:12s} round {r}: cold {sample['cold_s']:.3f} s "
                             f"(read_data {sample['cold_read_data_s']:.3f}), warm {sample['warm_s']:.3f} s "
                             f"(read_data {sample['warm_read_data_s']:.3f})" + (f"  MISMATCH {bad[:3]}" if bad else ""))
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
        "cold_method": cold0["cold_method"], "cold_resident_frac": cold0["cold_resident_frac"],
        "peak_rss_bytes": max(v["peak_rss_bytes"] for v in values),
        "rss_extra_bytes": max(v["peak_rss_bytes"] - v["rss_before_load_bytes"] for v in values),
        "rss_extra_copies": max((v["peak_rss_bytes"] - v["rss_before_load_bytes"]) / max(v["local_state_bytes"], 1)
                                for v in values),
        "local_state_bytes": max(v["local_state_bytes"] for v in values),
        "global_state_bytes": values[0]["global_state_bytes"],
        "stats": stats,
    }


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
                row: dict[str, Any] = {"scenario": cell["scenario"], "cell": key, "reader": reader, "cache": cache,
                                       "saved_world_size": cell["saved_world_size"], "world_size": cell["world_size"],
                                       "size_mib": args.size_mib, "rounds": len(ok),
                                       "disk_read_gbps": _median(disk_seq), "disk_read_par_gbps": _median(disk_par),
                                       "checkpoint_bytes": ck["data_bytes"]}
                if not ok:
                    row["error"] = next((v for k, v in errors.items() if k == f"{key}/{reader}"), "no samples")
                    rows.append(row)
                    continue
                fld = f"{cache}_s"
                load_s = _median([s[fld] for s in ok])
                state_bytes = ok[0]["global_state_bytes"]
                row.update({
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
                })
                rfld = f"{cache}_read_data_s"
                row["read_data_gbps"] = state_bytes / row["read_data_s"] / 1e9
                if cache == "cold":
                    row["cold_method"] = ok[0]["cold_method"]
                    row["cold_resident_frac"] = _median([s["cold_resident_frac"] for s in ok])
                    for name, f in (("read_over_disk", fld), ("read_data_over_disk", rfld)):
                        row[name] = _median([(state_bytes / s[f] / 1e9) / disk_seq[i]
                                             for i, s in enumerate(per_round) if s is not None and i < len(disk_seq)])
                if ok[0]["stats"]:
                    row["reader_stats"] = ok[0]["stats"]
                if not row["bitwise_equal"]:
                    row["error"] = "loaded state differs from the saved one: " + ", ".join(
                        sorted({b for s in ok for b in s["bad"]})[:5])

                def paired(other: list, f: str, mine_over_other: bool) -> float:
                    vals = [(s[f] / other[i][f]) if mine_over_other else (other[i][f] / s[f])
                            for i, s in enumerate(per_round)
                            if s is not None and i < len(other) and other[i] is not None]
                    return _median(vals)

                if "stock" in samples[key] and reader != "stock":
                    row["speedup_vs_stock"] = paired(samples[key]["stock"], fld, False)
                    row["speedup_vs_stock_read_data"] = paired(samples[key]["stock"], rfld, False)
                if "stock_gc_paused" in samples[key] and not reader.startswith("stock"):
                    row["speedup_vs_stock_gc_paused"] = paired(samples[key]["stock_gc_paused"], fld, False)
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
        out.append(f"cold load >= 2x stock throughput at {args.size_mib:g} MiB ws={ws}: "
                   f"{'MET' if sp >= 2 else 'MISSED'} (x{sp:.2f}, fast {fast['read_gbps']:.2f} GB/s; "
                   f"read_data alone x{spr:.2f}, {fast['read_data_gbps']:.2f} GB/s; "
                   f"x{fast.get('speedup_vs_stock_gc_paused', nan):.2f} of stock with GC paused)")
        rod, rodr = fast.get("read_over_disk", nan), fast.get("read_data_over_disk", nan)
        out.append(f"cold load >= 70% of raw sequential read at ws={ws}: "
                   f"{'MET' if rod >= 0.7 else 'MISSED'} ({rod:.0%} of {fast['disk_read_gbps']:.2f} GB/s; "
                   f"read_data alone {rodr:.0%})")
        fv = _find(rows, scenario="same", world_size=ws, reader="fast_verify", cache="cold")
        if fv is not None and "read_over_disk" in fv:
            out.append(f"  (fast_verify at ws={ws}, hashes checked: x{fv.get('speedup_vs_stock', nan):.2f} of stock "
                       f"[read_data x{fv.get('speedup_vs_stock_read_data', nan):.2f}], {fv['read_over_disk']:.0%} of raw "
                       f"[read_data {fv.get('read_data_over_disk', nan):.0%}])")
    rr = [r for r in rows if r["reader"] == "fast" and "reshard_ratio" in r and "error" not in r]
    if rr:
        worst = max(rr, key=lambda r: r["reshard_ratio"])
        worst_rd = max(rr, key=lambda r: r.get("reshard_ratio_read_data", nan))
        out.append(f"reshard_ratio <= 1.2 (fast, all reshard cells, cold and warm): "
                   f"{'MET' if worst['reshard_ratio'] <= 1.2 else 'MISSED'} (worst {worst['reshard_ratio']:.2f} at "
                   f"{worst['cell']} {worst['cache']}; read_data alone worst "
                   f"{worst_rd.get('reshard_ratio_read_data', nan):.2f} at {worst_rd['cell']} {worst_rd['cache']})")
    fr = [r for r in rows if r["reader"] in ("fast", "fast_verify") and "error" not in r and r["cache"] == "cold"]
    if fr:
        worst = max(fr, key=lambda r: r["rss_extra_copies"])
        out.append(f"peak RSS <= one extra copy of the local state (fast readers): "
                   f"{'MET' if worst['rss_extra_copies'] <= 1.0 else 'MISSED'} (worst "
                   f"{worst['rss_extra_copies']:.2f} copies = {worst['rss_extra_bytes'] / _MIB:.0f} MiB above the "
                   f"built state at {worst['cell']} {worst['reader']})")
    bad = [r for r in rows if r.get("bitwise_equal") is False]
    out.append("every load bitwise equal to the saved state: " + ("MET" if not bad and rows else "MISSED"))
    return out


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def render_markdown(results: dict[str, Any]) -> str:
    meta, rows = results["meta"], results["results"]
    lines = [f"# bench_load: {meta.get('size_mib', '?')} MiB, {meta['date']}", "",
             f"Machine: {meta['machine'].get('cpu_count')} CPUs, {meta['machine'].get('mem_total_gib', 0):.1f} GiB, "
             f"{meta['machine'].get('data_fs', '')}; torch {meta['torch_version']}; load average "
             f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end; wall {meta['wall_s']:.0f} s.",
             f"Cold cache method: {meta.get('cold_method')} (median resident fraction after eviction: "
             f"{_fmt(meta.get('cold_resident_frac'), '.3f')}). Rounds: {meta.get('rounds')}; readers rotated per "
             "round; ratios paired within a round, median over rounds.", ""]
    lines += ["## Goals", ""] + [f"- {v}" for v in meta.get("verdicts", [])] + [""]
    if not rows:
        lines.append("(no load results)")
        return "\n".join(lines) + "\n"
    lines += ["## Loads", "",
              "| cell | reader | cold s | cold read_data s | cold GB/s | warm s | warm read_data s | warm GB/s | "
              "x stock (cold/warm) | x stock, read_data (cold/warm) | cold / raw seq (load / read_data) | "
              "raw seq GB/s | raw par GB/s | reshard_ratio (cold/warm) | reshard_ratio, read_data (cold/warm) | "
              "peak RSS MiB | extra RSS / local state | bitwise |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    for cell in cells:
        for reader in dict.fromkeys(r["reader"] for r in rows if r["cell"] == cell):
            c = next((r for r in rows if r["cell"] == cell and r["reader"] == reader and r["cache"] == "cold"), {})
            w = next((r for r in rows if r["cell"] == cell and r["reader"] == reader and r["cache"] == "warm"), {})
            if "load_s" not in c:
                lines.append(f"| {cell} | {reader} | ERROR: {str(c.get('error', ''))[:80]} |||||||||||||||||")
                continue
            lines.append(
                f"| {cell} | {reader} | {_fmt(c['load_s'])} | {_fmt(c.get('read_data_s'))} | {_fmt(c['read_gbps'], '.2f')} | "
                f"{_fmt(w.get('load_s'))} | {_fmt(w.get('read_data_s'))} | {_fmt(w.get('read_gbps'), '.2f')} | "
                f"{_fmt(c.get('speedup_vs_stock'), '.2f')} / {_fmt(w.get('speedup_vs_stock'), '.2f')} | "
                f"{_fmt(c.get('speedup_vs_stock_read_data'), '.2f')} / {_fmt(w.get('speedup_vs_stock_read_data'), '.2f')} | "
                f"{_fmt(c.get('read_over_disk'), '.2f')} / {_fmt(c.get('read_data_over_disk'), '.2f')} | "
                f"{_fmt(c['disk_read_gbps'], '.2f')} | {_fmt(c['disk_read_par_gbps'], '.2f')} | "
                f"{_fmt(c.get('reshard_ratio'), '.2f')} / {_fmt(w.get('reshard_ratio'), '.2f')} | "
                f"{_fmt(c.get('reshard_ratio_read_data'), '.2f')} / {_fmt(w.get('reshard_ratio_read_data'), '.2f')} | "
                f"{c['peak_rss_bytes'] / _MIB:.0f} | {_fmt(c['rss_extra_copies'], '.2f')} | "
                f"{'yes' if c.get('bitwise_equal') and w.get('bitwise_equal') else 'NO'} |")
    lines += ["", "Fields: see the module docstring of `benchmarks/bench_load.py`. `read_data` columns time the "
              "reader's `read_data` alone (slowest rank); the others the whole `dcp.load` between barriers "
              "(DCP's planning collectives included, the same work for every reader). `extra RSS / local state` = "
              "(peak RSS - RSS after the target state was built) / this rank's state bytes, max over ranks."]
    notes = meta.get("notes") or []
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results["results"] if "error" not in r and r["cache"] == "cold"]
    if not rows:
        return False
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    readers = list(dict.fromkeys(r["reader"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cells)), 5))
    width = 0.8 / (len(readers) + 1)
    for i, reader in enumerate(readers):
        ys = [next((r["read_gbps"] for r in rows if r["cell"] == c and r["reader"] == reader), float("nan"))
              for c in cells]
        ax.bar([j + (i - len(readers) / 2) * width for j in range(len(cells))], ys, width, label=reader)
    ys = [next((r["disk_read_gbps"] for r in rows if r["cell"] == c), float("nan")) for c in cells]
    ax.bar([j + (len(readers) / 2) * width for j in range(len(cells))], ys, width, color="grey",
           label="raw sequential read")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([c.replace(":", "\n") for c in cells], fontsize=8)
    ax.set_ylabel("cold load, GB/s of state")
    ax.set_title(f"DCP load throughput, {results['meta'].get('size_mib')} MiB, cold page cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _machine(data_dir: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = int(f.readline().split()[1]) / (1 << 20)
    except OSError:
        info["mem_total_gib"] = float("nan")
    try:
        out = subprocess.run(["df", "-PT", str(data_dir)], capture_output=True, text=True, timeout=10).stdout
        fields = out.splitlines()[-1].split()
        info["data_fs"] = f"{fields[1]} on {fields[0]}, {int(fields[4]) / (1 << 20):.0f} GiB free"
    except Exception:  # noqa: BLE001 - informative only
        pass
    return info


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_load",
        description="Benchmark DCP's stock FileSystemReader vs distckpt's FastFileSystemReader (CPU/gloo ranks).",
        epilog="example: python -m benchmarks.bench_load --size-mib 1024 --world-sizes 1 2 --out runs/bench_load")
    p.add_argument("--size-mib", type=float, default=1024, help="state of the whole job, MiB (default: 1024)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], help="same-world cells (default: 1 2)")
    p.add_argument("--reshard-from", type=int, default=2, help="world size of the resharded checkpoints (default: 2)")
    p.add_argument("--reshard-to", type=int, nargs="+", default=[1, 3, 4],
                   help="load world sizes of the reshard cells (default: 1 3 4)")
    p.add_argument("--no-reshard", action="store_true", help="skip the reshard cells")
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP -> FSDP2 cell")
    p.add_argument("--readers", nargs="+", default=list(READERS), choices=READERS)
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every reader once per cell (default: 3)")
    p.add_argument("--thread-count", type=int, default=2, help="FastFileSystemReader thread_count (default: 2)")
    p.add_argument("--out", default="runs/bench_load", help="output directory")
    p.add_argument("--data-dir", default=None, help="checkpoints (default: OUT/data; removed at the end)")
    p.add_argument("--keep-data", action="store_true", help="keep the checkpoints")
    p.add_argument("--timeout-s", type=float, default=600.0, help="upper limit per rank set (seconds)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if any(w < 1 for w in [*args.world_sizes, args.reshard_from, *args.reshard_to]):
        p.error("world sizes must be >= 1")
    if args.size_mib <= 0:
        p.error("--size-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every load succeeded and matched the saved state bitwise."""
    args = _parse(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    repo_root = str(Path(__file__).resolve().parents[1])
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    import torch

    load_start = os.getloadavg()
    cells = _cells(args)
    ckpts: dict[str, tuple[str, int]] = {}
    for c in cells:
        wrapper = "ddp" if c["ckpt"].startswith("ddp") else "fsdp2"
        ckpts[c["ckpt"]] = (wrapper, c["saved_world_size"])
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    rc = 0
    try:
        saved = _save_all(args, data_dir, ckpts)
        samples, disk, errors = _run_loads(args, saved, cells)
        rows = _rows(args, saved, cells, samples, disk, errors)
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
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": argv_list,
        "size_mib": args.size_mib, "rounds": args.rounds, "readers": list(args.readers),
        "thread_count": args.thread_count, "machine": _machine(data_dir.parent),
        "torch_version": torch.__version__, "python": platform.python_version(),
        "data_dir": str(data_dir), "loadavg_start": tuple(round(x, 2) for x in load_start),
        "loadavg_end": tuple(round(x, 2) for x in os.getloadavg()),
        "cold_method": cold[0]["cold_method"] if cold else None,
        "cold_resident_frac": _median([r.get("cold_resident_frac") for r in cold]) if cold else None,
        "wall_s": time.perf_counter() - t_start, "notes": notes,
    }
    meta["verdicts"] = _verdicts(rows, args)
    results = {"meta": meta, "results": rows}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    md = render_markdown(results)
    (out / "results.md").write_text(md)
    if _plot(results, out / "plot.png"):
        _log(f"plot: {out / 'plot.png'}")
    print(md)
    return rc


if __name__ == "__main__":
    sys.exit(main())
