"""batch_policy keep_local_batch end to end through CheckpointManager (issue 16 item 1):
2 ranks (G = 8) -> 4 ranks (G = 16, step_rule rescale) -> 2 ranks (G = 8, step_rule keep), the
per-rank batch kept at 4. Sample ids of every step across the three jobs: each sample of an
epoch exactly once, from a position (24 samples) that is not a multiple of the new G."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from distckpt import CheckpointConfig, CheckpointManager, IncompatibleCheckpointError, ScheduleConfig
from distckpt._ondisk.manifest import Manifest
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import build, optimizer_step, release_workers

pytestmark = pytest.mark.timeout(120)

N = 96  # trainer.Points(): 96 samples


def _lr(step: int) -> float:
    """trainer.build's LambdaLR at ``last_epoch = step`` (base lr 0.05)."""
    return 0.05 * min(1.0, (step + 1) / 4) * 0.5 * (1 + math.cos(math.pi * min(step, 40) / 40))


def job(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Resume (if a checkpoint exists), train ``opts['steps']`` steps at global batch ``opts['g']``,
    saving after the steps in ``opts['save_at']``; return what the load did and the ids per step."""
    refused = None
    if opts.get("refuse_first"):  # the default policy (keep_global_batch) must refuse the new G
        model, optimizer, scheduler, scaler, loader = build(rank, world_size, {"global_batch_size": opts["g"]})
        with CheckpointManager(
            CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=None)),
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            grad_scaler=scaler,
            dataloader=loader,
        ) as manager:
            try:
                manager.load()
            except IncompatibleCheckpointError as e:
                refused = str(e)
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, {"global_batch_size": opts["g"]})
    config = CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=None), **opts.get("config", {}))
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    state = manager.load()
    out: dict[str, Any] = {
        "step": state.step if state else 0,
        "batch_change": state.batch_change if state else None,
        "sched_lr": scheduler.get_last_lr()[0],
        "optim_lr": optimizer.param_groups[0]["lr"],
        "last_epoch": scheduler.last_epoch,
        "ids": [],
        "refused": refused,
    }
    step, done = out["step"], 0
    while done < opts["steps"]:
        for batch in loader:
            optimizer_step(model, optimizer, scheduler, scaler, batch)
            step, done = step + 1, done + 1
            out["ids"].append(batch["id"].tolist())
            if step in opts.get("save_at", ()):
                manager.save(step)
            if done == opts["steps"]:
                break
    manager.close()
    release_workers(loader)
    return out


def _global(results: list[dict[str, Any]]) -> list[list[int]]:
    """Global batch of each step: the ranks' slices in rank order."""
    return [[i for r in results for i in r["ids"][k]] for k in range(len(results[0]["ids"]))]


def _perm(epoch: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed((7 * 1_000_003 + epoch) % 2**63)  # trainer.build's sampler seed is 7
    return torch.randperm(N, generator=g).tolist()


def _epochs(batches: list[list[int]]) -> dict[int, list[int]]:
    """Ids per epoch, in order: a batch that no longer fits in the epoch opens the next one."""
    per: dict[int, list[int]] = {}
    epoch = pos = 0
    for ids in batches:
        if pos + len(ids) > N:
            epoch, pos = epoch + 1, 0
        per.setdefault(epoch, []).extend(ids)
        pos += len(ids)
    return per


def test_keep_local_batch_2_to_4_rescale_then_4_to_2_keep(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    local = {"batch_policy": "keep_local_batch"}
    # A: 2 ranks x 4, 3 steps (24 samples), saved at step 3.
    a = values(run_ranks(job, 2, {"root": root, "g": 8, "steps": 3, "save_at": [3]}, timeout_s=60))
    # B: 4 ranks x 4 (G = 16), rescale: step = 24 // 16 = 1. 6 steps: the rest of epoch 0 at
    # sample 24 (4 batches of 16, 8 left as its tail) and 2 of epoch 1; saved at step 3 (56 samples).
    b = values(
        run_ranks(
            job,
            4,
            {
                "root": root,
                "g": 16,
                "steps": 6,
                "save_at": [3],
                "refuse_first": True,
                "config": {"elastic": {**local, "step_rule": "rescale"}},
            },
            timeout_s=60,
        )
    )
    # C: back to 2 ranks x 4 (G = 8) from B's step 3, step_rule keep; 6 steps: 5 end epoch 0.
    c = values(
        run_ranks(
            job,
            2,
            {"root": root, "g": 8, "steps": 6, "save_at": [9], "config": {"elastic": {**local, "step_rule": "keep"}}},
            timeout_s=60,
        )
    )

    ga, gb, gc = _global(a), _global(b), _global(c)
    assert [len(x) for x in ga + gb + gc] == [8] * 3 + [16] * 6 + [8] * 6  # whole global batches
    # Every sample of each epoch exactly once, in the documented order, across the resumes.
    for history in (ga + gb, ga + gb[:2] + gc):
        per = _epochs(history)
        for epoch, ids in per.items():
            assert ids == _perm(epoch)[: len(ids)], epoch  # no sample repeated or skipped
    assert len(_epochs(ga + gb)[0]) == 24 + 4 * 16 == N - 8  # the < G tail: the epoch's, as always
    assert len(_epochs(ga + gb[:2] + gc)[0]) == N  # 56 + 5 * 8 reach the end exactly

    # The default batch_policy refused the changed G with a typed error saying what to do.
    for r in b:
        assert "global batch 8" in r["refused"] and "global batch 16" in r["refused"]
        assert "batch_policy: keep_local_batch" in r["refused"]
    # Step rule rescale: step and LR scheduler as an uninterrupted run at G = 16 after 1 step.
    for r in b:
        assert r["step"] == 1 and r["last_epoch"] == 1
        assert r["sched_lr"] == pytest.approx(_lr(1), rel=1e-12)
        assert r["optim_lr"] == pytest.approx(_lr(1), rel=1e-12)
        assert r["batch_change"] == {
            "batch_policy": "keep_local_batch",
            "step_rule": "rescale",
            "global_batch_before": 8,
            "global_batch_after": 16,
            "world_size_before": 2,
            "world_size_after": 4,
            "step_before": 3,
            "step_after": 1,
            "global_samples_seen": 24,
        }
    # Step rule keep: step and scheduler as saved (B's step 3).
    for r in c:
        assert r["step"] == 3 and r["last_epoch"] == 3 and r["sched_lr"] == pytest.approx(_lr(3), rel=1e-12)
        assert r["batch_change"]["step_before"] == r["batch_change"]["step_after"] == 3
        assert r["batch_change"]["global_samples_seen"] == 56
    # A's step 3, above B's rescaled step 1, was set aside at B's first commit (kept, not deleted).
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith(("step-", "rolledback"))) == [
        "rolledback-step-000000003-0",
        "step-000000003",
        "step-000000009",
    ]
    # The manifest of the next save says what the resume did.
    assert Manifest.read(Path(root) / "step-000000009").batch_change == c[0]["batch_change"]
    assert Manifest.read(Path(root) / "step-000000003").batch_change["step_after"] == 1
    assert Manifest.read(Path(root) / "step-000000003").global_samples_seen == 56
    assert Manifest.read(Path(root) / "step-000000009").global_samples_seen == 56 + 6 * 8
