"""FastFileSystemReader under resharding: FSDP2 (and DDP) checkpoints loaded into FSDP2 at
another world size on gloo ranks, bitwise equal to the saved full tensors.

Uneven shapes on purpose: a bias of size 3 on 4 ranks (one rank holds nothing), a weight whose
dim 0 (2) is smaller than the world size (3), dims that do not divide by 2, 3 or 4, a bf16
layer, and two bigger weights so that partial reads of stored shards go through the direct path
(with ``direct_min_bytes`` at its minimum every tensor item does).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(300)


def _net():
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 3)  # weight (3, 16), bias (3): empty shard on 4 ranks
            self.b = nn.Linear(3, 2)  # weight (2, 3): dim 0 < world size 3
            self.c = nn.Linear(40, 257)  # 257 rows: uneven at 2, 3 and 4
            self.d = nn.Linear(600, 1001)  # 2.4 MB: above the default direct_min_bytes
            self.e = nn.Linear(9, 7).to(torch.bfloat16)
            self.f = nn.Linear(300, 999, bias=False)

    return Net()


def _full_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in _net().state_dict().items()}


def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for name in ("a", "b", "c", "d", "e", "f"):
        fully_shard(getattr(model, name))
    fully_shard(model)


def _save(rank: int, world_size: int, path: str, wrapper: str) -> dict[str, tuple[int, str]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from distckpt._ondisk.integrity import hash_file

    torch.manual_seed(0)
    model = _net()  # identical full values on every rank
    if wrapper == "fsdp2":
        _shard(model)
        state = {"model": model.state_dict()}
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.nn.parallel import DistributedDataParallel

        state = {"model": get_model_state_dict(DistributedDataParallel(model))}
    state["extra"] = {"step": torch.tensor(11), "tag": "saved"}
    dcp.save(state, storage_writer=FileSystemWriter(path), process_group=None)  # plain dcp.save
    import torch.distributed as dist

    dist.barrier()
    from pathlib import Path

    return {p.name: hash_file(p) for p in sorted(Path(path).glob("*.distcp"))}


def _nan_target():
    """An FSDP2 target on this rank's shards, NaN-filled (a load that skips a byte shows)."""
    with torch.device("meta"):
        model = _net()
    _shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float("nan"))
    extra = {"step": torch.tensor(0), "tag": ""}
    return model, {"model": model.state_dict(), "extra": extra}, extra


def _local_params(model) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """``{name: (global offset, local shard)}`` of every DTensor parameter."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        _shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[name] = (tuple(offset), p.to_local().clone())
    return out


def _load(rank: int, world_size: int, path: str, reader_kw: dict, expected) -> dict:
    import torch.distributed.checkpoint as dcp

    from distckpt._engine.read.fast_reader import FastFileSystemReader
    from distckpt._engine.safe_io import SafeLoadPlanner

    model, state, extra = _nan_target()
    reader = FastFileSystemReader(path, expected_files=expected, **reader_kw)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=None)
    return {"params": _local_params(model), "step": int(extra["step"]), "tag": extra["tag"], "stats": reader.last_stats}


def _check(full: dict[str, torch.Tensor], per_rank: list[dict], world_size: int) -> None:
    covered = {k: 0 for k in full}
    for r in per_rank:
        assert r["step"] == 11 and r["tag"] == "saved"
        for name, (offset, local) in r["params"].items():
            want = full[name]
            assert local.dtype == want.dtype, name
            if local.numel() == 0:
                continue
            rows = want.narrow(0, offset[0], local.shape[0])
            assert torch.equal(local.reshape(-1).view(torch.uint8), rows.reshape(-1).view(torch.uint8)), name
            covered[name] += local.shape[0]
    for name, n in covered.items():
        assert n == full[name].shape[0], (name, n)  # every row loaded by exactly one rank


def _evict(path: str) -> None:
    """Drop the checkpoint's data files from the page cache (the reader then reads the bytes
    between a rank's ranges through instead of skipping them)."""
    import os
    from pathlib import Path

    for f in Path(path).glob("*.distcp"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize(
    "save_wrapper,save_ws,load_ws,reader_kw,with_hashes,cold",
    [
        ("fsdp2", 2, 3, {}, False, False),
        # Variants of the reader's knobs: `make test-slow` (the default suite keeps the two above
        # and below, which cover the stock-like and the direct+hashes paths).
        pytest.param("fsdp2", 2, 3, {"direct_min_bytes": 4096, "thread_count": 1}, False, True, marks=pytest.mark.slow),
        ("fsdp2", 2, 4, {"direct_min_bytes": 4096}, True, True),
        pytest.param(
            "fsdp2", 2, 4, {"gap_read_bytes": 0, "max_request_bytes": 1 << 20}, True, False, marks=pytest.mark.slow
        ),
        pytest.param("ddp", 2, 3, {"direct_min_bytes": 4096}, False, True, marks=pytest.mark.slow),
    ],
    ids=[
        "fsdp2x2-fsdp2x3",
        "fsdp2x2-fsdp2x3-direct-cold",
        "fsdp2x2-fsdp2x4-direct-hashes-cold",
        "fsdp2x2-fsdp2x4-skip-gaps-hashes",
        "ddp2-fsdp2x3-direct-cold",
    ],
)
def test_reshard_bitwise(tmp_path, save_wrapper, save_ws, load_ws, reader_kw, with_hashes, cold):
    path = str(tmp_path / "ckpt")
    written = values(run_ranks(_save, save_ws, path, save_wrapper, timeout_s=120))
    expected = {k: v for w in written for k, v in w.items()} if with_hashes else None
    if cold:
        _evict(path)
    loaded = values(run_ranks(_load, load_ws, path, reader_kw, expected, timeout_s=120))
    _check(_full_state(), loaded, load_ws)
    for r in loaded:
        assert r["stats"]["fallback_items"] == 0, r["stats"]
    if reader_kw.get("direct_min_bytes") == 4096:
        assert any(r["stats"]["direct_bytes"] > 0 for r in loaded)


def test_bench_load_smoke(tmp_path):
    """The load benchmark runs end to end at a tiny size: every load checked bitwise."""
    import json

    from benchmarks import bench_load

    out = tmp_path / "bench"
    rc = bench_load.main(
        [
            "--size-mib",
            "4",
            "--world-sizes",
            "1",
            "2",
            "--reshard-to",
            "1",
            "--no-ddp",
            "--rounds",
            "1",
            "--readers",
            "stock",
            "fast",
            "fast_verify",
            "--timeout-s",
            "120",
            "--replicated-sizes-mib",
            "4",
            "--replicated-world-sizes",
            "2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    replicated = [r for r in results["results"] if r.get("scenario") == "replicated"]
    assert sorted(r["read_once"] for r in replicated) == [False, True]  # side by side
    assert all(r["bitwise_equal"] and r["bytes_read"] >= r["checkpoint_bytes"] > 0 for r in replicated), replicated
    assert "## Replicated" in (out / "results.md").read_text()
    rows = [r for r in results["results"] if r.get("scenario") != "replicated"]
    cells = {(r["cell"], r["reader"], r["cache"]) for r in rows}
    assert len(cells) == len(rows) == 3 * 3 * 2  # same 1, same 2, reshard 2->1; 3 readers; cold+warm
    for r in rows:
        assert "error" not in r and r["bitwise_equal"], r
        assert r["load_s"] > 0 and r["read_data_s"] > 0 and r["disk_read_gbps"] > 0
    assert any("reshard_ratio" in r for r in rows) and any("speedup_vs_stock" in r for r in rows)
    for r in rows:  # the fast reader's counters: bytes read vs the bytes the plans need
        if r["reader"] != "stock":
            assert r["bytes_needed"] > 0 and r["read_amplification"] == r["bytes_read"] / r["bytes_needed"] >= 1, r
    assert "read / needed MiB" in (out / "results.md").read_text()
    assert results["meta"]["cold_method"] and results["meta"]["verdicts"]
    assert results["meta"]["page_reporting"]["state"]
    assert "## Goals" in (out / "results.md").read_text()
    assert not (out / "data").exists()


def _run_load(rank: int, world_size: int, path: str, expected, fault: tuple[str, int] | None) -> dict:
    """Load through distckpt's ``run_load`` (each rank plans alone, one outcome exchange);
    ``fault = (kind, rank)``: ``"digest"`` (a digest that cannot match) or ``"interrupt"``
    (``KeyboardInterrupt`` inside the read) on that rank alone."""
    from distckpt._engine.blocking import run_load
    from distckpt._engine.read.fast_reader import FastFileSystemReader
    from distckpt._errors import CheckpointCorruptError, DistCkptError

    model, state, extra = _nan_target()
    if fault == ("digest", rank):
        name = sorted(expected)[0]
        expected = dict(expected, **{name: (expected[name][0], "0" * 32)})
    reader = FastFileSystemReader(path, expected_files=expected)
    if fault == ("interrupt", rank):

        def interrupted(plan, planner):
            raise KeyboardInterrupt("Ctrl-C during the read")

        reader.read_data = interrupted
    try:
        run_load(state, reader, process_group=None, directory=path)
    except CheckpointCorruptError as e:
        return {"error": str(e), "path": e.path, "type": "CheckpointCorruptError"}
    except (DistCkptError, KeyboardInterrupt) as e:
        return {"error": str(e), "type": type(e).__name__}
    return {"params": _local_params(model), "step": int(extra["step"]), "tag": extra["tag"]}


def test_run_load_reshards_without_plan_exchange_and_fails_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    written = values(run_ranks(_save, 2, path, "fsdp2", timeout_s=120))
    expected = {k: v for w in written for k, v in w.items()}
    loaded = values(run_ranks(_run_load, 3, path, expected, None, timeout_s=120))
    _check(_full_state(), loaded, 3)
    failed = values(run_ranks(_run_load, 3, path, expected, ("digest", 1), timeout_s=120))
    bad_file = str(tmp_path / "ckpt" / sorted(expected)[0])
    assert all(r.get("type") == "CheckpointCorruptError" and r["path"] == bad_file for r in failed), failed
    assert all(r["error"].startswith("rank 1: ") and "does not match" in r["error"] for r in failed), failed
    # An interrupt is not corruption: it reaches its rank as it is, the others stop with a plain
    # DistCkptError (so a manager would not set the checkpoint aside).
    stopped = values(run_ranks(_run_load, 3, path, expected, ("interrupt", 2), timeout_s=120))
    assert stopped[2]["type"] == "KeyboardInterrupt", stopped
    for r in stopped[:2]:
        assert r["type"] == "DistCkptError" and "rank 2" in r["error"] and "KeyboardInterrupt" in r["error"], r


# ------------------------------------------------------------------ ranged reads (block digests)
def _save_blocks(rank: int, world_size: int, path: str, min_block: int) -> dict:
    """Save through distckpt's writer (hashes and block digests); blocks of at least
    ``min_block`` bytes (the default 1 MiB would make this small model one block per shard)."""
    import torch.distributed as dist

    from distckpt._engine.blocking import dcp_save
    from distckpt._ondisk import integrity

    integrity.MIN_BLOCK_BYTES = min_block
    torch.manual_seed(0)
    model = _net()
    _shard(model)
    state = {"model": model.state_dict(), "extra": {"step": torch.tensor(11), "tag": "saved"}}
    written = dcp_save(state, path, process_group=None, thread_count=1)
    dist.barrier()
    return {k: (tuple(v), v.blocks) for k, v in written.items()}


def _load_blocks(rank: int, world_size: int, path: str, expected, blocks) -> dict:
    from distckpt._engine.blocking import run_load
    from distckpt._engine.read.fast_reader import FastFileSystemReader
    from distckpt._errors import CheckpointCorruptError

    model, state, extra = _nan_target()
    # Items up to direct_min_bytes are read whole: at most a block here, as with the defaults.
    reader = FastFileSystemReader(path, expected_files=expected, block_digests=blocks, direct_min_bytes=64 * 1024)
    try:
        run_load(state, reader, process_group=None, directory=path)
    except CheckpointCorruptError as e:
        return {"error": str(e), "path": e.path}
    return {"params": _local_params(model), "step": int(extra["step"]), "tag": extra["tag"], "stats": reader.last_stats}


@pytest.mark.parametrize("save_ws,load_ws", [(2, 4), (2, 3)], ids=["2to4", "2to3"])
def test_reshard_reads_only_needed_blocks(tmp_path, save_ws, load_ws):
    """With block digests a resharded, hash-verified load reads about what each rank needs
    (not the whole files it touches), bitwise equal; a flipped byte in a block a rank reads
    fails the load on every rank naming the file and the block's byte range."""
    path = str(tmp_path / "ckpt")
    saved = values(run_ranks(_save_blocks, save_ws, path, 64 * 1024, timeout_s=120))
    expected = {k: v[0] for s in saved for k, v in s.items()}
    blocks = {k: v[1] for s in saved for k, v in s.items() if v[1] is not None}
    assert blocks and all(b.valid_for(expected[k][0]) for k, b in blocks.items())
    loaded = values(run_ranks(_load_blocks, load_ws, path, expected, blocks, timeout_s=120))
    _check(_full_state(), loaded, load_ws)
    stats = [r["stats"] for r in loaded]
    read, needed = sum(s["read_bytes"] for s in stats), sum(s["needed_bytes"] for s in stats)
    assert sum(s["ranged_files"] for s in stats) >= load_ws
    # Whole-file reads: ~2x (2 -> 4), ~1.7x (2 -> 3). A shard end that falls inside a block costs
    # the rest of that block (uneven row counts here: ~1/8 of a stored shard per end).
    assert read <= 1.3 * needed, (read, needed)
    for s in stats:
        assert s["read_bytes"] <= 1.5 * s["needed_bytes"] + 128 * 1024, s

    # A flipped byte in the third block of the big weight's stored shard in rank 0's file: the
    # first load rank reads that block; every rank fails naming the file and the byte range.
    name = "__0_0.distcp"
    ends = blocks[name].ends
    k = next(i for i in range(1, len(ends)) if ends[i] - ends[i - 1] > 100_000) + 2
    lo, hi = ends[k - 1], ends[k]
    with open(f"{path}/{name}", "r+b") as f:
        f.seek((lo + hi) // 2)
        byte = f.read(1)
        f.seek((lo + hi) // 2)
        f.write(bytes([byte[0] ^ 1]))
    failed = values(run_ranks(_load_blocks, load_ws, path, expected, blocks, timeout_s=120))
    for r in failed:
        assert r.get("path") == f"{path}/{name}", r
        assert f"bytes [{lo}, {hi})" in r["error"] and "does not match the manifest" in r["error"], r
