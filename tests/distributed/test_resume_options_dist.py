"""Resume options across ranks: the probe (a collective forward under FSDP2) recorded by 2 ranks
and matched after a load on 1 rank; a model-only load (fresh optimizer) on FSDP2."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
from distckpt._ondisk.manifest import Manifest
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import Points, build, full_params, optimizer_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def probe(model: nn.Module) -> torch.Tensor:
    data = Points(96)
    return nn.functional.mse_loss(model(data.x[:24]), data.y[:24])


def save_with_probe(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
        probe=probe,
        run_id="dist-run",
    )
    it = iter(loader)
    for _ in range(3):
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.save(3, metrics={"val_loss": 0.5})
    manager.close()
    return {"params": full_params(model)}


def load_with_probe(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=None), **opts.get("config", {})),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
        probe=probe,
    )
    state = manager.load()
    manager.close()
    return {
        "state": state,
        "params": full_params(model),
        "optim_state": len(optimizer.state),
        "scheduler_epoch": scheduler.last_epoch,
    }


def test_probe_across_world_sizes_and_model_only_load(tmp_path):
    """FSDP2 on 2 ranks saves (the probe is a collective forward); a plain model on 1 rank loads
    the model only (fresh optimizer and schedule) and its probe matches the recorded one."""
    root = str(tmp_path)
    saved = values(run_ranks(save_with_probe, 2, {"root": root, "wrapper": "fsdp2"}))[0]
    manifest = Manifest.read(tmp_path / "step-000000003")
    assert manifest.probe_loss is not None and manifest.run_id == "dist-run"
    assert manifest.metrics == {"val_loss": 0.5}

    loaded = values(
        run_ranks(load_with_probe, 1, {"root": root, "wrapper": "plain", "config": {"load": {"only": ["model"]}}})
    )[0]
    state = loaded["state"]
    assert loaded["optim_state"] == 0 and loaded["scheduler_epoch"] == 0 and state.step == 0
    assert abs(state.probe_loss_loaded - manifest.probe_loss) <= 1e-6 * abs(manifest.probe_loss)
    for k, v in saved["params"].items():
        assert torch.equal(loaded["params"][k], v), k
