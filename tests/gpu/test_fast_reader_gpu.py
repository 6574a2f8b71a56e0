"""FastFileSystemReader loading into CUDA destination tensors (read into host buffers, then
``copy_``), bitwise equal to the saved tensors, with every reader configuration of the CPU tests
(tests/unit/test_fast_reader.py); and a manager load of an FSDP2 checkpoint into CUDA through
the fast reader vs DCP's reader (tests/distributed/trainer.py, NCCL, one GPU per rank)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from distckpt._engine.read.fast_reader import FastFileSystemReader
from distckpt._ondisk.integrity import hash_file
from tests.distributed.test_cross_wrapper import check_cross_load
from tests.gpu.gpus import NCCL, need_gpus
from tests.unit import test_fast_reader as cpu

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    state = cpu._state()
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path, state


def _cuda_targets(state: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in cpu._empty_like(state).items()}


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("kw", cpu.CONFIGS)
def test_fast_reader_loads_into_cuda_bitwise(saved, kw, verify):
    path, state = saved
    expected = {f.name: hash_file(f) for f in path.glob("*.distcp")} if verify else None
    reader = FastFileSystemReader(path, expected_files=expected, **kw)
    loaded = cpu._load(_cuda_targets(state), path, reader)
    for k, v in loaded.items():
        if isinstance(v, torch.Tensor):
            assert v.is_cuda, k
    cpu._assert_same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}, state)


@pytest.mark.parametrize("world_size,fast_load", [(1, True), (2, True), (2, False)])
def test_manager_load_into_cuda_fsdp2(tmp_path, world_size, fast_load):
    need_gpus(world_size)
    check_cross_load(
        tmp_path,
        world_size,
        {"device": "cuda", "wrapper": "fsdp2"},
        world_size,
        {"device": "cuda", "wrapper": "fsdp2", "fast_load": fast_load},
        backend=NCCL,
    )
