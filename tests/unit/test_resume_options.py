"""Resume options (issue 16 items 2-6), in one process: the loss probe, best-K retention,
``load_step``, ``load_only``/``exclude_from_loading``, the scheduler-without-optimizer refusal
and the run id. Release export is in ``test_release.py``."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    IncompatibleCheckpointError,
    LoadConfig,
    RetentionConfig,
    ScheduleConfig,
)
from distckpt._cli import main
from distckpt._config import KeepBest
from distckpt._ondisk.manifest import Manifest
from distckpt._save.retention import best_steps, steps_to_delete
from tests.distributed.trainer import Net, Points, build, optimizer_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROBE_DATA = Points(96)


def hostile_probe(model):
    """A fixed-batch probe that also draws from every RNG and checks how it is called."""
    assert not model.training and not torch.is_grad_enabled()
    torch.rand(3), random.random(), np.random.rand()
    return nn.functional.mse_loss(model(PROBE_DATA.x[:32]), PROBE_DATA.y[:32])


def run(root, *, until, probe=None, interval=2, prepare=None, **config):
    """The tiny trainer (dropout, AdamW, LambdaLR, GradScaler, StatefulDataLoader) resumed from
    ``root`` when it holds a checkpoint, trained to ``until`` (``prepare(model)`` first, when given).
    Returns (losses, params, state, manager)."""
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    if prepare is not None:
        prepare(model)
    manager = CheckpointManager(
        CheckpointConfig(
            root=str(root),
            schedule=ScheduleConfig(interval_steps=interval),
            retention=RetentionConfig(keep_last=None),
            **config,
        ),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
        probe=probe,
    )
    state = manager.load()
    step, losses = (state.step if state else 0), {}
    model.train()
    while step < until:
        for batch in loader:
            step += 1
            losses[step] = optimizer_step(model, optimizer, scheduler, scaler, batch).item()
            manager.maybe_save(step, loss=losses[step])
            if step == until:
                break
    manager.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, state, manager


# ----------------------------------------------------------------------------- probe
def test_probe_never_changes_the_trajectory(tmp_path):
    """Saves every 2 steps with a probe that draws from every RNG, then a resume with the probe:
    every loss and parameter bitwise equal to the same runs without a probe."""
    plain, plain_params, _, _ = run(tmp_path / "a", until=6)
    probed, probed_params, _, _ = run(tmp_path / "b", until=6, probe=hostile_probe)
    assert probed == plain
    resumed_plain, params_a, _, _ = run(tmp_path / "a", until=10, load=LoadConfig(step=4))
    resumed_probed, params_b, state, _ = run(tmp_path / "b", until=10, probe=hostile_probe, load=LoadConfig(step=4))
    assert state.probe_loss_loaded is not None
    assert resumed_probed == resumed_plain and len(resumed_plain) == 6
    for k in plain_params:
        assert torch.equal(probed_params[k], plain_params[k]) and torch.equal(params_a[k], params_b[k]), k


def test_probe_restores_module_modes():
    model = Net()
    model.train()
    model.drop.eval()  # a submodule the user keeps in eval mode stays so
    from distckpt._load.probe import run_probe

    run_probe(hostile_probe, model)
    assert model.training and model.inp.training and not model.drop.training


def test_probe_match_after_load_recorded_in_manifest(tmp_path, caplog):
    run(tmp_path, until=4, probe=hostile_probe)
    manifest = Manifest.read(tmp_path / "step-000000004")
    assert manifest.probe_loss is not None and manifest.probe_loss > 0
    with caplog.at_level(logging.INFO, logger="distckpt"):
        _, _, state, _ = run(tmp_path, until=4, probe=hostile_probe)
    assert state.probe_loss == manifest.probe_loss
    assert state.probe_loss_loaded == manifest.probe_loss  # same process, same weights: bitwise
    assert "probe loss after loading" in caplog.text and "restored" in caplog.text


def shifted_probe(model):
    """Depends on ``model.shift``, a non-persistent buffer: never in a checkpoint."""
    return hostile_probe(model) + model.shift.sum()


def with_shift(value):
    def prepare(model):
        model.register_buffer("shift", torch.full((1,), value), persistent=False)

    return prepare


@pytest.mark.parametrize("on_mismatch", ["raise", "warn"])
def test_probe_mismatch_on_a_wrong_restore(tmp_path, on_mismatch, caplog):
    """The probe depends on a non-persistent buffer the run had changed (0.5), which a restart
    does not restore (0.0): the probe says so with both values."""
    run(tmp_path, until=4, probe=shifted_probe, prepare=with_shift(0.5))
    saved = Manifest.read(tmp_path / "step-000000004").probe_loss
    kw = {"load": LoadConfig(probe_on_mismatch=on_mismatch)}
    if on_mismatch == "raise":
        with pytest.raises(IncompatibleCheckpointError, match="probe loss after loading") as err:
            run(tmp_path, until=4, probe=shifted_probe, prepare=with_shift(0.0), **kw)
        assert f"at save {saved:.6g}" in str(err.value) and "probe_tolerance 0.01" in str(err.value)
    else:
        with caplog.at_level(logging.WARNING, logger="distckpt"):
            _, _, state, _ = run(tmp_path, until=4, probe=shifted_probe, prepare=with_shift(0.0), **kw)
        assert state.probe_loss_loaded != saved and f"at save {saved:.6g}" in caplog.text
        assert f"{state.probe_loss_loaded:.6g}" in caplog.text and "set probe_on_mismatch" not in caplog.text


def test_probe_not_compared_when_the_model_is_not_loaded(tmp_path, caplog):
    """exclude_from_loading: [model] keeps fresh weights on purpose: no mismatch is raised."""
    run(tmp_path, until=4, probe=hostile_probe)
    with caplog.at_level(logging.INFO, logger="distckpt"):
        _, _, state, _ = run(tmp_path, until=4, probe=hostile_probe, load=LoadConfig(exclude=["model"]))
    assert state.probe_loss_loaded is not None and "the model was not loaded" in caplog.text


def test_probe_tolerance_validated():
    for bad in (0, -1, float("nan")):
        with pytest.raises(ConfigError, match="probe_tolerance"):
            CheckpointConfig(root="r", load=LoadConfig(probe_tolerance=bad))
    with pytest.raises(ConfigError, match="probe_on_mismatch"):
        CheckpointConfig(root="r", load=LoadConfig(probe_on_mismatch="ignore"))


# ----------------------------------------------------------------------------- best-K
def test_best_steps_ties_and_missing_metric():
    metrics = {
        1: {"val_loss": 0.5},
        2: {"val_loss": 0.3},
        3: {"val_loss": 0.2},
        4: {"val_loss": 0.3},
        5: {},
        6: {"val_loss": float("nan")},
        7: {"acc": 0.1},
    }
    assert best_steps(metrics, KeepBest(metric="val_loss", mode="min", k=2)) == [3, 2]  # 2 beats 4: earlier
    assert best_steps(metrics, KeepBest(metric="val_loss", mode="max", k=2)) == [1, 2]
    assert best_steps(metrics, KeepBest(metric="val_loss", k=10)) == [3, 2, 4, 1]  # 5, 6, 7 never count
    assert steps_to_delete([1, 2, 3, 4, 5], keep_last=1, keep_every_steps=None, also_keep=[3, 2]) == [1, 4]


def test_keep_best_with_keep_last_through_the_manager_and_ls(tmp_path, capsys):
    cfg = CheckpointConfig(
        root=str(tmp_path),
        schedule=ScheduleConfig(interval_steps=1),
        retention=RetentionConfig(keep_last=1, keep_best={"metric": "val_loss", "mode": "min", "k": 2}),
    )
    assert cfg.retention.keep_best == KeepBest(metric="val_loss", mode="min", k=2)
    manager = CheckpointManager(cfg, model=Net(), optimizer=None)
    for step, value in {1: 0.5, 2: 0.3, 3: 0.2, 4: 0.3, 5: None, 6: 0.01}.items():
        assert manager.maybe_save(step, metrics=None if value is None else {"val_loss": value})
        if step == 6:
            break
    manager.save(7)  # without metrics: newest (keep_last), never best
    manager.close()
    # best 2 by min val_loss: step 6 (0.01), step 3 (0.2); the tie 0.3 of steps 2 and 4 would go to step 2
    kept = sorted(p.name for p in tmp_path.glob("step-*"))
    assert kept == ["step-000000003", "step-000000006", "step-000000007"]
    assert Manifest.read(tmp_path / "step-000000003").metrics == {"val_loss": 0.2}
    assert Manifest.read(tmp_path / "step-000000007").metrics == {}
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "METRICS" in out and "val_loss=0.2" in out and "val_loss=0.01" in out


def test_keep_best_k2_tie_and_keep_last_2(tmp_path):
    manager = CheckpointManager(
        CheckpointConfig(
            root=str(tmp_path),
            schedule=ScheduleConfig(interval_steps=None),
            retention=RetentionConfig(keep_last=2, keep_best={"metric": "val_loss", "k": 2}),
        ),
        model=Net(),
        optimizer=None,
    )
    for step, value in {1: 0.5, 2: 0.3, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.9}.items():
        manager.save(step, metrics={"val_loss": value})
    manager.close()
    # best: 3 (0.2) and 2 (0.3, earlier than 4); last 2: 5, 6
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step-*")) == [2, 3, 5, 6]


def test_keep_best_tie_earlier_step_wins_in_the_root(tmp_path):
    manager = CheckpointManager(
        CheckpointConfig(
            root=str(tmp_path),
            schedule=ScheduleConfig(interval_steps=None),
            retention=RetentionConfig(keep_last=1, keep_best={"metric": "acc", "mode": "max", "k": 1}),
        ),
        model=Net(),
        optimizer=None,
    )
    for step, acc in ((1, 0.7), (2, 0.9), (3, 0.9), (4, 0.1)):
        manager.save(step, metrics={"acc": acc})
    manager.close()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000002", "step-000000004"]


def test_keep_best_validated():
    for bad in (
        {"mode": "min"},
        {"metric": "x", "mode": "lowest"},
        {"metric": "x", "k": 0},
        {"metric": "x", "top": 2},
        "val_loss",
    ):
        with pytest.raises(ConfigError, match="keep_best"):
            CheckpointConfig(root="r", retention=RetentionConfig(keep_best=bad))


def test_metric_values_must_be_numbers(tmp_path):
    manager = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)), model=Net(), optimizer=None
    )
    with pytest.raises(TypeError, match="metrics must map names to numbers"):
        manager.maybe_save(1, metrics={"val_loss": "low"})
    manager.save(1, metrics={"val_loss": torch.tensor(0.5).item(), "acc": np.float32(0.25)})
    manager.close()
    assert Manifest.read(tmp_path / "step-000000001").metrics == {"val_loss": 0.5, "acc": 0.25}


# ----------------------------------------------------------------------------- selective load
def test_load_step_loads_that_step(tmp_path, caplog):
    _, _, _, _ = run(tmp_path, until=6)
    _, expected, _, _ = run(tmp_path / "ref", until=4)
    with caplog.at_level(logging.INFO, logger="distckpt"):
        _, params, state, _ = run(tmp_path, until=4, load=LoadConfig(step=4))
    assert state.step == 4 and state.checkpoint_path.endswith("step-000000004")
    assert all(torch.equal(params[k], expected[k]) for k in expected)
    assert "load.step=4: loading" in caplog.text and "newest is step 6" in caplog.text
    with pytest.raises(CheckpointNotFoundError, match=r"load.step=5: no step-000000005 .*steps \[2, 4, 6\]"):
        run(tmp_path, until=5, load=LoadConfig(step=5))
    with pytest.raises(ConfigError, match="load.step needs load.enabled: true and no load.path"):
        CheckpointConfig(root=str(tmp_path), load=LoadConfig(step=4, path=str(tmp_path / "step-000000004")))
    with pytest.raises(ConfigError, match="load.step"):
        CheckpointConfig(root=str(tmp_path), load=LoadConfig(step=-1))


def test_load_only_model_fine_tunes_with_fresh_optimizer(tmp_path, caplog):
    _, trained, _, _ = run(tmp_path / "pre", until=4)
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    manager = CheckpointManager(
        CheckpointConfig(
            root=str(tmp_path / "ft"),
            load=LoadConfig(path=str(tmp_path / "pre" / "step-000000004"), only=["model"]),
            schedule=ScheduleConfig(interval_steps=None),
        ),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
    )
    with caplog.at_level(logging.INFO, logger="distckpt"):
        state = manager.load()
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    assert optimizer.state == {} and scheduler.last_epoch == 0 and scaler.get_scale() == 2.0**8
    assert state.step == 0 and state.loss_history == []  # counters not loaded: a new run
    assert (
        "selective load (load.only=['model']): loading model; not loading (live state kept): optimizer, "
        "lr_scheduler, grad_scaler, dataloader, rng, counters, extra_state"
    ) in caplog.text
    batch = next(iter(loader))  # the data position is fresh too: the first batch of epoch 0
    optimizer_step(model, optimizer, scheduler, scaler, batch)
    manager.save(1)
    manager.close()


def test_load_only_model_from_a_checkpoint_without_optimizer(tmp_path):
    trained = Net()
    CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)),
        model=trained,
        optimizer=None,
    ).save(3)
    model, optimizer, *_ = build(0, 1, {})
    manager = CheckpointManager(
        CheckpointConfig(
            root=str(tmp_path), load=LoadConfig(only=["model"]), schedule=ScheduleConfig(interval_steps=None)
        ),
        model=model,
        optimizer=optimizer,
    )
    manager.load()  # without load_only: IncompatibleCheckpointError (missing optim)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict().items())
    manager.close()


def test_exclude_optimizer_and_scheduler_keeps_them_fresh(tmp_path):
    _, trained, _, _ = run(tmp_path, until=4)
    _, _, state, manager = run(tmp_path, until=4, load=LoadConfig(exclude=["optimizer", "lr_scheduler"]))
    assert state.step == 4  # counters, model, data and RNG loaded
    assert manager.state.model_optim.optimizer.state == {} and manager.state.lr_scheduler.last_epoch == 0


@pytest.mark.parametrize("kw", [{"only": ["model", "lr_scheduler"]}, {"exclude": ["optimizer"]}])
def test_scheduler_without_optimizer_refused(kw):
    with pytest.raises(ConfigError, match="lr_scheduler without its optimizer"):
        CheckpointConfig(root="r", load=kw)


def test_load_selection_validated():
    with pytest.raises(ConfigError, match=r"unknown part\(s\) \['weights'\]"):
        CheckpointConfig(root="r", load=LoadConfig(only=["weights"]))
    with pytest.raises(ConfigError, match="not both"):
        CheckpointConfig(root="r", load=LoadConfig(only=["model"], exclude=["rng"]))
    with pytest.raises(ConfigError, match="expected a list"):
        CheckpointConfig(root="r", load=LoadConfig(only="model"))


# ----------------------------------------------------------------------------- run id
def test_run_id_round_trip(tmp_path):
    first = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)), model=Net(), optimizer=None
    )
    run_id = first.train_state.run_id
    assert isinstance(run_id, str) and len(run_id) == 16
    first.save(1)
    first.close()
    assert json.loads((tmp_path / "step-000000001" / "distckpt.json").read_text())["run_id"] == run_id

    resumed = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)), model=Net(), optimizer=None
    )
    assert resumed.train_state.run_id != run_id  # a new id until the load...
    assert resumed.load().run_id == run_id  # ...which returns the checkpoint's
    resumed.save(2)
    resumed.close()
    assert Manifest.read(tmp_path / "step-000000002").run_id == run_id

    passed = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)),
        model=Net(),
        optimizer=None,
        run_id="wandb-1x2y3z",
    )
    assert passed.load().run_id == "wandb-1x2y3z"  # the caller's wins
    passed.save(3)
    passed.close()
    assert Manifest.read(tmp_path / "step-000000003").run_id == "wandb-1x2y3z"
