"""End to end: the resilience demo (launch/demo.py), shortened, on CPU/gloo.

Five torchrun jobs (about 45 s on 2 cores): a clean 2-rank run, a 2-rank run SIGKILLed between
checkpoints, and resumes on 2 ranks, on 4 ranks, from 4 ranks back to 2 and on 4, and on 4 ranks with
the per-rank batch kept (global batch doubled, batch_policy keep_local_batch). The figures come
from the demo's summary.json. The accounting that produces them is checked on its own first.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from distckpt.data import ReshardableSampler
from launch.jobs import Run, kept_history, sample_accounting
from launch.model import GPT, GPTConfig, SampleSeedStream

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS, INTERVAL = 18, 6


def _batches(steps: range, g: int, per_epoch: int, info_len: int) -> dict[int, list[int]]:
    """The ids the sampler hands out at each step (global batch order)."""
    sampler = ReshardableSampler(info_len, global_batch_size=g, rank=0, world_size=1, seed=0)
    out = {}
    for s in steps:
        epoch, k = divmod(s - 1, per_epoch)
        out[s] = sampler.permutation(epoch)[k * g : (k + 1) * g].tolist()
    return out


def test_per_sample_dropout_does_not_depend_on_the_split() -> None:
    """What makes 2 -> 4 ranks comparable: the same samples give the same loss and gradients
    however the global batch is split, and the seed stream resumes from its state."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, dropout=0.2, attn_dropout=0.0))
    model.train()
    idx = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    stream = SampleSeedStream(3)
    state = stream.state_dict()
    seeds = stream.draw(8)

    def loss_and_grads(world_size: int) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        total = 0.0
        for rank in range(world_size):
            b = 8 // world_size
            part = slice(rank * b, (rank + 1) * b)
            _, loss = model(idx[part], idx[part], sample_seeds=seeds[part])
            (loss / world_size).backward()
            total += loss.item() / world_size
        return total, [p.grad.clone() for p in model.parameters()]

    (l1, g1), (l4, g4) = loss_and_grads(1), loss_and_grads(4)
    assert abs(l1 - l4) < 1e-5
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g4))
    torch.manual_seed(123)  # the global RNG plays no part
    assert loss_and_grads(2)[0] == pytest.approx(l1, abs=1e-5)
    _, no_seeds = model(idx, idx)  # ordinary dropout without seeds: a different mask
    assert abs(no_seeds.item() - l1) > 1e-4

    resumed = SampleSeedStream(0)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.draw(8, rank=1, world_size=2), seeds[4:])


def test_sample_accounting_catches_replays_and_gaps(tmp_path: pathlib.Path) -> None:
    info = {"global_batch_size": 4, "steps_per_epoch": 3, "dataset_len": 13, "sampler_seed": 0}
    good = _batches(range(1, 8), 4, 3, 13)  # crosses two epoch boundaries
    assert sample_accounting(good, 7, info) == (0, 0)
    replayed = {**good, 5: good[4]}  # resumed one batch too early: 4 seen twice, 4 never
    assert sample_accounting(replayed, 7, info) == (4, 4)
    gap = {s: ids for s, ids in good.items() if s != 2}
    assert sample_accounting(gap, 7, info) == (0, 4)

    # Kept history: the parent's steps up to the checkpoint, then the child's own.
    parent = Run("p", 2, tmp_path, tmp_path, samples={s: [s] for s in range(1, 6)})
    child = Run(
        "c",
        2,
        tmp_path,
        tmp_path,
        parent=parent,
        samples={s: [100 + s] for s in range(4, 8)},
        events=[{"event": "resumed", "step": 3}],
    )
    assert kept_history(child) == {1: [1], 2: [2], 3: [3], 4: [104], 5: [105], 6: [106], 7: [107]}


@pytest.mark.timeout(360)
def test_demo_kill_and_resume_across_world_sizes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "launch.demo",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--interval",
        str(INTERVAL),
        "--epoch-steps",
        "7",
        "--set",
        "data.seq_len=64",
        "--run-timeout-s",
        "120",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["name"]: r for r in summary["runs"]}
    assert list(rows) == [
        "baseline",
        "killed",
        "resume_2to2",
        "resume_2to4",
        "resume_4to2",
        "resume_4to4",
        "resume_2to4_local",
    ]
    assert all(r["ok"] for r in summary["requirements"])

    base, killed = rows["baseline"], rows["killed"]
    assert base["resumed_from_step"] is None and base["max_abs_loss_diff"] is None
    ckpt = rows["resume_2to2"]["resumed_from_step"]
    assert ckpt == INTERVAL and INTERVAL < killed["last_step"] < 2 * INTERVAL  # between checkpoints
    for name, saved, now in (
        ("resume_2to2", 2, 2),
        ("resume_2to4", 2, 4),
        ("resume_4to2", 4, 2),
        ("resume_4to4", 4, 4),
    ):
        r = rows[name]
        assert (r["saved_world_size"], r["world_size"], r["last_step"]) == (saved, now, STEPS), r
        assert r["steps_replayed"] >= 1 and r["samples_match_baseline"], r
    assert rows["resume_2to4"]["resumed_from_step"] == ckpt
    assert ckpt < rows["resume_4to2"]["resumed_from_step"] < STEPS  # a checkpoint the 4 ranks wrote
    assert rows["resume_2to2"]["max_abs_loss_diff"] == 0.0  # bitwise, same world size
    r44 = rows["resume_4to4"]  # bitwise against the 4-rank run that went on from the same checkpoint
    assert r44["resumed_from_step"] == rows["resume_4to2"]["resumed_from_step"]
    assert r44["compared_with"] == "resume_2to4" and r44["max_abs_loss_diff"] == 0.0
    assert r44["compared_steps"] == STEPS - r44["resumed_from_step"]
    assert rows["resume_2to4"]["max_abs_loss_diff"] <= 1e-4
    assert rows["resume_4to2"]["max_abs_loss_diff"] <= 1e-4
    for r in rows.values():
        assert r["duplicated_samples"] == 0 and r["skipped_samples"] == 0, r
    assert rows["resume_2to2"]["compared_steps"] == STEPS - ckpt
    local = rows["resume_2to4_local"]  # the per-rank batch kept: G 16 -> 32, step kept
    assert (local["saved_world_size"], local["world_size"], local["last_step"]) == (2, 4, STEPS), local
    assert (local["global_batch_before"], local["global_batch_after"]) == (16, 32)
    assert local["resumed_from_step"] == local["step_before"] == local["step_after"] == ckpt
    assert local["max_abs_loss_diff"] is None  # another global batch: losses are not comparable
    assert (local["duplicated_samples"], local["skipped_samples"]) == (0, 0)
