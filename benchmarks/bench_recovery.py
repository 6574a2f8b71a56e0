"""Recovery from a failure: time from the kill to the first completed step, memory tier on vs off.

``python -m benchmarks.bench_recovery --out DIR`` (defaults: states of 256 MiB and 1 GiB, about
10 minutes on 2 cores) writes ``DIR/results.json``, ``DIR/results.md`` (also printed) and
``DIR/plot.png``; ``--render-only`` rebuilds the last two from ``DIR/results.json``.

What it runs. For each state size, two elastic jobs side by side in one run, memory tier off
then on (``checkpoint.memory``: a snapshot every step, one replica; docs/memory.md), each the
elastic demo's sequence (``launch.elastic_demo.run_elastic``) with one worker per simulated node
(``DISTCKPT_NODE_ID`` and a memory directory per torchrun agent; ``launch/recovery.py``):

1. ``node_join``: node A trains alone (world size 1); node B's agent starts; A's worker saves on
   the agent's SIGTERM and both nodes resume at world size 2.
2. ``worker_crash``: at world size 2, strictly between two durable checkpoints
   (``--interval``), A's worker is SIGKILLed (its agent and memory intact); both agents restart
   their workers at world size 2.
3. ``node_loss``: later, under the same condition, node B's agent and worker are SIGKILLed and
   its memory directory deleted; A resumes alone at world size 1 and trains to ``--steps``.

The state is the demo GPT's model and AdamW moments (12 bytes per parameter, ``num_parameters``
from the job's ``start`` event), sized by ``model.d_model`` / ``model.n_layer``; with DDP every
node holds all of it, so it is the state per node. Batches are tiny (``G=2``, 8 tokens) so a step
is mostly the optimizer and the gradient all-reduce.

Per event (rank 0's records, ``launch/train.py``): ``breakdown_s`` (``detect``: kill -> the new
worker process starts; ``rendezvous``: -> ``load()`` begins, i.e. interpreter start, imports,
``init_process_group`` and building the job; ``restore``: ``load()``; ``first_step``: ->
the first step completed), ``recovery_s`` (their sum: kill to first completed step),
``lost_s`` (``recovery_s`` plus the replayed steps at the run's median step time: the progress
the failure cost), ``steps_replayed``, ``tier`` and ``bytes_read_from_root`` (memory: 0; durable: the loaded
checkpoint's file bytes, which a full load reads once over all ranks). Per run: the median
snapshot stall (``manager.memory.last_stall_s``) against the median step time at world size 2,
and the median step time with the tier off (the durable tier's figures unchanged). Ratios
(memory / durable) are taken within one run. Sample accounting as in the demo (0 duplicated,
0 skipped expected). This 2-core machine is shared and noisy; the phases that start
interpreters (``detect``, ``rendezvous``) swing most.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._output import machine_info, pyplot, write_outputs  # noqa: E402
from launch import recovery  # noqa: E402
from launch.elastic_demo import analyze, run_elastic  # noqa: E402
from launch.jobs import Run, read_jsonl  # noqa: E402

# d_model, n_layer, n_head: ~22 M and ~89 M parameters, 12 bytes each with AdamW.
SIZES = {"256MiB": (384, 13, 6), "1GiB": (768, 13, 12)}
EVENTS = ("node_join", "worker_crash", "node_loss")
_MIB = 1 << 20


def _overrides(size: str, steps: int, interval: int) -> list[str]:
    d, layers, heads = SIZES[size]
    g, t = 2, 8
    return [
        f"model.d_model={d}",
        f"model.n_layer={layers}",
        f"model.n_head={heads}",
        f"model.seq_len={t}",
        f"data.seq_len={t}",
        f"data.global_batch_size={g}",
        f"data.max_bytes={100 * g * (t + 1)}",  # 100 steps per epoch
        f"train.steps={steps}",
        "train.warmup_steps=2",
        "train.log_every=1",
        f"checkpoint.schedule.interval_steps={interval}",
        "checkpoint.retention.keep_last=2",
    ]


def run_one(out: Path, size: str, memory: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One elastic job (join, worker crash, node loss) with the memory tier on or off."""
    shutil.rmtree(out, ignore_errors=True)
    mem_root = recovery.default_memory_root(f"distckpt-bench-recovery-{uuid.uuid4().hex[:8]}") if memory else None
    train_args = [
        "--config",
        str(REPO / "launch" / "configs" / "ddp.yaml"),
        *_overrides(size, args.steps, args.interval),
        f"train.out={out}",
        f"checkpoint.root={out / 'checkpoints'}",
        *(recovery.memory_overrides(mem_root) if mem_root is not None else []),
    ]
    t0 = time.monotonic()
    try:
        timeline, triggers, rc, wall = run_elastic(
            out,
            train_args,
            interval=args.interval,
            steps=args.steps,
            join_at=args.join_at,
            lose_node=True,
            timeout_s=args.timeout_s,
            memory_root=mem_root,
            worker_crash=True,
            nproc=1,
        )
    finally:
        if mem_root is not None:
            shutil.rmtree(mem_root, ignore_errors=True)
    seconds = time.monotonic() - t0
    start = next((e for e in read_jsonl(out / "events.jsonl") if e["event"] == "start"), {})
    info = {
        "global_batch_size": 2,
        "sampler_seed": 0,
        "dataset_len": start.get("dataset_len", 0),
        "steps_per_epoch": start.get("steps_per_epoch", 1),
    }
    summary = analyze(out, timeline, triggers, Run("none", 1, out, out), info, args.steps, wall=wall)
    events = []
    for e in summary["events"]:
        phases = e.get("breakdown_s") or {}
        total = sum(v for v in phases.values() if v is not None) if phases else None
        events.append({**e, "recovery_s": None if total is None else round(total, 3)})
    at2 = [r for r in timeline.records if r["world_size"] == 2]
    stalls = [r["snapshot_stall_s"] for r in at2 if "snapshot_stall_s" in r]
    steps_s = [r["step_seconds"] for r in at2]
    return {
        "size": size,
        "memory": memory,
        "state_bytes": 12 * start.get("num_parameters", 0),
        "num_parameters": start.get("num_parameters"),
        "returncode": rc,
        "final_step": summary["final_step"],
        "events": events,
        "duplicated_samples": summary["duplicated_samples"],
        "skipped_samples": summary["skipped_samples"],
        "world_sizes": summary["world_sizes"],
        "step_seconds_median": statistics.median(steps_s) if steps_s else None,
        "snapshot_stall_s_median": statistics.median(stalls) if stalls else None,
        "seconds": round(seconds, 1),
    }


def _event(run: dict[str, Any], trigger: str) -> dict[str, Any]:
    return next((e for e in run["events"] if e["trigger"] == trigger), {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, event): memory on and off side by side, with their ratios."""
    rows = []
    for size in dict.fromkeys(r["size"] for r in runs):
        off = next(r for r in runs if r["size"] == size and not r["memory"])
        on = next(r for r in runs if r["size"] == size and r["memory"])
        for trigger in EVENTS:
            e_off, e_on = _event(off, trigger), _event(on, trigger)
            for e, run in ((e_off, off), (e_on, on)):
                if e.get("recovery_s") is not None and run["step_seconds_median"] is not None:
                    e["lost_s"] = round(
                        e["recovery_s"] + (e.get("steps_replayed") or 0) * run["step_seconds_median"], 3
                    )
            rows.append(
                {
                    "size": size,
                    "event": trigger,
                    "off": e_off,
                    "on": e_on,
                    "recovery_ratio": _ratio(e_on.get("recovery_s"), e_off.get("recovery_s")),
                    "lost_ratio": _ratio(e_on.get("lost_s"), e_off.get("lost_s")),
                    "restore_ratio": _ratio(
                        (e_on.get("breakdown_s") or {}).get("restore"), (e_off.get("breakdown_s") or {}).get("restore")
                    ),
                }
            )
    return rows


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def render(results: dict[str, Any]) -> str:
    """The markdown table of :func:`summarize`'s rows and the per-run stall figures."""
    lines = [
        f"# Recovery, memory tier off vs on ({results['meta']['date']})",
        "",
        "| state | event | tier off / on | replayed off / on | MiB from root off / on "
        "| detect | rendezvous | restore | first step | kill -> first step (s) | on / off | lost s | on / off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        off, on = r["off"], r["on"]
        b_off, b_on = off.get("breakdown_s") or {}, on.get("breakdown_s") or {}

        def pair(key: str, off: dict = b_off, on: dict = b_on) -> str:
            return f"{_fmt(off.get(key))} / {_fmt(on.get(key))}"

        def mib(e: dict) -> str:
            v = e.get("bytes_read_from_root")
            return "-" if v is None else f"{v / _MIB:.0f}"

        lines.append(
            f"| {r['size']} | {r['event']} | {off.get('tier', '-')} / {on.get('tier', '-')} "
            f"| {off.get('steps_replayed', '-')} / {on.get('steps_replayed', '-')} | {mib(off)} / {mib(on)} "
            f"| {pair('detect')} | {pair('rendezvous')} | {pair('restore')} | {pair('first_step')} "
            f"| {_fmt(off.get('recovery_s'))} / {_fmt(on.get('recovery_s'))} | {_fmt(r['recovery_ratio'], '.2f')} "
            f"| {_fmt(off.get('lost_s'))} / {_fmt(on.get('lost_s'))} | {_fmt(r.get('lost_ratio'), '.2f')} |"
        )
    lines += [
        "",
        "Phases: off / on, seconds. lost s: kill -> first step plus the replayed steps at the run's median "
        "step time (the progress the failure cost). Per run (world size 2):",
        "",
        "| state | memory | state MiB | step s (median) | snapshot stall s (median) | stall / step "
        "| dup / skipped samples | run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        stall, step = run["snapshot_stall_s_median"], run["step_seconds_median"]
        lines.append(
            f"| {run['size']} | {'on' if run['memory'] else 'off'} | {run['state_bytes'] / _MIB:.0f} "
            f"| {_fmt(step, '.3f')} | {_fmt(stall, '.4f')} | {_fmt(_ratio(stall, step), '.1%')} "
            f"| {run['duplicated_samples']} / {run['skipped_samples']} | {run['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Stacked bars of the recovery phases per (state, event, tier)."""
    plt = pyplot()
    if plt is None:
        return False
    labels: list[str] = []
    stacks: dict[str, list[float]] = {p: [] for p in recovery.PHASES}
    for r in results["rows"]:
        for tier in ("off", "on"):
            b = r[tier].get("breakdown_s") or {}
            labels.append(f"{r['size']}\n{r['event']}\n{'memory' if tier == 'on' else 'durable'}")
            for p in recovery.PHASES:
                stacks[p].append(b.get(p) or 0.0)
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 5))
    bottom = [0.0] * len(labels)
    for p in recovery.PHASES:
        ax.bar(range(len(labels)), stacks[p], bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, stacks[p])]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("seconds from the kill (join: node start) to the first completed step")
    ax.set_title(f"Recovery, memory tier off vs on ({results['meta']['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="example: python -m benchmarks.bench_recovery --out runs/recovery"
    )
    p.add_argument("--out", default="runs/bench_recovery", help="output directory (default runs/bench_recovery)")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES), help="state sizes")
    p.add_argument("--steps", type=int, default=26, help="steps each job reaches (default 26)")
    p.add_argument("--interval", type=int, default=4, help="durable checkpoint every this many steps (default 4)")
    p.add_argument("--join-at", type=int, default=2, help="node B joins once A completed this step (default 2)")
    p.add_argument("--timeout-s", type=float, default=400.0, help="timeout of each job (default 400 s)")
    p.add_argument(
        "--render-only", action="store_true", help="rebuild the table and plot from OUT/results.json, run nothing"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every job finished, else 1."""
    args = _parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        results = json.loads((out / "results.json").read_text())
        results["rows"] = summarize(results["runs"])
        write_outputs(out, results, render, plot)
        return 0
    t0 = time.monotonic()
    runs = []
    for size in args.sizes:
        for memory in (False, True):
            name = f"{size}-{'memory' if memory else 'durable'}"
            print(f"[bench_recovery] {name} ...", flush=True)
            try:
                runs.append(run_one(out / name, size, memory, args))
            except (TimeoutError, RuntimeError, OSError) as e:
                print(f"error: {name}: {e}", file=sys.stderr)
                return 1
            print(f"[bench_recovery] {name}: {runs[-1]['seconds']} s", flush=True)
    results = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "args": vars(args),
            "machine": machine_info(out),
            "seconds": round(time.monotonic() - t0, 1),
        },
        "runs": runs,
        "rows": summarize(runs),
    }
    write_outputs(out, results, render, plot)
    ok = all(r["returncode"] == 0 and r["final_step"] == args.steps for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
