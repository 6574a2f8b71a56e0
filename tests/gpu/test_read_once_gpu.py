"""Read once, then share, with the model on the GPUs (issue 35, item 8): a DDP load on CUDA reads
each stored byte once per job (its destinations are CUDA tensors; distckpt's gloo group moves
the bytes through CPU buffers) and is bitwise. Rank r on cuda:r (tests/distributed/harness.py)."""

import pytest

from tests.distributed.harness import run_ranks, values
from tests.distributed.test_read_once import read_once_load
from tests.gpu.gpus import NCCL, need_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("world_size", [2])
def test_a_ddp_load_on_cuda_reads_each_stored_byte_once_and_is_bitwise(tmp_path, world_size):
    need_gpus(world_size)
    opts = {"root": str(tmp_path), "wrapper": "ddp", "read_once": True, "device": "cuda"}
    out = values(run_ranks(read_once_load, world_size, opts, backend=NCCL, timeout_s=240))
    data = out[0]["data_bytes"]
    assert all(r["bitwise"] for r in out)
    assert all(r["stats"]["shared_bytes"] == out[0]["stats"]["shared_bytes"] > 0.5 * data for r in out)
    assert sum(r["stats"]["read_bytes"] for r in out) == data  # once per job, not once per rank
