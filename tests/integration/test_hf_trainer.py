"""The Hugging Face Trainer through distckpt (issue 28, item 2), under torchrun on CPU (gloo):
a tiny GPT-2 built from a config, SIGKILLed mid-epoch at step 18 (async saves every 5 steps),
resumed at 2 ranks (bitwise equal to the uninterrupted run: every step's loss on every rank,
the final weights) and at 4 ranks with the same global batch (losses within 1e-4), each sample
exactly once per epoch in both. Four torchrun launches (~20 s each here): slow."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra (pip install 'distckpt[hf]')")
pytest.importorskip("accelerate", reason="needs the hf extra (pip install 'distckpt[hf]')")

from launch.hf_job import N_SAMPLES, duplicates_and_skips, global_loss, run_job, sample_order, trajectory  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = ["--max-steps", "30", "--save-steps", "5", "--async-save"]


def test_kill_mid_epoch_then_resume_bitwise_at_2_and_within_1e4_at_4(tmp_path):
    ref, killed, at4 = tmp_path / "ref", tmp_path / "killed", tmp_path / "at4"
    assert run_job(ref, 2, *STEPS)[0] == 0
    rc, _ = run_job(killed, 2, *STEPS, "--kill-at-step", "18")
    assert rc != 0 and not (killed / "final.pt").exists()  # killed mid-epoch 1 (12 steps an epoch)
    committed = sorted(p.name for p in (killed / "ckpt" / "distckpt").glob("step-*"))
    assert committed and committed[-1] in ("step-000000010", "step-000000015")
    shutil.copytree(killed, at4)
    assert run_job(killed, 2, *STEPS)[0] == 0
    assert run_job(at4, 4, *STEPS, "--per-device", "2")[0] == 0  # global batch 8 kept

    expected = trajectory(ref)
    assert sorted(expected) == list(range(1, 31))
    same = trajectory(killed)
    assert same.keys() == expected.keys()
    for step in expected:  # bitwise: every rank's loss of every step
        assert [same[step][r]["loss"] for r in (0, 1)] == [expected[step][r]["loss"] for r in (0, 1)], step
    final_ref, final_same = torch.load(ref / "final.pt"), torch.load(killed / "final.pt")
    assert all(torch.equal(final_ref[k], final_same[k]) for k in final_ref)

    four = trajectory(at4)
    assert four.keys() == expected.keys()
    assert {len(four[s]) for s in four if s > 15} == {4}  # resumed on 4 ranks
    worst = max(abs(global_loss(four[s]) - global_loss(expected[s])) for s in expected)
    assert worst < 1e-4, worst
    final_four = torch.load(at4 / "final.pt")
    assert max((final_ref[k] - final_four[k]).abs().max().item() for k in final_ref) < 1e-4

    for traj in (expected, same, four):  # each sample once per epoch, the same global order
        order = sample_order(traj)
        assert len(order) == 30 * 8 and duplicates_and_skips(order) == (0, 0)
        assert order == sample_order(expected)
        assert sorted(order[:N_SAMPLES]) == list(range(N_SAMPLES))
