"""Chaos test (tests/chaos), shortened: 5 SIGKILLs inside saves, on CPU/gloo.

The run (about 70 s on 2 cores): a reference job, then six torchrun segments on one checkpoint
root, the first five SIGKILLed as a whole at seeded instants aimed at save phases, the last
one trained to the end; some restarts change the world size. The figures come from the
report. The pure helpers (what a kill hit, what counts as a lost checkpoint) are checked first.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.chaos import JsonlTail, classify_phase, lost_checkpoints

REPO = pathlib.Path(__file__).resolve().parents[2]


def _disk(valid, pending=(), latest=None, invalid=()):
    return {
        "valid": sorted(valid),
        "invalid": {s: "manifest missing" for s in invalid},
        "pending": [
            dict(
                {
                    "name": f".pending-step-{s['step']:09d}-ab",
                    "files": 1,
                    "metadata": False,
                    "manifest": False,
                    "manifest_tmp": False,
                },
                **s,
            )
            for s in pending
        ],
        "latest": latest,
        "other": [],
    }


def test_classify_phase_reads_the_save_state_from_disk() -> None:
    old = "step-000000004"
    assert classify_phase(_disk([2, 4], latest=old), None, None, 2) == "train"
    assert classify_phase(_disk([2, 4], latest=old), 6, ("stage", 6), 2) == "stage"
    assert classify_phase(_disk([2, 4], [{"step": 6}], old), 6, ("write", 6), 2) == "write"
    assert classify_phase(_disk([2, 4], [{"step": 6, "metadata": True}], old), 6, ("manifest", 6), 2) == "manifest"
    assert (
        classify_phase(_disk([2, 4], [{"step": 6, "metadata": True, "manifest": True}], old), 6, ("rename", 6), 2)
        == "rename"
    )
    assert classify_phase(_disk([2, 4, 6], latest=old), 6, ("latest", 6), 2) == "latest"
    new = "step-000000006"
    assert classify_phase(_disk([2, 4, 6], latest=new), 6, ("retention", 2), 2) == "retention"
    assert classify_phase(_disk([4, 6], latest=new, invalid=[2]), 6, ("retention", 2), 2) == "retention"
    assert classify_phase(_disk([4, 6], latest=new), 6, ("retention", 2), 2) == "train"
    assert classify_phase(_disk([2, 4, 6], latest=new), 6, ("latest", 6), 2) == "retention"  # not yet begun


def test_lost_checkpoints_allows_only_retention() -> None:
    assert lost_checkpoints([2, 4], [2, 4, 6], keep_last=2) == []
    assert lost_checkpoints([2, 4, 6], [4, 6, 8], keep_last=2) == []  # 2 newer ones: retention
    assert lost_checkpoints([2, 4, 6], [6, 8], keep_last=2) == []
    assert lost_checkpoints([2, 4, 6], [6], keep_last=2) == [2, 4]  # deleted with one newer left
    assert lost_checkpoints([4, 6], [4], keep_last=2) == [6]  # the newest vanished


def test_jsonl_tail_waits_for_whole_lines(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "e.jsonl"
    tail = JsonlTail(path)
    assert tail.new() == []
    path.write_text('{"a": 1}\n{"b"')
    assert tail.new() == [{"a": 1}]
    with open(path, "a") as f:
        f.write(': 2}\n{torn\n{"c": 3}\n')
    assert tail.new() == [{"b": 2}, {"c": 3}]


@pytest.mark.timeout(300)
def test_chaos_five_kills(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "chaos"
    cmd = [
        sys.executable,
        "-m",
        "tests.chaos",
        "--kills",
        "5",
        "--out",
        str(out),
        "--seed",
        "0",
        "--run-timeout-s",
        "90",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=270)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and all(r["ok"] for r in report["requirements"]), report["requirements"]
    assert report["kills"] >= 5 and len(report["per_kill"]) == report["kills"]
    for key in (
        "corrupt_loads",
        "lost_committed_checkpoints",
        "duplicated_samples",
        "skipped_samples",
        "wrong_resumes",
        "failed_runs",
    ):
        assert report[key] == 0, (key, report[key])
    assert report["resumes"] >= report["kills"] - 1  # only a kill before the first commit starts fresh
    assert report["max_abs_param_diff"] is not None and report["max_abs_param_diff"] <= 1e-4
    assert report["max_abs_param_diff_same_world_size"] == 0.0  # bitwise while the world size held
    assert report["world_size_changes"] >= 1
    for k in report["per_kill"]:
        assert k["resume_ok"] and k["phase_hit"] and k["world_size_after"] is not None, k
    # Kills land inside saves, not only between them.
    assert set(report["phases_hit"]) - {"train"}


@pytest.mark.slow  # ~2-3 min here: a reference job and an elastic job with four restarts
@pytest.mark.timeout(600)
def test_chaos_memory_tier_worker_crashes_and_node_losses(tmp_path: pathlib.Path) -> None:
    """--memory: random worker crashes and node losses (agent, workers and memory directory) of
    one elastic job of two nodes, each resumed from memory with at most one step replayed."""
    out = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "tests.chaos", "--memory", "--kills", "4", "--seed", "0", "--out", str(out)]
    cmd += ["--run-timeout-s", "120"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=570)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and all(r["ok"] for r in report["requirements"]), report["requirements"]
    assert len(report["failures"]) == 4 and report["worker_crashes"] >= 1 and report["node_losses"] >= 1
    for f in report["failures"]:
        assert f["tier"] == "memory" and f["steps_replayed"] <= 1 and f["bytes_read_from_root"] == 0, f
    assert report["lost_committed_checkpoints"] == 0 and report["corrupt_checkpoints"] == 0
    assert report["duplicated_samples"] == 0 and report["skipped_samples"] == 0
    assert report["max_abs_loss_diff"] <= 1e-4 and report["max_abs_param_diff"] <= 1e-3
    assert 1 in report["world_sizes"] and 2 in report["world_sizes"]  # the node losses shrank the job
