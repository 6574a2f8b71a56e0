"""Incremental checkpoints across ranks: FSDP2 at 2 ranks (async) references each rank's
unchanged shards; a resume at 1 rank loads them bitwise and, its shard layout being another,
writes those tensors again instead of referring to the 2-rank shards. A SIGKILL of either rank
in the middle of an incremental write leaves the previous checkpoint loadable bitwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distckpt import AsyncSaveConfig, CheckpointConfig, CheckpointManager, SaveConfig, ScheduleConfig
from distckpt._engine import read_dcp_metadata
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import full_params

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        self.head = nn.Linear(32, 32)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


def run(rank, world_size, opts):
    """Resume if possible, then train one step before each of ``opts['saves']``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Frozen()
    fully_shard(model.base)
    fully_shard(model.head)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=0.01)
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=None),
        save=SaveConfig(incremental=True),
        async_save=AsyncSaveConfig(mode=opts.get("async_mode", "off")),
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    state = manager.load()
    # clone: at 1 rank the full state dict shares storage with the parameters trained below
    out = {"loaded": {k: v.clone() for k, v in full_params(model).items()}, "step": state.step if state else None}
    torch.manual_seed(100 + rank)
    for step in opts["saves"]:
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step)
    manager.close()
    out["params"] = full_params(model)
    return out


def refs(path):
    md = read_dcp_metadata(path)
    return {
        (i.fqn, tuple(i.offset)): s.relative_path
        for i, s in md.storage_data.items()
        if s.relative_path.startswith("../")
    }


@pytest.mark.parametrize("async_mode", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_incremental_fsdp2_two_ranks_then_resume_on_one(tmp_path, async_mode):
    root = str(tmp_path)
    two = values(run_ranks(run, 2, {"root": root, "saves": [1, 2], "async_mode": async_mode}))
    base_keys = {
        (f"model.base.{i}.{w}", off)
        for i in range(2)
        for w, offs in (("weight", ((0, 0), (16, 0))), ("bias", ((0,), (16,))))
        for off in offs
    }
    step2 = refs(tmp_path / "step-000000002")
    assert set(step2) == base_keys, step2  # both ranks' frozen shards, nothing else
    assert all(r.startswith("../step-000000001/__") for r in step2.values())

    one = values(run_ranks(run, 1, {"root": root, "saves": [3]}))
    assert one[0]["step"] == 2
    for k, v in two[0]["params"].items():
        assert torch.equal(one[0]["loaded"][k], v), k
    # At 1 rank the shards are whole tensors: another layout, so written again.
    assert not any(fqn.startswith("model.base.") for fqn, _ in refs(tmp_path / "step-000000003"))

    again = values(run_ranks(run, 1, {"root": root, "saves": []}))
    assert again[0]["step"] == 3
    for k, v in one[0]["params"].items():
        assert torch.equal(again[0]["loaded"][k], v), k


def save_then_die_mid_write(rank, world_size, opts):
    """Save step 1; the victim rank is SIGKILLed after writing its data files of the
    incremental save of step 2 (its records and the metadata not written)."""
    import os
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        if rank == opts["victim"] and "step-000000002" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die
    return run(rank, world_size, {**opts, "saves": [1, 2]})


@pytest.mark.parametrize("victim", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_kill_mid_incremental_write_keeps_the_previous_checkpoint(tmp_path, victim):
    root = str(tmp_path)
    results = run_ranks(save_then_die_mid_write, 2, {"root": root, "victim": victim}, expect_death=True)
    assert results[victim] is None
    assert not (tmp_path / "step-000000002").exists()
    expected = values(run_ranks(run, 2, {"root": str(tmp_path / "ref"), "saves": [1]}))[0]["params"]
    again = values(run_ranks(run, 2, {"root": root, "saves": [2]}))  # resumes step 1, saves step 2 again
    assert again[0]["step"] == 1
    for k, v in expected.items():
        assert torch.equal(again[0]["loaded"][k], v), k
    assert refs(tmp_path / "step-000000002")  # the retried save is incremental against step 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pending-")]
