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
    staging = [p.name for p in root.iterdir() if p.name.startswith(".pending-")]
    assert len(staging) == 1 and "step-000000006" in staging[0]
    assert not (root / "step-000000006").exists()

    loaded = values(run_ranks(load_report, 2, {"root": str(root), "wrapper": "ddp"}))
    assert loaded[0]["state"].step == 3
    expected = torch.load(tmp_path / "expected.pt")
    for k, v in expected.items():
        assert torch.equal(v, loaded[0]["params"][k]), k
    assert not [p for p in root.iterdir() if p.name.startswith(".pending-")]
    assert (root / "latest").read_text().strip() == "step-000000003"


@pytest.mark.parametrize("fast_load", [True, False])
def test_bit_flip_found_while_reading_falls_back_on_every_rank(tmp_path, fast_load):
    from tests.distributed.trainer import save_after

    opts = {"root": str(tmp_path), "wrapper": "fsdp2"}
    expected = values(run_ranks(save_after, 2, dict(opts, steps=3)))[0]["params"]
    values(run_ranks(save_after, 2, dict(opts, steps=6)))
    data = max((tmp_path / "step-000000006").glob("__1_*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: found only by the hash of the bytes read
    data.write_bytes(bytes(raw))
    out = values(run_ranks(load_report, 2, dict(opts, fallback_to_older=True, fast_load=fast_load)))
    assert [r["state"].step for r in out] == [3, 3]  # every rank fell back to the same checkpoint
    for k, v in expected.items():  # full state dict (gathered on rank 0): bitwise
        assert torch.equal(v, out[0]["params"][k]), k
    assert (tmp_path / "corrupt-step-000000006-0").is_dir() and not (tmp_path / "step-000000006").exists()


def load_with_metadata_error_on_rank_0(rank, world_size, opts):
    """``.metadata`` of the newest checkpoint unreadable on rank 0, the one rank that reads it
    for every rank (an I/O error on its node)."""
    import distckpt._load.loading as manager_module  # where the load reads .metadata
    from distckpt._errors import CheckpointCorruptError

    if rank == 0:
        original = manager_module.read_dcp_metadata

        def failing(store, path):
            if "step-000000006" in str(path):
                raise OSError(5, "Input/output error", f"{path}/.metadata")
            return original(store, path)

        manager_module.read_dcp_metadata = failing
    try:
        return {"loaded": load_report(rank, world_size, opts)["state"].step}
    except CheckpointCorruptError as e:
        return {"error": str(e)}


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no-fallback"])
def test_metadata_error_on_one_rank_fails_or_falls_back_on_every_rank(tmp_path, fallback):
    from tests.distributed.trainer import save_after

    opts = {"root": str(tmp_path), "wrapper": "fsdp2", "config": {"coordination": {"timeout_s": 60.0}}}
    values(run_ranks(save_after, 2, dict(opts, steps=3)))
    values(run_ranks(save_after, 2, dict(opts, steps=6)))
    out = values(
        run_ranks(load_with_metadata_error_on_rank_0, 2, dict(opts, fallback_to_older=fallback), timeout_s=50)
    )  # well below the 60 s collective timeout: no rank waits it out
    if fallback:
        assert out == [{"loaded": 3}, {"loaded": 3}]
    else:
        for r in out:
            assert "rank 0" in r["error"] and "Input/output error" in r["error"], r


def save_then_die_mid_background_delete(rank, world_size, opts):
    import distckpt._save.purge as purge_mod

    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 3)
    manager.save(3)
    train_steps(model, optimizer, scheduler, scaler, loader, 3)
    if rank == 0:
        torch.save(full_params(model), opts["expected"])

        def remove_one_file_then_die(path):
            os.remove(min(p for p in path.iterdir() if p.name.endswith(".distcp")))  # part of it gone
            os.kill(os.getpid(), signal.SIGKILL)  # on the purge thread, after save(6) returned

        purge_mod.remove_tree = remove_one_file_then_die
    manager.save(6)  # keep_last=1: step 3 is renamed .deleting-* and its removal queued
    manager.wait()  # rank 0 joins the removal, which kills it
    return "survived"


def test_sigkill_during_background_delete_loses_nothing_and_next_start_cleans_up(tmp_path):
    root = tmp_path / "ckpt"
    opts = {
        "root": str(root),
        "wrapper": "ddp",
        "expected": str(tmp_path / "expected.pt"),
        "config": {"retention": {"keep_last": 1}},
    }
    results = run_ranks(save_then_die_mid_background_delete, 2, opts, expect_death=True)
    assert results[0] is None
    doomed = [p for p in root.iterdir() if p.name.startswith(".deleting-step-000000003-")]
    assert len(doomed) == 1 and [p for p in doomed[0].iterdir() if p.name.endswith(".distcp")]  # mid-removal
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000000006"]
    assert (root / "latest").read_text().strip() == "step-000000006"

    loaded = values(run_ranks(load_report, 2, {"root": str(root), "wrapper": "ddp"}))
    assert [r["state"].step for r in loaded] == [6, 6]
    expected = torch.load(tmp_path / "expected.pt")
    for k, v in expected.items():
        assert torch.equal(v, loaded[0]["params"][k]), k
    assert not [p for p in root.iterdir() if p.name.startswith(".deleting-")]  # removed at the start
