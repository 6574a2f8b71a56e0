"""Reading a memory-tier restore's chunks (``distckpt._memory.fetch``) into the load target."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from distckpt._memory.fetch import Cut, MemoryReader, memory_metadata


def test_a_memory_chunk_received_at_an_odd_offset_is_read_bitwise() -> None:
    """Chunks a rank receives from a peer arrive in one ``uint8`` buffer, split at their lengths: a
    float tensor after a small value of odd length (LBFGS's ``n_iter``) starts unaligned."""
    w = torch.arange(6, dtype=torch.float32) / 7
    received = torch.cat([torch.zeros(3, dtype=torch.uint8), w.view(torch.uint8)])[3:]  # after 3 bytes
    cut = Cut(step=1, world_size=1, gen="g")
    cut.headers = {0: {"items": [["w", "tensor", [0], [6], [6], "torch.float32", 0, 24]], "paths": {"w": ["w"]}}}
    metadata, where = memory_metadata(cut)
    out = {"w": torch.zeros(6)}
    reader = MemoryReader(metadata, where, {MetadataIndex("w", torch.Size([0])): received})
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], w)
