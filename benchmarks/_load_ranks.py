"""Rank side of ``bench_load``: the benchmark model with values any rank can check bitwise, the
save and load workers, and page-cache eviction (``posix_fadvise``) with its residency check."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import time
import zlib
from pathlib import Path
from typing import Any

_MIB = 1 << 20
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
        if local.numel() and not torch.equal(local.cpu(), _expected(name, tuple(p.shape), r0, r1)):
            bad.append(name)
    if int(extra["step"]) != 7:
        bad.append("extra.step")
    if extra["note"] != _EXTRA["note"] or extra["epoch"] != _EXTRA["epoch"]:
        bad.append("extra (bytes items)")
    return bad


def _build(spec: dict[str, Any], world_size: int, wrapper: str):
    """Model for ``wrapper`` in ``plain`` / ``fsdp2`` / ``ddp`` on ``spec["device"]`` (default
    CPU; ``"cuda"``: this rank's current GPU); values zero (touched)."""
    import torch

    width, layers = _layer_count(spec["size_bytes"])
    device = spec.get("device", "cpu")
    if wrapper == "fsdp2" and world_size > 1:
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = _model(width, layers)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device=device)
    else:
        with torch.device("meta"):
            model = _model(width, layers)
        model.to_empty(device=device)
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
    import torch.distributed.checkpoint as dcp

    from distckpt.dcp import FileSystemWriter

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
    # Hashes every file while writing and records them in the sidecar distckpt.dcp.FileSystemReader verifies.
    dcp.save(state, storage_writer=FileSystemWriter(spec["dir"], thread_count=spec["save_thread_count"]))
    dist.barrier()
    return {
        "save_s": time.perf_counter() - t0,
        "state_bytes": _local_bytes(model)[1],
    }


def _make_reader(name: str, directory: str, thread_count: int) -> Any:
    from torch.distributed.checkpoint import FileSystemReader as StockReader

    from distckpt.dcp import FileSystemReader

    if name == "stock":
        return StockReader(directory)
    if name in ("safe_verify", "fast", "fast_verify"):  # verify: against the writer's hash sidecar
        fast, verify = name != "safe_verify", name != "fast"
        return FileSystemReader(directory, verify=verify, fast=fast, thread_count=thread_count)
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
        # As the manager does by default: 2 read streams per node (every rank is on this node).
        streams = spec["thread_count"] or max(1, 2 // world_size)
        reader = _make_reader(spec["reader"], spec["dir"], streams)
        read_data = reader.read_data
        timing: dict[str, float] = {}

        def timed_read_data(plan, planner, read_data=read_data, timing=timing):
            t = time.perf_counter()
            try:
                return read_data(plan, planner)
            finally:
                timing["s"] = time.perf_counter() - t

        reader.read_data = timed_read_data
        dcp.load(state, storage_reader=reader)
        dist.barrier()
        load_s = time.perf_counter() - t0
        bad = _check(model, extra)
        loads.append(
            {
                "cache": cache,
                "load_s": load_s,
                "read_data_s": timing.get("s"),
                "bad": bad,
                "cold_method": method,
                "cold_resident_frac": resident,
                "stats": dict(getattr(reader, "last_stats", {}) or {}),
            }
        )
    return {
        "loads": loads,
        "peak_rss_bytes": _peak_rss_bytes(),
        "baseline_rss_bytes": baseline,
        "rss_before_load_bytes": rss_before,
        "local_state_bytes": local_bytes,
        "global_state_bytes": global_bytes,
    }
