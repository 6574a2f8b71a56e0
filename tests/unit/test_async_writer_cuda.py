"""AsyncWriter's CUDA staging order, checked on CPU with CUDA calls recorded (issue 18 item 4).

On a GPU (``tests/gpu/test_async_gpu.py``) a background-staged copy must not read parameters
that queued kernels are still writing, and the stager's stream and final sync must be on the
state's device. Here ``torch.cuda`` and DCP are replaced by recorders, and the state holds a
fake ``cuda:1`` tensor, so the order of calls is asserted without a GPU.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from distckpt._engine import async_writer
from distckpt._engine.async_writer import AsyncWriter, cuda_device_of

pytestmark = pytest.mark.timeout(60)


def _fake_cuda_state() -> dict:
    with FakeTensorMode():
        weight = torch.empty(4, device="cuda:1")
    return {"model": {"w": weight}, "optim": {"state": {"w": {"step": torch.tensor(1.0)}}}, "meta": [1, "x"]}


def _recording(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []
    current: list = [None]

    @contextlib.contextmanager
    def device(d):
        calls.append(("enter_device", d))
        current[0] = d
        yield
        current[0] = None

    class Stager:
        def __init__(self, options) -> None:
            calls.append(("stager", current[0], options.use_non_blocking_copy))

        def close(self) -> None:
            calls.append(("stager_close",))

    def async_save(state_dict, **kw):
        calls.append(("async_save", current[0]))
        done: Future = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("synchronize", d)))
    monkeypatch.setattr(async_writer, "ReusingStager", Stager)
    monkeypatch.setattr(async_writer.dcp, "async_save", async_save)
    return calls


def test_cuda_device_of_finds_the_state_device():
    assert cuda_device_of(_fake_cuda_state()) == torch.device("cuda", 1)
    assert cuda_device_of({"a": torch.zeros(2), "b": [torch.ones(1)]}) is None


@pytest.mark.parametrize("background_staging", [False, True])
def test_staging_runs_on_the_state_device_and_waits_for_queued_kernels(tmp_path, monkeypatch, background_staging):
    calls = _recording(monkeypatch)
    writer = AsyncWriter("thread", background_staging=background_staging, process_group=None, thread_count=1)
    cuda1 = torch.device("cuda", 1)
    for step in (1, 2):
        writer.start(_fake_cuda_state(), tmp_path / f"s{step}")
    writer.close()
    sync = [("synchronize", cuda1)] if background_staging else []
    assert calls == [
        ("enter_device", cuda1),
        ("stager", cuda1, True),
        *sync,
        ("async_save", cuda1),
        ("enter_device", cuda1),
        *sync,
        ("async_save", cuda1),  # the stager is reused
        ("stager_close",),
    ]
