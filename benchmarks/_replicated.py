"""``bench_load``'s replicated cell: a DDP-style state (every rank holds all of it) loaded at
W = 1, 2, 4, 8 ranks with ``load.read_once`` on and off, side by side in one run.

Per size, one rank saves the state once (a replicated checkpoint is the same whatever the
world size that saved it); then for each W and round, both modes load it (order alternating),
each after ``os.sync()`` and ``posix_fadvise(DONTNEED)`` on the checkpoint's files (cold as far
as an unprivileged process can make it: the file system may still cache). Bytes read from the
root are each rank's ``rchar`` (``/proc/self/io``: bytes its ``read``/``preadv`` calls returned)
over its ``load()``, summed over the ranks: the data files plus the small ``.metadata`` and
manifest (gloo's socket receives are not counted); ``checkpoint_bytes`` is the size of the
data files. Times are the slowest rank's ``load()``; the state is compared bitwise.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._output import save_figure
from benchmarks._ranks import run_ranks

__all__ = ["plot_replicated", "render_replicated", "run_replicated"]

_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "distckpt")
_LAYER_FLOATS = 4 << 20  # 16 MiB per parameter


def _model(size_mib: float) -> Any:
    import torch
    from torch import nn

    n = max(1, round(size_mib * (1 << 20) / 4 / _LAYER_FLOATS))
    model = nn.Module()
    model.p = nn.ParameterList([nn.Parameter(torch.empty(_LAYER_FLOATS)) for _ in range(n)])
    return model


def _fill(model: Any, k: float) -> None:
    import torch

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).mul_(1e-3).add_(i + k))


def _config(root: str, read_once: bool, read_only: bool = True) -> Any:
    from distckpt import (
        CheckpointConfig,
        CoordinationConfig,
        LoadConfig,
        RetentionConfig,
        SaveConfig,
        ScheduleConfig,
    )

    return CheckpointConfig(
        root=root,
        schedule=ScheduleConfig(interval_steps=None),
        retention=RetentionConfig(keep_last=None),
        coordination=CoordinationConfig(lock=False),
        save=SaveConfig(enabled=not read_only),
        load=LoadConfig(read_once=read_once),
    )


def _rchar() -> int:
    """Bytes this process's read calls returned so far (``rchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def save_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: save the replicated state of ``spec["size_mib"]`` into ``spec["root"]``."""
    from distckpt import CheckpointManager

    model = _model(spec["size_mib"])
    _fill(model, 0.0)
    with CheckpointManager(_config(spec["root"], True, read_only=False), model=model, optimizer=None) as manager:
        path = manager.save(1)
    return {"checkpoint_bytes": sum(p.stat().st_size for p in Path(path).glob("*.distcp")), "path": path}


def load_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: load with ``spec["read_once"]``; seconds, bytes read, bitwise."""
    import torch
    import torch.distributed as dist

    from distckpt import CheckpointManager

    model = _model(spec["size_mib"])
    _fill(model, 7.0)  # not the saved values
    if rank == 0:
        for f in Path(spec["path"]).iterdir():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    dist.barrier()
    t0, rchar0 = time.perf_counter(), _rchar()
    with CheckpointManager(_config(spec["root"], spec["read_once"]), model=model, optimizer=None) as manager:
        manager.load()
    read_bytes = _rchar() - rchar0
    dist.barrier()
    seconds = time.perf_counter() - t0
    bitwise = all(  # one expected tensor at a time: W ranks of the whole state already fill memory
        torch.equal(p, torch.arange(p.numel(), dtype=torch.float32).mul_(1e-3).add_(i))
        for i, p in enumerate(model.parameters())
    )
    return {"seconds": seconds, "read_bytes": read_bytes, "bitwise": bitwise}


def run_replicated(args: Any, data_dir: Path, log: Any) -> list[dict[str, Any]]:
    """The replicated rows: ``{"scenario": "replicated", "read_once", "world_size", "size_mib",
    "bytes_read", "checkpoint_bytes", "bytes_read_ratio", "load_s", "bitwise_equal", ...}``."""
    rows = []
    for size in args.replicated_sizes_mib:
        root = str(data_dir / f"replicated-{size:g}")
        os.sync()
        saved = run_ranks(
            "benchmarks._replicated:save_rank",
            1,
            {"size_mib": size, "root": root},
            timeout_s=args.timeout_s,
            preload=_PRELOAD,
            label="replicated save",
        )[0]
        os.sync()
        for ws in args.replicated_world_sizes:
            samples: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for r in range(args.rounds):
                for read_once in (True, False) if (r + ws) % 2 == 0 else (False, True):
                    values = run_ranks(
                        "benchmarks._replicated:load_rank",
                        ws,
                        {"size_mib": size, "root": root, "path": saved["path"], "read_once": read_once},
                        timeout_s=args.timeout_s,
                        preload=_PRELOAD,
                        label=f"replicated load W={ws} read_once={read_once}",
                    )
                    samples[read_once].append(
                        {
                            "load_s": max(v["seconds"] for v in values),
                            "bytes_read": sum(v["read_bytes"] for v in values),
                            "bitwise": all(v["bitwise"] for v in values),
                        }
                    )
                    log(f"replicated {size:g} MiB W={ws} read_once={read_once}: {samples[read_once][-1]}")
            for read_once, got in samples.items():
                rows.append(
                    {
                        "scenario": "replicated",
                        "read_once": read_once,
                        "world_size": ws,
                        "size_mib": size,
                        "bytes_read": int(statistics.median(s["bytes_read"] for s in got)),
                        "checkpoint_bytes": saved["checkpoint_bytes"],
                        "bytes_read_ratio": statistics.median(s["bytes_read"] for s in got) / saved["checkpoint_bytes"],
                        "load_s": statistics.median(s["load_s"] for s in got),
                        "load_s_rounds": [s["load_s"] for s in got],
                        "bitwise_equal": all(s["bitwise"] for s in got),
                        "loadavg": os.getloadavg()[0],
                    }
                )
    return rows


def render_replicated(rows: list[dict[str, Any]]) -> str:
    """Markdown: per size and W, bytes read / checkpoint and seconds, read-once on vs off."""
    rep = [r for r in rows if r.get("scenario") == "replicated"]
    if not rep:
        return ""
    lines = [
        "",
        "## Replicated (DDP-style) state: read once, then share",
        "",
        "| size MiB | W | bytes read / checkpoint, read_once on | off | load s, on | off | off / on | bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in sorted({r["size_mib"] for r in rep}):
        for ws in sorted({r["world_size"] for r in rep if r["size_mib"] == size}):
            on = next(r for r in rep if (r["size_mib"], r["world_size"], r["read_once"]) == (size, ws, True))
            off = next(r for r in rep if (r["size_mib"], r["world_size"], r["read_once"]) == (size, ws, False))
            lines.append(
                f"| {size:g} | {ws} | {on['bytes_read_ratio']:.3f} | {off['bytes_read_ratio']:.3f} | "
                f"{on['load_s']:.3f} | {off['load_s']:.3f} | {off['load_s'] / on['load_s']:.2f} | "
                f"{on['bitwise_equal'] and off['bitwise_equal']} |"
            )
    goal = all(r["bytes_read_ratio"] <= 1.05 for r in rep if r["read_once"] and r["world_size"] in (2, 4, 8))
    lines.append("")
    lines.append(
        f"- goal, read_once at W = 2, 4, 8: bytes read <= 1.05x the checkpoint: **{'met' if goal else 'missed'}**"
    )
    return "\n".join(lines) + "\n"


def plot_replicated(rows: list[dict[str, Any]], path: Path) -> bool:
    """Bytes read / checkpoint against W, read_once on and off, per size."""
    from benchmarks._output import pyplot

    plt = pyplot()
    rep = [r for r in rows if r.get("scenario") == "replicated"]
    if plt is None or not rep:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for size in sorted({r["size_mib"] for r in rep}):
        for read_once, style in ((True, "-o"), (False, "--s")):
            pts = sorted((r["world_size"], r) for r in rep if r["size_mib"] == size and r["read_once"] == read_once)
            label = f"{size:g} MiB, read_once {'on' if read_once else 'off'}"
            axes[0].plot([w for w, _ in pts], [r["bytes_read_ratio"] for _, r in pts], style, label=label)
            axes[1].plot([w for w, _ in pts], [r["load_s"] for _, r in pts], style, label=label)
    axes[0].set_ylabel("bytes read from the root / checkpoint")
    axes[1].set_ylabel("load seconds (slowest rank)")
    for ax in axes:
        ax.set_xlabel("ranks (W)")
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return True
