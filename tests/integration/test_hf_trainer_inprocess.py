"""DistckptTrainer in one process (issue 28, item 2; the torchrun kill tests are in
test_hf_trainer.py): a run stopped at step 10 (mid-epoch) and resumed by a new Trainer to step 18
(past the epoch end at 12) equals the uninterrupted run bitwise (losses, sample order, weights);
the Trainer's own checkpoint files are not written; unsupported settings are refused; an error
inside training releases the root. Here rather than in tests/unit: about 30 s with transformers'
import, too slow for `make test-fast`."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra (pip install 'distckpt[hf]')")
pytest.importorskip("accelerate", reason="needs the hf extra (pip install 'distckpt[hf]')")

from transformers import TrainingArguments  # noqa: E402

from distckpt import CheckpointConfig, ConfigError, ScheduleConfig  # noqa: E402
from distckpt.integrations.hf import DistckptTrainer  # noqa: E402
from launch.hf_job import N_SAMPLES, TokenDataset, build_model, collate, trainer_class  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore")]


def _trainer(tmp_path, name: str, max_steps: int, **overrides):
    args = dict(
        output_dir=str(tmp_path / name),
        use_cpu=True,
        per_device_train_batch_size=8,  # 12 steps an epoch
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=5,
        logging_steps=5,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        seed=7,
        report_to=[],
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    args.update(overrides)
    config = CheckpointConfig(root=str(tmp_path / name / "distckpt"), schedule=ScheduleConfig(interval_steps=None))
    trainer = trainer_class(DistckptTrainer)(
        model=build_model(),
        args=TrainingArguments(**args),
        train_dataset=TokenDataset(),
        data_collator=collate,
        checkpoint_config=config,
    )
    trainer._kill_at, trainer._first_step_at = None, None
    trainer._records = tmp_path / f"{name}.jsonl"
    return trainer


def _records(path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_stopped_mid_epoch_and_resumed_by_a_new_trainer_equals_the_uninterrupted_run(tmp_path):
    ref = _trainer(tmp_path, "ref", 18)
    ref.train()
    first = _trainer(tmp_path, "run", 10)  # stops at step 10 of the 12-step epoch 0, saved there
    first.train()
    assert first.resumed_from is None
    assert sorted(p.name for p in (tmp_path / "run" / "distckpt").glob("step-*")) == [
        "step-000000005",
        "step-000000010",
    ]
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # no Trainer checkpoint directories
    second = _trainer(tmp_path, "run", 18)
    second.train()
    assert second.resumed_from is not None and second.resumed_from.step == 10
    assert second.state.global_step == 18 and second.state.epoch == pytest.approx(1.5)
    assert [h["step"] for h in second.state.log_history if "loss" in h] == [5, 10, 15]  # history kept
    expected, got = _records(tmp_path / "ref.jsonl"), _records(tmp_path / "run.jsonl")
    steps = list(range(1, 19))
    assert sorted(got) == sorted(expected) == steps
    assert [got[s]["loss"] for s in steps] == [expected[s]["loss"] for s in steps]
    order = [i for s in steps for i in got[s]["ids"]]
    assert order == [i for s in steps for i in expected[s]["ids"]]
    assert sorted(order[:N_SAMPLES]) == list(range(N_SAMPLES))  # epoch 0: each sample once
    a, b = ref.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_settings_and_a_fresh_start_on_a_used_root_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2"):
        _trainer(tmp_path, "accum", 4, gradient_accumulation_steps=2).train()
    _trainer(tmp_path, "used", 5).train()
    with pytest.raises(ConfigError, match="holds"):
        _trainer(tmp_path, "used", 10).train(resume_from_checkpoint=False)


def test_an_error_inside_training_releases_the_root_for_the_next_trainer(tmp_path):
    broken = _trainer(tmp_path, "err", 8)
    train_step = broken.compute_loss

    def fail_at_step_7(model, inputs, *args, **kwargs):
        if broken.state.global_step == 6:
            raise KeyError("a bad batch")
        return train_step(model, inputs, *args, **kwargs)

    broken.compute_loss = fail_at_step_7
    with pytest.raises(KeyError, match="a bad batch"):
        broken.train()
    assert broken.checkpoint_manager is None
    assert not (tmp_path / "err" / "distckpt" / ".lock").exists()  # released, not left to its lease
    again = _trainer(tmp_path, "err", 8)  # same process, same root: the lock was released
    again.train()
    assert again.resumed_from is not None and again.resumed_from.step == 5 and again.state.global_step == 8
