"""Elastic torchrun jobs on CPU/gloo: SIGTERM with DataLoader workers, scale-up and scale-down
through two real torchrun agents acting as two nodes (launch/elastic_demo.py)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from launch.demo import Run, committed_steps, kept_history, kill_job, launch, load_records, start_train

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "launch" / "configs" / "ddp.yaml")
SMALL = ["model.n_layer=2", "model.d_model=64", "data.seq_len=64", "train.log_every=5",
         "data.max_bytes=" + str(12 * 16 * 65)]  # 12 steps per epoch: the runs cross epochs


@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_with_dataloader_workers_saves_and_resumes_exactly(tmp_path: pathlib.Path) -> None:
    """SIGTERM to the torchrun agent reaches each worker's process group, DataLoader workers
    included: they must outlive it so the preemption save commits; the resume is exact."""
    steps = 30
    overrides = [*SMALL, f"train.steps={steps}", "train.warmup_steps=3", "checkpoint.interval_steps=100",
                 "data.num_workers=2"]
    base = Run("base", 2, tmp_path / "base", tmp_path / "base" / "ckpt")
    launch(base, CONFIG, overrides, timeout_s=120)
    assert base.returncode == 0, (base.out / "torchrun.log").read_text()[-3000:]

    pre = Run("pre", 2, tmp_path / "pre", tmp_path / "ckpt")
    proc = start_train(pre, ["--config", CONFIG, *overrides])
    t0 = time.monotonic()
    try:
        while not (pre.out / "metrics.jsonl").exists() or len((pre.out / "metrics.jsonl").read_text().splitlines()) < 8:
            assert proc.poll() is None and time.monotonic() - t0 < 120, (pre.out / "torchrun.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)  # the agent forwards it to each worker's process group
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    load_records(pre)
    log = (pre.out / "torchrun.log").read_text()
    assert "killed by signal" not in log, log[-3000:]
    stopped = pre.event("preempted")
    assert stopped is not None and pre.event("end") is not None, log[-3000:]  # workers ended normally
    p = stopped["step"]
    assert 8 <= p < steps and p == pre.last_step
    assert committed_steps(pre.ckpt_root) == [p]  # committed on SIGTERM (no interval save before)

    res = Run("res", 2, tmp_path / "res", tmp_path / "ckpt", parent=pre)
    launch(res, CONFIG, overrides, timeout_s=120)
    assert res.returncode == 0, (res.out / "torchrun.log").read_text()[-3000:]
    assert res.resumed_from == p and res.last_step == steps
    for s in range(p + 1, steps + 1):
        assert res.metrics[s]["loss"] == base.metrics[s]["loss"], s  # bitwise: same world size
    history = kept_history(res)
    assert [history[s] for s in range(1, steps + 1)] == [base.samples[s] for s in range(1, steps + 1)]
