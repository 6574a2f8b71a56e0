"""Many small tensors: save and load time against the number of parameters, distckpt vs stock DCP.

``python -m benchmarks.bench_many_tensors --out DIR`` (defaults: N = 100, 1,000, 10,000, 30,000
parameters of 256 float32 with AdamW, world sizes 1 and 2, one round; CPU-heavy: about 15-25
minutes here at N = 30,000) writes ``DIR/results.json``, ``DIR/results.md`` (also printed) and
``DIR/plot.png``.

How it measures: per N and world size, one set of gloo ranks (``benchmarks._ranks``) builds the
same model (seeded: ``N`` parameters of ``--numel`` floats in a ``ParameterList``, replicated on
every rank as under DDP) and an AdamW with one step taken, so the state holds ``N`` parameters
plus ``step``, ``exp_avg``, ``exp_avg_sq`` per parameter (``tensors`` = 4N). Then, for each
implementation in turn (the order alternates with N): a timed blocking save into a fresh
directory, the live state perturbed, a timed load, and a bitwise comparison with the saved
values. ``distckpt`` = ``CheckpointManager.save``/``load`` (commit, manifest, hashes, verified
load included); ``stock`` = ``get_state_dict`` + ``dcp.save`` and ``dcp.load`` +
``set_state_dict`` (torch's own API, no distckpt code). The world-size-2 checkpoints are then
loaded by one process (``"scenario": "reshard 2->1"``). Times are each rank set's slowest rank.
``growth`` is the least-squares slope of log(seconds) against log(N) over N >= 1,000, per
implementation (world size 1, same-world rows). Timings on this shared 2-core machine are noisy
(the load average is recorded): the ratios within one run are what counts; ``--rounds R`` runs R
interleaved rounds per cell and keeps each implementation's fastest save and load.

``--peers`` adds the fastest single-process savers to the same-world cells, in the same ranks:
``torch_checkpointing`` (the ``torch-checkpointing`` package, extra ``bench-peers``; skipped with
a note when not installed), ``torch_save`` (one ``torch.save``/``torch.load`` of the module's and
optimizer's ``state_dict()``, as Lightning and accelerate do) and ``raw`` (the same bytes
written as one file and fsynced, then read back into the live tensors: the physical limit);
``results.md`` gets a second table with each time over distckpt's and the goal line.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks._output import machine_info, prepare_dirs, pyplot, save_figure, write_outputs
from benchmarks._ranks import run_ranks

IMPLS = ("distckpt", "stock")
# --peers: the fastest single-process savers, and the bytes alone (``raw``: the physical limit).
PEERS = ("torch_checkpointing", "torch_save", "raw")
GOAL_EXPONENT, GOAL_SAVE_S, GOAL_LOAD_S, GOAL_SPEEDUP = 1.1, 10.0, 5.0, 3.0
# --peers goal: distckpt no slower than torch-checkpointing, within this factor of plain torch.save.
GOAL_TORCH_SAVE_FACTOR = 1.5


def peer_available(impl: str) -> bool:
    """Whether ``impl`` can run here: torch-checkpointing is an optional extra (``bench-peers``)."""
    if impl != "torch_checkpointing":
        return True
    import importlib.util

    return importlib.util.find_spec("torch_checkpointing") is not None


def _build(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Module()
    model.p = nn.ParameterList([nn.Parameter(torch.randn(spec["numel"])) for _ in range(spec["params"])])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _snapshot(model: Any, opt: Any) -> list[Any]:
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values()
    ]


def _perturb(model: Any, opt: Any) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"].zero_()


def _raw_tensors(model: Any, opt: Any) -> list[Any]:
    return [p.detach() for p in model.parameters()] + [v for s in opt.state.values() for v in s.values()]


def _raw_save(path: str, model: Any, opt: Any) -> None:
    # The same bytes as one file: one write per tensor from its memory, then fsync (as distckpt).
    import torch

    os.makedirs(path, exist_ok=True)
    with open(f"{path}/raw-{torch.distributed.get_rank()}.bin", "wb", buffering=0) as f:
        for t in _raw_tensors(model, opt):
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def _raw_load(path: str, model: Any, opt: Any) -> None:
    # One sequential read of the file straight into the live tensors' memory.
    import torch

    with open(f"{path}/raw-{torch.distributed.get_rank()}.bin", "rb", buffering=0) as f:
        for t in _raw_tensors(model, opt):
            f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


_STEADY: dict[str, Any] = {}  # --steady: one manager per implementation for every round of the process


def _tc_manager() -> Any:
    from torch_checkpointing import CheckpointManager as TcManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    # Its default O_DIRECT writes fail on ext4 here (unaligned close: EINVAL); buffered I/O, no fsync.
    config = TcManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return TcManager(config)


def _peer_save(impl: str, path: str, model: Any, opt: Any) -> None:
    import torch

    if impl == "raw":
        _raw_save(path, model, opt)
    elif impl == "torch_save":
        # What Lightning and accelerate do: one torch.save of the module's and optimizer's state_dict().
        os.makedirs(path, exist_ok=True)
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        torch.save(sd, f"{path}/rank{torch.distributed.get_rank()}.pt")
    else:
        # Synchronous save (the blocking time, as for the others); its default layout is one
        # torch.save file per item and rank.
        manager = _STEADY.get(impl) or _tc_manager()
        try:
            manager.save(path, {"model": model.state_dict(), "optim": opt.state_dict()})
        finally:
            if manager is not _STEADY.get(impl):
                manager.close()


def _peer_load(impl: str, path: str, model: Any, opt: Any) -> None:
    import torch

    if impl == "raw":
        _raw_load(path, model, opt)
    elif impl == "torch_save":
        sd = torch.load(f"{path}/rank{torch.distributed.get_rank()}.pt", map_location="cpu")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    else:
        # Its documented load: copy_ into the live state_dict() tensors (which alias the
        # parameters and the optimizer's state), mmap-backed by default.
        manager = _tc_manager()
        try:
            manager.load(path, into={"model": model.state_dict(), "optim": opt.state_dict()})
        finally:
            manager.close()


def _save(impl: str, path: str, model: Any, opt: Any, step: int | None = None) -> None:
    """``step``: --steady, the ``step``-th save of one long-lived manager (one root, ``keep_last=1``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if impl in PEERS:
        _peer_save(impl, path, model, opt)
        return
    if impl == "stock":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        return
    from distckpt import CheckpointConfig, CheckpointManager, CoordinationConfig, RetentionConfig, ScheduleConfig

    config = CheckpointConfig(
        root=path,
        schedule=ScheduleConfig(interval_steps=None),
        retention=RetentionConfig(keep_last=None if step is None else 1),
        coordination=CoordinationConfig(lock=False),
    )
    if step is not None:
        if impl not in _STEADY:
            _STEADY[impl] = CheckpointManager(config, model=model, optimizer=opt)
        _STEADY[impl].save(step)
        return
    with CheckpointManager(config, model=model, optimizer=opt) as manager:
        manager.save(1)


def _load(impl: str, path: str, model: Any, opt: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if impl in PEERS:
        _peer_load(impl, path, model, opt)
        return
    if impl == "stock":
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return
    from distckpt import CheckpointConfig, CheckpointManager, CoordinationConfig, SaveConfig, ScheduleConfig

    config = CheckpointConfig(
        root=path,
        schedule=ScheduleConfig(interval_steps=None),
        coordination=CoordinationConfig(lock=False),
        save=SaveConfig(enabled=False),
    )
    with CheckpointManager(config, model=model, optimizer=opt) as manager:
        assert manager.load() is not None


def _rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: save and load with each implementation (or, ``spec["reshard"]``, load only)."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("distckpt").setLevel(logging.WARNING)
    model, opt = _build(spec)
    expected = _snapshot(model, opt)
    out: dict[str, Any] = {}
    if spec.get("steady"):
        _STEADY.update({"torch_checkpointing": _tc_manager()} if "torch_checkpointing" in spec["order"] else {})
    for r in range(spec.get("rounds", 1)):  # rounds interleave the implementations; the best counts
        for impl in spec["order"]:
            if spec["reshard"] and impl not in IMPLS:
                continue  # the peers write per-rank files with no resharding
            path = f"{spec['dir']}/{impl}"
            steady = 2 * r + 2 if spec.get("steady") and impl == "distckpt" else None
            if not spec["reshard"]:
                if rank == 0 and steady is None:
                    shutil.rmtree(path, ignore_errors=True)  # the previous round's checkpoint
                if spec.get("steady") and r > 0:
                    # The previous round's load replaced the optimizer's state: a job saves after
                    # optimizer steps, not loads, so the save timed is the second one since.
                    _save(impl, path, model, opt, None if steady is None else steady - 1)
                    dist.barrier()
                    if rank == 0 and steady is None:
                        shutil.rmtree(path, ignore_errors=True)
                dist.barrier()
                t0 = time.perf_counter()
                _save(impl, path, model, opt, steady)
                dist.barrier()
                out[f"{impl}_save_s"] = min(time.perf_counter() - t0, out.get(f"{impl}_save_s", math.inf))
            _perturb(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            _load(impl, path, model, opt)
            dist.barrier()
            out[f"{impl}_load_s"] = min(time.perf_counter() - t0, out.get(f"{impl}_load_s", math.inf))
            same = all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), expected, strict=True))
            out[f"{impl}_bitwise"] = same and out.get(f"{impl}_bitwise", True)
    for manager in _STEADY.values():
        manager.close()
    _STEADY.clear()
    return out


def growth_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(seconds) against log(N) over ``(N, seconds)`` points."""
    xs, ys = [math.log(n) for n, _ in points], [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_many_tensors")
    p.add_argument("--data-dir", default=None, help="where checkpoints are written (default OUT/data)")
    p.add_argument("--params", type=int, nargs="+", default=[100, 1_000, 10_000, 30_000])
    p.add_argument("--numel", type=int, default=256, help="floats per parameter")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per rank set")
    p.add_argument("--rounds", type=int, default=1, help="save+load rounds per cell; the fastest of each counts")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also time torch-checkpointing (extra bench-peers; skipped with a note when absent), "
        "plain torch.save/torch.load and a raw write/read of the same bytes",
    )
    p.add_argument(
        "--steady",
        action="store_true",
        help="save as a training job does: one manager for every round (distckpt: steps 1, 2, ... into one "
        "root, keep_last=1; torch-checkpointing: one manager), the save timed being the second since the "
        "previous round's load (each implementation); loads stay a new manager each (a restart)",
    )
    args = p.parse_args(argv)
    out, data = prepare_dirs(args)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    peers = [impl for impl in PEERS if args.peers and peer_available(impl)]
    if args.peers and len(peers) < len(PEERS):
        notes.append("torch-checkpointing not installed (pip install -e .[bench-peers]): skipped")
    impls = list(IMPLS) + peers
    for i, n in enumerate(args.params):
        order = impls if i % 2 == 0 else list(reversed(impls))
        for ws in args.world_sizes:
            cell = data / f"n{n}-w{ws}"
            shutil.rmtree(cell, ignore_errors=True)
            spec = {
                "params": n,
                "numel": args.numel,
                "dir": str(cell),
                "order": order,
                "reshard": False,
                "rounds": args.rounds,
                "steady": args.steady,
            }
            runs = [(ws, "same", spec)]
            if ws == 2 and 1 in args.world_sizes:
                runs.append((1, "reshard 2->1", dict(spec, reshard=True)))
            for world_size, scenario, s in runs:
                values = run_ranks(
                    "benchmarks.bench_many_tensors:_rank",
                    world_size,
                    s,
                    timeout_s=args.timeout_s,
                    preload=("torch", "torch.distributed", "torch.distributed.checkpoint", "distckpt"),
                    label=f"N={n} W={world_size} {scenario}",
                )
                for impl in impls if not s["reshard"] else IMPLS:
                    row = {
                        "impl": impl,
                        "params": n,
                        "tensors": 4 * n,
                        "world_size": world_size,
                        "scenario": scenario,
                        "save_s": None if s["reshard"] else max(v[f"{impl}_save_s"] for v in values),
                        "load_s": max(v[f"{impl}_load_s"] for v in values),
                        "bitwise": all(v[f"{impl}_bitwise"] for v in values),
                        "loadavg": os.getloadavg()[0],
                    }
                    rows.append(row)
                    print(row, flush=True)
            shutil.rmtree(cell, ignore_errors=True)
    growth: dict[str, dict[str, float | None]] = {}
    for impl in IMPLS:
        same = [r for r in rows if r["impl"] == impl and r["world_size"] == 1 and r["scenario"] == "same"]
        fit = [r for r in same if r["params"] >= 1_000]
        growth[impl] = {
            f"{kind}_exponent": growth_exponent([(r["params"], r[f"{kind}_s"]) for r in fit]) if len(fit) >= 2 else None
            for kind in ("save", "load")
        }
    if args.data_dir is None:
        shutil.rmtree(data, ignore_errors=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "args": vars(args),
        "machine": machine_info(out),
        "loadavg_end": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "peer_notes": notes,
    }
    results = {"results": rows, "growth": growth, "meta": meta}
    write_outputs(out, results, render_markdown, plot)
    return 0 if all(r["bitwise"] for r in rows) else 1


def _row(rows: list[dict[str, Any]], impl: str, n: int, ws: int, scenario: str) -> dict[str, Any] | None:
    return next(
        (r for r in rows if (r["impl"], r["params"], r["world_size"], r["scenario"]) == (impl, n, ws, scenario)),
        None,
    )


def render_markdown(results: dict[str, Any]) -> str:
    meta, rows = results["meta"], results["results"]
    lines = [
        f"# Many tensors ({meta['date']}, {meta['args']['numel']} floats per parameter + AdamW, "
        f"{meta['seconds']:.0f} s, load average at the end {meta['loadavg_end'][0]:.1f})",
        "",
        "| params | tensors | world | scenario | distckpt save s | stock save s | save x | "
        "distckpt load s | stock load s | load x | bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["params"], r["world_size"], r["scenario"]) for r in rows}, key=lambda k: (k[0], k[2] != "same", k[1])
    )
    for n, ws, scenario in keys:
        d, s = _row(rows, "distckpt", n, ws, scenario), _row(rows, "stock", n, ws, scenario)
        if d is None or s is None:
            continue

        def cell(key: str, d: dict[str, Any] = d, s: dict[str, Any] = s) -> tuple[str, str, str]:
            if d[key] is None:
                return "-", "-", "-"
            return f"{d[key]:.2f}", f"{s[key]:.2f}", f"{s[key] / d[key]:.1f}"

        lines.append(
            f"| {n:,} | {d['tensors']:,} | {ws} | {scenario} | "
            + " | ".join(cell("save_s"))
            + " | "
            + " | ".join(cell("load_s"))
            + f" | {d['bitwise'] and s['bitwise']} |"
        )
    lines.append("")
    for impl, g in results["growth"].items():
        if g["save_exponent"] is not None:
            lines.append(
                f"- growth from N = 1,000 up ({impl}, world size 1): save N^{g['save_exponent']:.2f}, "
                f"load N^{g['load_exponent']:.2f}"
            )
    d, s = _row(rows, "distckpt", 10_000, 1, "same"), _row(rows, "stock", 10_000, 1, "same")
    g = results["growth"]["distckpt"]
    if g["save_exponent"] is not None:
        ok = max(g["save_exponent"], g["load_exponent"]) <= GOAL_EXPONENT
        lines.append(f"- goal: distckpt growth exponent <= {GOAL_EXPONENT}: **{'met' if ok else 'missed'}**")
    if d is not None and s is not None:
        lines.append(
            f"- goal at N = 10,000: save <= {GOAL_SAVE_S:g} s ({d['save_s']:.2f}), load <= {GOAL_LOAD_S:g} s "
            f"({d['load_s']:.2f}), >= {GOAL_SPEEDUP:g}x stock on both ({s['save_s'] / d['save_s']:.1f}x, "
            f"{s['load_s'] / d['load_s']:.1f}x): **"
            + (
                "met"
                if d["save_s"] <= GOAL_SAVE_S
                and d["load_s"] <= GOAL_LOAD_S
                and min(s["save_s"] / d["save_s"], s["load_s"] / d["load_s"]) >= GOAL_SPEEDUP
                else "missed"
            )
            + "**"
        )
    lines += [""] * (lines[-1] != "") + render_peers(results)
    return "\n".join(lines) + "\n"


def render_peers(results: dict[str, Any]) -> list[str]:
    """The ``--peers`` table (same-world cells): each implementation's seconds and its time over
    distckpt's (``x distckpt``: below 1 is faster than distckpt), and the goal per cell."""
    rows = [r for r in results["results"] if r["scenario"] == "same"]
    if not any(r["impl"] in PEERS for r in rows):
        return []
    lines = [
        "| params | tensors | world | impl | save s | save x distckpt | load s | load x distckpt | bitwise |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    goals = [""]
    for n, ws in sorted({(r["params"], r["world_size"]) for r in rows}):
        d = _row(rows, "distckpt", n, ws, "same")
        if d is None:
            continue
        for impl in ("distckpt", "stock", *PEERS):
            r = _row(rows, impl, n, ws, "same")
            if r is not None:
                lines.append(
                    f"| {n:,} | {r['tensors']:,} | {ws} | {impl} | {r['save_s']:.3f} | "
                    f"{r['save_s'] / d['save_s']:.2f} | {r['load_s']:.3f} | {r['load_s'] / d['load_s']:.2f} | "
                    f"{r['bitwise']} |"
                )
        tc, ts = _row(rows, "torch_checkpointing", n, ws, "same"), _row(rows, "torch_save", n, ws, "same")
        if tc is not None and ts is not None:
            ok = all(d[k] <= tc[k] and d[k] <= GOAL_TORCH_SAVE_FACTOR * ts[k] for k in ("save_s", "load_s"))
            goals.append(
                f"- goal at N = {n:,}, world size {ws}: save and load no slower than torch-checkpointing and "
                f"within {GOAL_TORCH_SAVE_FACTOR:g}x of torch.save (save {d['save_s'] / ts['save_s']:.2f}x, "
                f"load {d['load_s'] / ts['load_s']:.2f}x torch.save): **{'met' if ok else 'missed'}**"
            )
    return lines + goals + [f"- {note}" for note in results["meta"].get("peer_notes", [])]


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, kind in zip(axes, ("save", "load")):
        for impl, style in (("distckpt", "-o"), ("stock", "--s")):
            for ws in sorted({r["world_size"] for r in results["results"]}):
                pts = [
                    (r["params"], r[f"{kind}_s"])
                    for r in results["results"]
                    if r["impl"] == impl and r["world_size"] == ws and r["scenario"] == "same"
                ]
                if pts:
                    ax.plot(*zip(*sorted(pts)), style, label=f"{impl}, world size {ws}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (x4 tensors with AdamW)")
        ax.set_ylabel(f"{kind} seconds")
        ax.set_title(f"{kind} ({results['meta']['date']})")
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
