"""Incremental checkpoints: bytes and time of a second save when part of the state is frozen.

``python -m benchmarks.bench_incremental --out DIR`` (defaults: a 1 GiB state, frozen fractions
0, 0.5 and 0.9, 3 rounds, 7 cost rounds; about 2-3 minutes here) writes ``DIR/results.json``,
``DIR/results.md`` (also printed) and ``DIR/plot.png``.

How it measures (one process, no process group: the manager's blocking save, commit included):
the state is ``--tensors`` float32 model tensors of equal size; the first ``round(f * n)`` are
frozen. Each round and frozen fraction uses a fresh root: save step 1 (incremental on: every
tensor written and hashed), change every non-frozen tensor in place (a training step), save
step 2. ``bytes_written_ratio`` = bytes of step 2's own files / step 1's; ``save_time_ratio`` =
seconds of save 2 / save 1 (medians over rounds, ratios per round). Then step 2 is loaded by a
new manager (``bitwise_equal``) and by plain ``dcp.load`` with DCP's ``FileSystemReader``
(``plain_dcp_load_ok``), both compared bitwise with the live state. The cost rows save the
same state with nothing frozen, incremental on and off alternately (order rotated per round,
every tensor changed before each save), to decide whether incremental can be the default
(< 2% cost); the extra work alone (one xxh3-128 pass over the state's bytes, with the ``xxhash``
library distckpt hashes with) is also timed. Every timed
save starts after ``os.sync()``, so no save pays for the writeback of the one before. Timings on
this shared 2-core machine are noisy: the ratios within one run are what counts.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from benchmarks._output import machine_info, prepare_dirs, pyplot, save_figure, write_outputs
from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    CoordinationConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
)

GOAL_BYTES, GOAL_TIME, GOAL_COST = 0.15, 0.35, 0.02
_MIB = 1 << 20


class _State(nn.Module):
    def __init__(self, n: int, numel: int) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(n)])


def _manager(root: Path, model: nn.Module, incremental: bool) -> CheckpointManager:
    config = CheckpointConfig(
        root=str(root),
        schedule=ScheduleConfig(interval_steps=None),
        retention=RetentionConfig(keep_last=None),
        save=SaveConfig(incremental=incremental),
        coordination=CoordinationConfig(lock=False),
    )
    return CheckpointManager(config, model=model, optimizer=None)


def _own_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _step(model: _State, frozen: int) -> None:
    with torch.no_grad():
        for p in list(model.w)[frozen:]:
            p.add_(1e-3)


def _timed_save(manager: CheckpointManager, step: int) -> float:
    os.sync()  # earlier saves' dirty pages written back first: each save starts from the same state
    t0 = time.perf_counter()
    manager.save(step)
    return time.perf_counter() - t0


def run_cell(model: _State, root: Path, frozen: int, check: bool) -> dict[str, Any]:
    """Two consecutive incremental saves in a fresh root; with ``check``, load step 2 both ways."""
    shutil.rmtree(root, ignore_errors=True)
    manager = _manager(root, model, incremental=True)
    t1 = _timed_save(manager, 1)
    _step(model, frozen)
    t2 = _timed_save(manager, 2)
    manager.close()
    b1, b2 = _own_bytes(root / "step-000000001"), _own_bytes(root / "step-000000002")
    row: dict[str, Any] = {"save1_s": t1, "save2_s": t2, "bytes1": b1, "bytes2": b2}
    if check:
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        target = _State(len(model.w), model.w[0].numel())
        loader = _manager(root, target, incremental=True)
        loader.load()
        loader.close()
        row["bitwise_equal"] = all(torch.equal(v, expected[k]) for k, v in target.state_dict().items())
        del target
        plain = {f"model.{k}": torch.empty_like(v) for k, v in expected.items()}
        dcp.load(plain, storage_reader=FileSystemReader(str(root / "step-000000002")), no_dist=True)
        row["plain_dcp_load_ok"] = all(torch.equal(plain[f"model.{k}"], v) for k, v in expected.items())
    shutil.rmtree(root, ignore_errors=True)
    return row


def run_cost(model: _State, data: Path, rounds: int) -> dict[str, Any]:
    """Nothing frozen: second-save time with incremental on vs off, alternating."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            root = data / f"cost-{mode}"
            shutil.rmtree(root, ignore_errors=True)
            manager = _manager(root, model, incremental=mode == "on")
            _timed_save(manager, 1)
            _step(model, 0)
            times[mode].append(_timed_save(manager, 2))
            manager.close()
            shutil.rmtree(root, ignore_errors=True)
    per_round = [on / off for on, off in zip(times["on"], times["off"])]
    cost = statistics.median(per_round) - 1
    # The extra work itself, timed alone: one xxh3 pass over every tensor (what "on" adds to
    # a save where nothing is reused), against the median "off" save.
    hash_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        for p in model.w:  # what an incremental save adds per tensor: xxh3-128 of its bytes
            xxhash.xxh3_128(p.detach().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        hash_s.append(time.perf_counter() - t0)
    return {
        "on_s": times["on"],
        "off_s": times["off"],
        "per_round_ratio": per_round,
        "median_cost": cost,
        "min_cost": min(times["on"]) / min(times["off"]) - 1,
        "hash_pass_s": statistics.median(hash_s),
        "hash_pass_over_off_save": statistics.median(hash_s) / statistics.median(times["off"]),
        "default_ok": max(cost, statistics.median(hash_s) / statistics.median(times["off"])) < GOAL_COST,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_incremental")
    p.add_argument("--data-dir", default=None, help="where checkpoints are written (default OUT/data)")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=20, help="equal-sized tensors the state is made of")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cost-rounds", type=int, default=7)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("distckpt").setLevel(logging.WARNING)
    out, data = prepare_dirs(args)
    started = time.perf_counter()
    torch.manual_seed(0)
    model = _State(args.tensors, args.size_mib * _MIB // 4 // args.tensors)
    rows = []
    for fraction in args.fractions:
        frozen = round(fraction * args.tensors)
        cells = [run_cell(model, data / "cell", frozen, check=r == 0) for r in range(args.rounds)]
        rows.append(
            {
                "frozen_fraction": frozen / args.tensors,
                "size_bytes": args.size_mib * _MIB,
                "bytes_written_ratio": statistics.median(c["bytes2"] / c["bytes1"] for c in cells),
                "save_time_ratio": statistics.median(c["save2_s"] / c["save1_s"] for c in cells),
                "save1_s": statistics.median(c["save1_s"] for c in cells),
                "save2_s": statistics.median(c["save2_s"] for c in cells),
                "bitwise_equal": cells[0]["bitwise_equal"],
                "plain_dcp_load_ok": cells[0]["plain_dcp_load_ok"],
                "rounds": cells,
            }
        )
    cost = run_cost(model, data, args.cost_rounds)
    shutil.rmtree(data, ignore_errors=True) if args.data_dir is None else None
    meta = {
        "date": datetime.date.today().isoformat(),
        "args": vars(args),
        "machine": machine_info(out),
        "loadavg_end": os.getloadavg(),
        "seconds": time.perf_counter() - started,
    }
    results = {"results": rows, "cost_nothing_frozen": cost, "meta": meta}
    write_outputs(out, results, render_markdown, plot)
    return 0 if all(r["bitwise_equal"] and r["plain_dcp_load_ok"] for r in rows) else 1


def render_markdown(results: dict[str, Any]) -> str:
    meta, cost = results["meta"], results["cost_nothing_frozen"]
    lines = [
        f"# Incremental checkpoints ({meta['date']}, {meta['args']['size_mib']} MiB state, "
        f"{meta['args']['rounds']} rounds, {meta['seconds']:.0f} s, load average at the end "
        f"{meta['loadavg_end'][0]:.1f})",
        "",
        "| frozen | bytes 2nd/1st | time 2nd/1st | save 1 s | save 2 s | bitwise (distckpt) | plain dcp.load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["results"]:
        lines.append(
            f"| {r['frozen_fraction']:.0%} | {r['bytes_written_ratio']:.3f} | {r['save_time_ratio']:.3f} | "
            f"{r['save1_s']:.3f} | {r['save2_s']:.3f} | {r['bitwise_equal']} | {r['plain_dcp_load_ok']} |"
        )
    at90 = next((r for r in results["results"] if abs(r["frozen_fraction"] - 0.9) < 1e-9), None)
    lines.append("")
    if at90 is not None:
        for name, key, goal in (("bytes", "bytes_written_ratio", GOAL_BYTES), ("time", "save_time_ratio", GOAL_TIME)):
            v = at90[key]
            lines.append(f"- goal at 90% frozen, {name} <= {goal}: **{'met' if v <= goal else 'missed'}** ({v:.3f})")
    lines += [
        f"- cost with nothing frozen (second save, incremental on / off, median of "
        f"{len(cost['per_round_ratio'])} alternating rounds): {cost['median_cost']:+.1%} "
        f"(per round: {', '.join(f'{x:.3f}' for x in cost['per_round_ratio'])}); "
        f"fastest on / fastest off {cost['min_cost']:+.1%}; "
        f"default if < 2%: **{'yes' if cost['default_ok'] else 'no, stays opt-in'}**",
        f"- the extra work alone, one xxh3 pass over the state: {cost['hash_pass_s']:.3f} s = "
        f"{cost['hash_pass_over_off_save']:.1%} of the median save with incremental off",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = results["results"]
    xs = [f"{r['frozen_fraction']:.0%}" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    pos = range(len(rows))
    ax.bar([i - width / 2 for i in pos], [r["bytes_written_ratio"] for r in rows], width, label="bytes 2nd / 1st")
    ax.bar([i + width / 2 for i in pos], [r["save_time_ratio"] for r in rows], width, label="time 2nd / 1st")
    ax.axhline(GOAL_BYTES, color="C0", ls="--", lw=1, label=f"goal bytes at 90% ({GOAL_BYTES})")
    ax.axhline(GOAL_TIME, color="C1", ls="--", lw=1, label=f"goal time at 90% ({GOAL_TIME})")
    ax.set_xticks(list(pos), xs)
    ax.set_xlabel("fraction of the state's bytes frozen")
    ax.set_ylabel("second save / first save")
    ax.set_title(f"Incremental checkpoints, {results['meta']['args']['size_mib']} MiB ({results['meta']['date']})")
    ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
