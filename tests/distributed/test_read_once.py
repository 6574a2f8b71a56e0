"""Read once, then share (distckpt/_engine/read/shared_read.py): a replicated load reads each
stored data byte from the root once per job, bitwise, and still names a corrupt file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(240)


def read_once_load(rank, world_size, opts):
    """Save, perturb, load (bytes read per rank recorded); ``opts["corrupt"]``: one byte of the
    largest data file flipped before the load; ``opts["device"]``: ``"cuda"`` puts the model on
    the rank's GPU; ``opts["stage"]``: every shared tensor goes through the CPU staging of
    non-CPU destinations, with small buckets (the CUDA path's mechanism, on CPU)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from distckpt import CheckpointConfig, CheckpointCorruptError, CheckpointManager, LoadConfig, ScheduleConfig
    from distckpt._engine.read import shared_read

    shared_read.DEFAULT_MIN_BYTES = 0  # share even this small state (the default keeps 16 MiB)
    if opts.get("stage"):
        shared_read._staged = lambda tensor: True  # type: ignore[attr-defined]
        shared_read.BUCKET_BYTES = 8192  # the weights (36 KiB) alone, the biases in buckets
    stats = []
    read_data = shared_read.SharingReader.read_data

    def spy(self, plan, planner):
        try:
            return read_data(self, plan, planner)
        finally:
            stats.append(dict(self.last_stats))

    shared_read.SharingReader.read_data = spy  # type: ignore[method-assign]

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(96, 96) for _ in range(4)])
            self.register_buffer("table", torch.randn(40, 96))  # replicated under FSDP2 too

    torch.manual_seed(0)
    model: nn.Module = Wide()
    if opts.get("device") == "cuda":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    if opts["wrapper"] == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    config = CheckpointConfig(
        root=opts["root"], schedule=ScheduleConfig(interval_steps=None), load=LoadConfig(read_once=opts["read_once"])
    )

    def full() -> dict[str, torch.Tensor]:
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()
        }

    with CheckpointManager(config, model=model, optimizer=None) as manager:
        path = Path(manager.save(1))
    expected = full()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.add_(1.0)
    files = sorted(path.glob("*.distcp"), key=lambda p: -p.stat().st_size)
    if opts.get("corrupt") and rank == 0:
        with open(files[0], "r+b") as f:
            f.seek(files[0].stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    error = None
    with CheckpointManager(config, model=model, optimizer=None) as manager:
        try:
            manager.load()
        except CheckpointCorruptError as e:
            error = str(e)
    got = full()
    return {
        "stats": stats[-1],
        "bitwise": error is None and all(torch.equal(got[k], v) for k, v in expected.items()),
        "error": error,
        "data_bytes": sum(p.stat().st_size for p in files),
        "corrupted": files[0].name,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_ddp_load_reads_each_stored_byte_once_and_is_bitwise(tmp_path, world_size):
    out = values(run_ranks(read_once_load, world_size, {"root": str(tmp_path), "wrapper": "ddp", "read_once": True}))
    data = out[0]["data_bytes"]
    assert all(r["bitwise"] for r in out)
    assert sum(r["stats"]["read_bytes"] for r in out) == data  # once per job, not once per rank
    assert all(r["stats"]["shared_bytes"] == out[0]["stats"]["shared_bytes"] > 0.5 * data for r in out)
    assert sum(r["stats"]["shared_bytes_read"] for r in out) == out[0]["stats"]["shared_bytes"]
    assert max(r["stats"]["read_bytes"] for r in out) < data  # spread over the ranks


def test_shared_tensors_staged_through_cpu_buffers_are_bitwise(tmp_path):
    """The path of CUDA destinations (shared_read._broadcast_via_cpu and the buckets' copies),
    forced for CPU ones: still read once per job, bitwise (on GPUs: tests/gpu/test_read_once_gpu.py)."""
    opts = {"root": str(tmp_path), "wrapper": "ddp", "read_once": True, "stage": True}
    out = values(run_ranks(read_once_load, 2, opts))
    assert all(r["bitwise"] for r in out)
    assert sum(r["stats"]["read_bytes"] for r in out) == out[0]["data_bytes"]


def test_without_read_once_every_rank_reads_the_whole_checkpoint(tmp_path):
    out = values(run_ranks(read_once_load, 2, {"root": str(tmp_path), "wrapper": "ddp", "read_once": False}))
    assert all(r["bitwise"] for r in out)
    assert [r["stats"]["read_bytes"] for r in out] == [out[0]["data_bytes"]] * 2


def test_fsdp2_shards_are_read_per_rank_and_the_replicated_buffer_once(tmp_path):
    out = values(run_ranks(read_once_load, 2, {"root": str(tmp_path), "wrapper": "fsdp2", "read_once": True}))
    assert all(r["bitwise"] for r in out)
    table_bytes = 40 * 96 * 4
    shared = out[0]["stats"]["shared_bytes"]
    # The buffer (and the small bytes items every rank reads), not the shards.
    assert all(r["stats"]["shared_bytes"] == shared for r in out) and table_bytes < shared < table_bytes + 8192, shared
    assert sum(r["stats"]["shared_bytes_read"] for r in out) == shared
    assert sum(r["stats"]["read_bytes"] for r in out) == out[0]["data_bytes"]


def test_a_corrupt_byte_in_a_shared_file_is_named_on_every_rank(tmp_path):
    opts = {"root": str(tmp_path), "wrapper": "ddp", "read_once": True, "corrupt": True}
    out = values(run_ranks(read_once_load, 2, opts))
    for r in out:
        assert r["error"] is not None and not r["bitwise"]
        assert r["corrupted"] in r["error"] and "does not match" in r["error"], r["error"]


def test_read_once_is_true_false_or_auto():
    from distckpt import ConfigError, LoadConfig

    assert LoadConfig().read_once == "auto" and LoadConfig(read_once=True).read_once is True
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="load.read_once"):
            LoadConfig(read_once=bad)
