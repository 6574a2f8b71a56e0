"""SIGKILL of one rank while it writes: the next start loads the previous commit bitwise."""

import os
import signal

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import full_params, load_report, make_manager, train_steps

pytestmark = pytest.mark.timeout(240)


def save_then_die_mid_write(rank, world_size, opts):
    from torch.distributed.checkpoint import FileSystemWriter

    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 3)
    manager.save(3)
    if rank == 0:
        torch.save(full_params(model), opts["expected"])
    train_steps(model, optimizer, scheduler, scaler, loader, 3)
    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        if rank == opts["victim"]:
            os.kill(os.getpid(), signal.SIGKILL)  # data files written, nothing finished
        return future

    FileSystemWriter.write_data = write_then_die
    manager.save(6)
    return "survived"


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_during_write_keeps_previous_checkpoint(tmp_path, victim):
    root = tmp_path / "ckpt"
    opts = {"root": str(root), "wrapper": "ddp", "expected": str(tmp_path / "expected.pt"), "victim": victim}
    results = run_ranks(save_then_die_mid_write, 2, opts, expect_death=True)
    assert results[victim] is None
    staging = [p.name for p in root.iterdir() if p.name.startswith(".staging-")]
    assert len(staging) == 1 and "step-000000006" in staging[0]
    assert not (root / "step-000000006").exists()

    loaded = values(run_ranks(load_report, 2, {"root": str(root), "wrapper": "ddp"}))
    assert loaded[0]["state"].step == 3
    expected = torch.load(tmp_path / "expected.pt")
    for k, v in expected.items():
        assert torch.equal(v, loaded[0]["params"][k]), k
    assert not [p for p in root.iterdir() if p.name.startswith(".staging-")]
    assert (root / "latest").read_text().strip() == "step-000000003"
