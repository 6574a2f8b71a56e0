"""AsyncWriter: the cyclic GC stays off while a save's DCP work runs and comes back as it was;
process mode refused without torch.distributed."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distckpt._engine import writer as writer_module
from distckpt._engine.async_writer import AsyncWriter
from distckpt._engine.blocking import GC_PAUSE, gc_paused

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _gc_enabled():
    gc.enable()
    yield
    gc.enable()


def test_overlapping_holders_resume_gc_only_after_the_last():
    GC_PAUSE.acquire()  # a background save's write
    with gc_paused():  # a blocking load in the training thread meanwhile
        assert not gc.isenabled()
    assert not gc.isenabled()  # the background write still holds it
    GC_PAUSE.release()
    assert gc.isenabled()


def test_gc_the_user_turned_off_stays_off():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("background_staging", [False, True])
def test_async_write_runs_without_cyclic_gc_and_restores_it(tmp_path, monkeypatch, background_staging):
    seen: list[bool] = []
    release = threading.Event()
    original = writer_module.CheckedFileSystemWriter.write_data

    def write_data(self, plan, planner):
        seen.append(gc.isenabled())
        assert release.wait(30)
        return original(self, plan, planner)

    monkeypatch.setattr(writer_module.CheckedFileSystemWriter, "write_data", write_data)
    aw = AsyncWriter("thread", background_staging=background_staging, process_group=None, thread_count=1)
    state = {"w": torch.arange(1000.0), "step": 3}
    upload = aw.start(state, tmp_path / "ckpt")
    aw.wait_staged()
    assert not gc.isenabled()  # the write has not finished
    release.set()
    upload.result(timeout=30)
    aw.close()
    assert seen == [False] and gc.isenabled()
    loaded = {"w": torch.zeros(1000)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(1000.0))


def test_process_mode_without_torch_distributed_is_a_config_error_at_construction():
    from distckpt._errors import ConfigError

    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="async_save.mode='process' needs torch.distributed initialised"):
        AsyncWriter("process", background_staging=False, process_group=None, thread_count=1)


def test_a_blocking_load_parses_metadata_and_restores_without_cyclic_gc(tmp_path, monkeypatch):
    # Unpickling .metadata and set_state_dict run outside dcp.load; with many tensors their
    # generation-2 collections were a third of a load (docs/benchmarks.md#many-tensors).
    from torch import nn

    from distckpt import CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig
    from distckpt._load import loading
    from distckpt._state.training_state import CheckpointState

    seen: dict[str, bool] = {}
    checked, restore = loading.checked_metadata, CheckpointState.restore

    def checked_metadata(*args, **kwargs):
        seen["metadata"] = gc.isenabled()
        return checked(*args, **kwargs)

    def restore_seen(self, *args, **kwargs):
        seen["restore"] = gc.isenabled()
        return restore(self, *args, **kwargs)

    monkeypatch.setattr(loading, "checked_metadata", checked_metadata)
    monkeypatch.setattr(CheckpointState, "restore", restore_seen)
    model = nn.Linear(4, 3)
    config = CheckpointConfig(
        root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None), retention=RetentionConfig(keep_last=2)
    )
    with CheckpointManager(config, model=model, optimizer=None) as manager:
        manager.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    with CheckpointManager(config, model=model, optimizer=None) as manager:
        assert manager.load() is not None
    assert seen == {"metadata": False, "restore": False} and gc.isenabled()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
