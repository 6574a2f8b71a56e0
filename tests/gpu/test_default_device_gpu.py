"""distckpt under ``torch.set_default_device("cuda")`` (issue 35, item 8): its own buffers (the
fast reader's, the record writer's probes) stay on the CPU, so a save and a load of CPU and CUDA
state are bitwise. The CPU stand-in ("meta" as the default device) is in tests/unit/test_fast_reader.py."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distckpt import dcp as ddcp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_a_save_and_load_under_a_cuda_default_device_are_bitwise(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "cpu": torch.randn(64, 33, generator=g, device="cpu"),
        "small": torch.arange(7, device="cpu"),
        "gpu": torch.randn(512, 600, generator=g, device="cpu").to("cuda"),
        "gpu_small": torch.randn(5, generator=g, device="cpu").to("cuda", torch.bfloat16),
    }
    saved = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        dcp.save(state, storage_writer=ddcp.FileSystemWriter(tmp_path), no_dist=True)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=ddcp.FileSystemReader(tmp_path), no_dist=True)
    finally:
        torch.set_default_device(saved)
    for k, v in state.items():
        assert out[k].device == v.device and torch.equal(out[k], v), k
