"""The recovery records of the memory tier's demo and benchmark (launch/recovery.py,
launch/elastic_demo.py --memory, benchmarks/bench_recovery.py), without processes."""

from __future__ import annotations

import json
import os
import pathlib
import time

from benchmarks.bench_recovery import render, summarize
from launch.config import load_job_config
from launch.elastic_demo import Timeline, analyze, check
from launch.jobs import Run
from launch.recovery import breakdown, memory_overrides, node_env
from launch.train import process_start_time

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_breakdown_splits_kill_to_first_step_into_four_phases() -> None:
    resumed = {"worker_start": 103.0, "load_start": 110.5, "load_end": 111.25}
    got = breakdown(100.0, resumed, {"time": 112.0})
    assert got == {"detect": 3.0, "rendezvous": 7.5, "restore": 0.75, "first_step": 0.75}
    assert sum(got.values()) == 112.0 - 100.0
    assert breakdown(100.0, {}, {"time": 112.0}) == dict.fromkeys(got)  # no resumed event: unknown


def test_process_start_time_is_this_process_start() -> None:
    t = process_start_time()
    assert t <= time.time()
    assert abs(process_start_time(os.getpid()) - t) < 0.05  # boot time = now - uptime, read each call
    # /proc/<pid>/stat counts from boot: a process this test started began after it.
    assert time.time() - t < 24 * 3600


def test_memory_overrides_turn_the_tier_on_with_a_directory_per_node(tmp_path: pathlib.Path) -> None:
    cfg = load_job_config(REPO / "launch" / "configs" / "ddp.yaml", memory_overrides(tmp_path / "mem"))
    m = cfg.checkpoint.memory
    assert (m.enabled, m.interval_steps, m.replicas, m.dir) == (True, 1, 1, f"{tmp_path}/mem/{{node}}")
    assert node_env("node_b") == {"DISTCKPT_NODE_ID": "node_b"}


def _write(path: pathlib.Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_crash_that_replays_nothing_is_a_transition_with_its_tier_bytes_and_breakdown(
    tmp_path: pathlib.Path,
) -> None:
    """Steps 1-3 by one worker round, 4-5 by the next at the same world size (resumed from 3,
    nothing replayed): the new worker_start splits them; the event gets its resumed record's fields."""
    g, n = 4, 40
    from distckpt.data import ReshardableSampler

    perm = ReshardableSampler(n, global_batch_size=g, rank=0, world_size=1, seed=0).permutation(0).tolist()
    metrics = [
        {"step": s, "world_size": 4, "loss": 1.0 / s, "worker_start": 1000.0 if s <= 3 else 1020.0, "time": 1000.0 + s}
        for s in range(1, 6)
    ]
    metrics[3]["time"] = 1031.0
    _write(tmp_path / "metrics.jsonl", metrics)
    for r in range(4):
        rows = [{"step": s, "ids": perm[(s - 1) * g + r : (s - 1) * g + r + 1]} for s in range(1, 6)]
        _write(tmp_path / f"presave.rank{r}.jsonl", rows)
    resumed = {
        "event": "resumed",
        "step": 3,
        "saved_world_size": 4,
        "world_size": 4,
        "tier": "memory",
        "bytes_read_from_root": 0,
        "bytes_between_nodes": 10,
        "worker_start": 1020.0,
        "load_start": 1028.0,
        "load_end": 1030.0,
    }
    _write(tmp_path / "events.jsonl", [resumed])
    timeline = Timeline(tmp_path / "metrics.jsonl")
    timeline.poll()
    assert timeline.segments() == [(0, 3), (3, 5)]
    base = Run("base", 4, tmp_path, tmp_path, metrics={s: {"loss": 1.0 / s} for s in range(1, 6)})
    info = {"global_batch_size": g, "steps_per_epoch": n // g, "dataset_len": n, "sampler_seed": 0}
    summary = analyze(tmp_path, timeline, [("worker_crash", -1.0)], base, info, 5, wall={"worker_crash": 1015.0})
    (e,) = summary["events"]
    assert (e["trigger"], e["resumed_from_step"], e["steps_replayed"]) == ("worker_crash", 3, 0)
    assert (e["tier"], e["bytes_read_from_root"], e["bytes_between_nodes"]) == ("memory", 0, 10)
    assert e["breakdown_s"] == {"detect": 5.0, "rendezvous": 8.0, "restore": 2.0, "first_step": 1.0}
    assert (summary["duplicated_samples"], summary["skipped_samples"]) == (0, 0)  # from presave.rank*.jsonl
    summary["returncode"] = 0
    assert all(r["ok"] for r in check(summary, 5, 1e-4, ["worker_crash"], memory=True))


def test_the_memory_requirements_fail_on_a_replay_or_a_read_from_the_root() -> None:
    base = {"world_size_before": 4, "world_size_after": 2, "saved_on_sigterm": False, "resumed_from_step": 30}
    summary = {
        "events": [{**base, "trigger": "node_loss", "steps_replayed": 5, "tier": "durable", "bytes_read_from_root": 7}],
        "resumes": [{"step": 30, "saved_world_size": 4, "world_size": 2}],
        "final_step": 40,
        "returncode": 0,
        "max_abs_loss_diff": 0.0,
        "duplicated_samples": 0,
        "skipped_samples": 0,
    }
    failed = [r["what"] for r in check(summary, 40, 1e-4, ["node_loss"], memory=True) if not r["ok"]]
    assert failed == ["node_loss: at most 1 step replayed, restored from memory, 0 bytes read from the root"]
    assert all(r["ok"] for r in check(summary, 40, 1e-4, ["node_loss"]))  # without --memory: as before
    summary["events"][0].update(steps_replayed=1, tier="memory", bytes_read_from_root=0)
    assert all(r["ok"] for r in check(summary, 40, 1e-4, ["node_loss"], memory=True))


def test_bench_recovery_table_puts_the_tiers_side_by_side() -> None:
    def run(memory: bool, restore: float) -> dict:
        phases = {"detect": 2.0, "rendezvous": 5.0, "restore": restore, "first_step": 1.0}
        ev = {
            "trigger": "node_loss",
            "tier": "memory" if memory else "durable",
            "steps_replayed": 0 if memory else 2,
            "bytes_read_from_root": 0 if memory else 2**30,
            "breakdown_s": phases,
            "recovery_s": sum(phases.values()),
        }
        return {
            "size": "1GiB",
            "memory": memory,
            "events": [ev],
            "state_bytes": 2**30,
            "step_seconds_median": 1.0,
            "snapshot_stall_s_median": 0.05 if memory else None,
            "duplicated_samples": 0,
            "skipped_samples": 0,
            "seconds": 60.0,
        }

    runs = [run(False, 4.0), run(True, 1.0)]
    rows = summarize(runs)
    loss = next(r for r in rows if r["event"] == "node_loss")
    assert (loss["restore_ratio"], loss["recovery_ratio"]) == (0.25, 0.75)
    md = render({"meta": {"date": "2026-12-02"}, "runs": runs, "rows": rows})
    assert "| 1GiB | node_loss | durable / memory | 2 / 0 | 1024 / 0 |" in md
    assert "| 1GiB | on | 1024 | 1.000 | 0.0500 | 5.0% | 0 / 0 | 60.0 |" in md


def test_a_step_snapshotted_but_never_recorded_counts_once_and_replays_nothing(tmp_path: pathlib.Path) -> None:
    """Rank 0 killed between step 3's snapshot and its metrics record; the restart resumes from 3:
    step 3's samples come from the presave records at the world size of step 2, and the event
    reports 0 steps replayed (not -1)."""
    from distckpt.data import ReshardableSampler

    g, n = 4, 40
    perm = ReshardableSampler(n, global_batch_size=g, rank=0, world_size=1, seed=0).permutation(0).tolist()
    rows = [(1, 1000.0), (2, 1000.0), (4, 1020.0), (5, 1020.0)]
    metrics = [{"step": s, "world_size": 4, "loss": 1.0 / s, "worker_start": w, "time": w + s} for s, w in rows]
    _write(tmp_path / "metrics.jsonl", metrics)
    for r in range(4):
        _write(tmp_path / f"presave.rank{r}.jsonl", [{"step": s, "ids": [perm[(s - 1) * g + r]]} for s in range(1, 6)])
    resumed = {"event": "resumed", "step": 3, "saved_world_size": 4, "world_size": 4, "worker_start": 1020.0}
    _write(tmp_path / "events.jsonl", [resumed | {"tier": "memory", "bytes_read_from_root": 0}])
    timeline = Timeline(tmp_path / "metrics.jsonl")
    timeline.poll()
    base = Run("base", 4, tmp_path, tmp_path, metrics={s: {"loss": 1.0 / s} for s in range(1, 6)})
    info = {"global_batch_size": g, "steps_per_epoch": n // g, "dataset_len": n, "sampler_seed": 0}
    summary = analyze(tmp_path, timeline, [("worker_crash", -1.0)], base, info, 5, wall={"worker_crash": 1010.0})
    (e,) = summary["events"]
    assert (e["resumed_from_step"], e["steps_replayed"]) == (3, 0)
    assert (summary["duplicated_samples"], summary["skipped_samples"]) == (0, 0)
