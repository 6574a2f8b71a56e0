"""distckpt.dcp on gloo ranks: every rank's files are hashed into rank 0's sidecar, an FSDP2
checkpoint written through the drop-in writer is read back resharded (2 -> 3 ranks, and by one
process) bitwise by the stock reader and by distckpt's verified reader, and a flipped byte in
another rank's file is named on every rank (issue 28, item 1)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.harness import run_ranks, values

pytestmark = [pytest.mark.timeout(200), pytest.mark.filterwarnings("ignore::UserWarning")]


def _net():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1001), nn.ReLU(), nn.Linear(1001, 300), nn.Linear(300, 5))


def _full() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _net().state_dict().items()}


def _sharded_model():
    from torch.distributed.fsdp import fully_shard

    model = _net()
    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def _save(rank: int, world_size: int, path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    from distckpt.dcp import FileSystemWriter

    model = _sharded_model()
    for _ in range(2):  # the second save overwrites the first (overwrite=True, as stock): fresh hashes
        dcp.save({"model": model.state_dict()}, storage_writer=FileSystemWriter(path, thread_count=2))
    return sorted(os.listdir(path))


def _load(rank: int, world_size: int, path: str, stock: bool) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from distckpt.dcp import FileSystemReader

    model = _sharded_model()
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path) if stock else FileSystemReader(path))
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _load_corrupt(rank: int, world_size: int, path: str) -> str:
    try:
        _load(rank, world_size, path, stock=False)
    except BaseException as e:  # DCP's CheckpointException (a BaseException)
        return str(e)
    return "no error"


def test_every_rank_hashed_then_resharded_reads_bitwise_and_a_flip_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    from distckpt import dcp as ddcp
    from distckpt._ondisk import dcp_hashes

    path = str(tmp_path / "ckpt")
    files = values(run_ranks(_save, 2, path))[0]
    data = sorted(f for f in files if f.endswith(".distcp"))
    assert data == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    recorded = dcp_hashes.decode((tmp_path / "ckpt" / ".metadata.xxh3.json").read_bytes(), "x")
    assert sorted(recorded) == sorted(data + [".metadata"])  # rank 1's files too
    full = _full()
    for stock in (True, False):  # 2 -> 3 ranks
        for got in values(run_ranks(_load, 3, path, stock)):
            assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    # One process, no process group: every shard of every file read and verified.
    out = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    reader = ddcp.FileSystemReader(path)
    dcp.load(out, storage_reader=reader)
    assert all(torch.equal(out["model"][k], full[k]) for k in full)
    assert reader.hashes is not None
    # A flipped byte in a file rank 1 wrote: every loading rank fails; the reader names the file.
    victim = tmp_path / "ckpt" / "__1_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    victim.write_bytes(bytes(raw))
    messages = values(run_ranks(_load_corrupt, 2, path))
    assert all("CheckpointCorruptError" in m for m in messages)
    assert any(f"{victim}" in m for m in messages)
