"""DDP with ``broadcast_buffers=True`` (its default) overwrites every rank's buffers with rank 0's at
each forward, so after a step the ranks' BatchNorm statistics differ and rank 0's are the state the
next step uses. A durable save and a memory snapshot must keep rank 0's copy: DCP's and the
memory tier's placement of a replicated tensor would otherwise pick whichever rank balances the
bytes, and the restored run's statistics would leave the uninterrupted run's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import crash

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

STEPS = 3


def _model() -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    # the BatchNorm's statistics are a small item: DCP and the memory tier would place them
    # on rank 1 after the larger weights went to rank 0
    module = nn.Sequential(nn.Linear(4, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 1))
    return DistributedDataParallel(module, broadcast_buffers=True)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.module.state_dict().items() if "running" in k or "batches" in k}


def _job(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    from distckpt import CheckpointConfig, CheckpointManager

    memory = {"enabled": opts["tier"] == "memory", "dir": opts["mem"], "replicas": 0, "interval_steps": 1}
    config = CheckpointConfig(root=opts["root"], schedule={"interval_steps": 1000}, memory=memory)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    if not opts["train"]:
        state = manager.load()
        out = {"step": state.step if state else None, "tier": manager.loader.tier, "buffers": _buffers(model)}
        manager.close()
        return out
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches: its own statistics
    for step in range(1, STEPS + 1):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.maybe_save(step)
    buffers = _buffers(model)
    if opts["tier"] == "memory":
        manager.memory.wait()
        crash(manager)  # the snapshots stay for the restart
    else:
        manager.save(STEPS)
        manager.close()
    return {"buffers": buffers}


@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_a_ddp_resume_restores_rank_0s_broadcast_buffers(tmp_path, tier):
    opts = {"root": str(tmp_path / "root"), "mem": str(tmp_path / "mem"), "tier": tier, "train": True}
    trained = values(run_ranks(_job, 2, opts, timeout_s=150))
    rank0, rank1 = (r["buffers"] for r in trained)
    assert not torch.equal(rank0["1.running_mean"], rank1["1.running_mean"])  # the ranks' statistics differ
    restored = values(run_ranks(_job, 2, dict(opts, train=False), timeout_s=150))
    for r in restored:
        assert r["step"] == STEPS and r["tier"] == tier, r
        for key, value in rank0.items():
            assert torch.equal(r["buffers"][key], value), key
