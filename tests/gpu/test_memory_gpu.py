"""The memory tier with CUDA-resident state (issue 34, item 2): the snapshot's copy of parameters and
optimizer state runs on a side stream of the background thread, after the step's kernels, while the
next step computes; optimizer.step() waits for it; a restore from memory is bitwise."""

from __future__ import annotations

import copy

import torch

from distckpt import CheckpointConfig, CheckpointManager


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _step(model, optimizer, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 256, device="cuda", generator=g)
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_a_cuda_snapshot_holds_its_steps_state_and_restores_bitwise(tmp_path):
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0}
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    model, optimizer = _build()
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    for step in (1, 2, 3):
        _step(model, optimizer, step)
        manager.maybe_save(step)
    expected = copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})
    _step(model, optimizer, 4)  # queued right behind the snapshot: must not reach it
    manager.memory.wait()

    model2, optimizer2 = _build(seed=1)
    restarted = CheckpointManager(config, model=model2, optimizer=optimizer2)
    state = restarted.load()
    assert state is not None and state.step == 3 and restarted.loader.tier == "memory"
    for k, v in model2.state_dict().items():
        assert torch.equal(v.cpu(), expected[k]), k
    restarted.close()
    manager.close()
