"""The chaos run reaches every save phase through the supported hook (issue 14, item 2).

``launch/train.py`` passes ``CheckpointManager(on_phase=chaos_pause_hook())``; with
``$LAUNCH_CHAOS_PAUSE_S`` set, that hook sleeps before each phase so a SIGKILL can land in the
state the previous phase left. Here two gloo ranks run ``launch.train.train`` for three saves
with ``keep_last=1`` (so retention deletes), with the hook factory wrapped by a recorder: every
phase of ``distckpt._save.transaction.PHASES`` must be reached through the hook, in the transaction's
order, and the hook must have paused in each. If ``train()`` stopped passing the hook, nothing
would be recorded and this test fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

import pytest
import torch

from distckpt._ondisk.layout import checkpoint_name
from distckpt._save.transaction import PHASES
from tests.distributed.harness import run_ranks, values

REPO = pathlib.Path(__file__).resolve().parents[2]
PAUSE_S = 0.01
STEPS, INTERVAL = 6, 2


def _rank(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import launch.train as train_mod
    from launch.config import load_job_config

    os.environ[train_mod.CHAOS_PAUSE_ENV] = str(PAUSE_S)
    os.environ["DISTCKPT_EVENT_LOG"] = os.path.join(tmp, f"events.rank{rank}.jsonl")
    calls: list[tuple[str, int, int, float]] = []
    make_hook = train_mod.chaos_pause_hook

    def recording_factory():  # what train() calls: the real hook, timed
        hook = make_hook()
        if hook is None:
            return None

        def record(phase: str, step: int, r: int) -> None:
            t0 = time.perf_counter()
            hook(phase, step, r)
            calls.append((phase, step, r, time.perf_counter() - t0))

        return record

    train_mod.chaos_pause_hook = recording_factory
    overrides = [
        "model.d_model=32",
        "model.n_layer=1",
        "model.n_head=2",
        "model.seq_len=16",
        "data.seq_len=16",
        "data.global_batch_size=4",
        f"data.max_bytes={20 * 4 * 17}",
        f"train.steps={STEPS}",
        "train.warmup_steps=1",
        "train.log_every=1000",
        f"train.out={tmp}/out",
        f"checkpoint.root={tmp}/ckpt",
        f"checkpoint.schedule.interval_steps={INTERVAL}",
        "checkpoint.retention.keep_last=1",
    ]
    cfg = load_job_config(REPO / "launch" / "configs" / "ddp.yaml", overrides)
    job = train_mod.build_job(cfg, rank, world_size, torch.device("cpu"))
    last = train_mod.train(job)
    return {"last": last, "calls": calls}


def _events(path: pathlib.Path) -> list[tuple[str, int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(e["phase"], e["step"]) for e in lines if e["phase"] in PHASES]


@pytest.mark.timeout(180)
def test_train_reaches_every_phase_through_the_chaos_pause_hook(tmp_path: pathlib.Path) -> None:
    r0, r1 = values(run_ranks(_rank, 2, str(tmp_path), timeout_s=150))
    assert r0["last"] == r1["last"] == STEPS

    # Rank 0 commits: every phase, in order; retention once per deleted checkpoint, with its step.
    expected0 = []
    for step in range(INTERVAL, STEPS + 1, INTERVAL):
        expected0 += [("stage", step), ("write", step), ("manifest", step), ("rename", step), ("latest", step)]
        if step > INTERVAL:  # keep_last=1: the previous checkpoint goes
            expected0.append(("retention", step - INTERVAL))
        expected0.append(("committed", step))
    seen0 = [(p, s) for p, s, _, _ in r0["calls"]]
    assert seen0 == expected0
    assert {p for p, _ in seen0} == set(PHASES)  # the canonical list, retention included
    expected1 = [(p, s) for s in range(INTERVAL, STEPS + 1, INTERVAL) for p in ("stage", "write", "committed")]
    assert [(p, s) for p, s, _, _ in r1["calls"]] == expected1

    # The hook got each call's rank, and paused in every phase.
    assert {r for _, _, r, _ in r0["calls"]} == {0} and {r for _, _, r, _ in r1["calls"]} == {1}
    slept = {}
    for phase, _, _, seconds in r0["calls"] + r1["calls"]:
        slept[phase] = min(seconds, slept.get(phase, seconds))
    assert set(slept) == set(PHASES) and all(s >= PAUSE_S for s in slept.values()), slept

    # The hook and the event log see the same phases (the log is what the chaos killer aims by).
    assert _events(tmp_path / "events.rank0.jsonl") == expected0
    assert _events(tmp_path / "events.rank1.jsonl") == expected1
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [checkpoint_name(STEPS)]
    assert (ckpt / "latest").read_text().strip() == checkpoint_name(STEPS)
