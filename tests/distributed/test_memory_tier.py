"""The memory tier (docs/memory.md): snapshots every step into per-node memory directories, a
replica on the other node, restores after a crash of every worker and after a node loss (its
directory deleted: its memory is gone), at the same and at another world size.

Simulated nodes: each rank sets ``DISTCKPT_NODE_ID`` from ``opts["nodes"]`` and its memory
directory is ``<mem>/<node>``. A job "dies" by SIGKILL of every rank after a barrier (each rank's
last snapshot and its replication round done, a durable checkpoint older than it).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import signal
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distckpt._memory.tier as tier_module
from distckpt import CheckpointConfig, CheckpointManager
from distckpt._memory.fetch import fetch_chunks, find_cut, inventory, map_chunks, memory_metadata, plan_fetch, verify
from distckpt._memory.tier import estimate_bytes
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import build, crash, full_optim, full_params, optimizer_step, release_workers


def _job(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Resume (if anything to), train to ``opts["until"]`` recording losses and ids, then die or close."""
    os.environ["DISTCKPT_NODE_ID"] = opts["nodes"][rank]
    logs = _Capture()
    logging.getLogger("distckpt").addHandler(logs)
    logging.getLogger("distckpt").setLevel(logging.INFO)
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    for m in model.modules() if opts.get("no_dropout") else ():  # per-rank RNG streams differ across sizes
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    memory = {"enabled": opts.get("memory", True), "dir": os.path.join(opts["mem"], "{node}"), "replicas": 1}
    config = CheckpointConfig(
        root=opts["root"],
        schedule={"interval_steps": opts.get("durable_every", 4)},
        retention={"keep_last": 2},
        async_save={"mode": opts.get("async_mode", "off")},
        memory=memory,
    )
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    state = manager.load()
    step = state.step if state else 0
    resumed = copy.deepcopy({"params": full_params(model), "optim": full_optim(model, optimizer)})  # not views
    restored = manager.loader.restored
    resumed.update(step=step, tier=manager.loader.tier, received=restored.bytes_received if restored else None)
    losses, ids = {}, {}
    it = iter(loader)
    while step < opts["until"]:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        loss = optimizer_step(model, optimizer, scheduler, scaler, batch).detach()
        dist.all_reduce(loss)
        step += 1
        losses[step], ids[step] = (loss / world_size).item(), batch["id"].tolist()
        manager.maybe_save(step, loss=losses[step])
    out = {"resumed": resumed, "losses": losses, "ids": ids, "params": full_params(model), "logs": logs.lines}
    out["optim"] = full_optim(model, optimizer)
    if opts.get("die"):
        manager.memory.wait()
        torch.save(out, os.path.join(opts["out"], f"rank{rank}.pt"))
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    out["files"] = sorted(os.listdir(manager.memory.dir)) if manager.memory else []
    manager.close()
    gone = not manager.memory or not os.path.isdir(manager.memory.dir)  # close() removes the emptied directory
    out["files_after_close"] = [] if gone else sorted(os.listdir(manager.memory.dir))
    release_workers(loader)
    return out


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _die(tmp_path, world_size: int, nodes: list[str], **opts: Any) -> list[dict[str, Any]]:
    out = tmp_path / "died"
    out.mkdir(exist_ok=True)
    o = {"root": str(tmp_path / "root"), "mem": str(tmp_path / "mem"), "nodes": nodes, "out": str(out), "die": True}
    run_ranks(_job, world_size, {**o, **opts}, timeout_s=120, expect_death=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _run(tmp_path, world_size: int, nodes: list[str], fn: Any = _job, **opts: Any) -> list[dict[str, Any]]:
    o = {"root": str(tmp_path / "root"), "mem": str(tmp_path / "mem"), "nodes": nodes}
    return values(run_ranks(fn, world_size, {**o, **opts}, timeout_s=120))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_mode", ["off", "thread"])
def test_worker_crash_restores_from_local_memory_bitwise(tmp_path, async_mode: str) -> None:
    nodes = ["a", "a", "b", "b"]
    opts = {"async_mode": async_mode}
    died = _die(tmp_path, 4, nodes, until=6, wrapper="ddp", ddp_fixed_buckets=True, **opts)  # durable 4, memory 6
    # blocking: step 4 committed; async: step 4 may still be in flight at the kill (memory serves either way)
    assert "step-000000006" not in os.listdir(tmp_path / "root")
    after = _run(tmp_path, 4, nodes, until=9, wrapper="ddp", ddp_fixed_buckets=True, **opts)
    base = _run(tmp_path / "base", 4, nodes, until=9, wrapper="ddp", ddp_fixed_buckets=True, memory=False, **opts)
    for r in range(4):
        assert after[r]["resumed"]["step"] == 6 and after[r]["resumed"]["tier"] == "memory"
        _same(after[r]["resumed"]["params"], died[r]["params"])
        assert after[r]["losses"] == {s: base[r]["losses"][s] for s in (7, 8, 9)}
        assert after[r]["ids"] == {s: base[r]["ids"][s] for s in (7, 8, 9)}
        _same(after[r]["params"], base[r]["params"])
    # close() freed this generation's snapshots and reclaimed the dead one's
    assert any(f.endswith(".snap") for f in after[0]["files"])
    assert not any(f.endswith((".snap", ".partial")) for f in after[0]["files_after_close"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapper, survivors", [("ddp", 2), ("ddp", 3), ("fsdp2", 2)])
def test_node_loss_restores_from_replicas_at_a_smaller_world_size(tmp_path, wrapper: str, survivors: int) -> None:
    nodes = ["a", "a", "b", "b"]
    opts = {"wrapper": wrapper, "ddp_fixed_buckets": True, "global_batch_size": 12, "no_dropout": True}
    died = _die(tmp_path, 4, nodes, until=6, **opts)
    (job,) = os.listdir(tmp_path / "mem" / "b")
    shutil.rmtree(tmp_path / "mem" / "b")  # node b and its memory are gone
    new_nodes = ["a", "a", "c"][:survivors]  # c: a fresh node with empty memory
    after = _run(tmp_path, survivors, new_nodes, until=8, **opts)
    base = _run(tmp_path / "base", 4, nodes, until=8, memory=False, **opts)
    assert [a["resumed"]["step"] for a in after] == [6] * survivors
    assert [a["resumed"]["tier"] for a in after] == ["memory"] * survivors
    # node a held every shard (its own and b's replicas); node c's rank got its chunks over the network
    assert [a["resumed"]["received"] > 0 for a in after] == [False, False, True][:survivors]
    assert any(line.startswith("memory tier serves: memory://job-") for line in after[0]["logs"])
    _same(after[0]["resumed"]["params"], died[0]["params"])  # FULL state dicts: rank 0's
    for fqn, s in died[0]["optim"]["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[0]["resumed"]["optim"]["state"][fqn][k], s[k]), (fqn, k)
    for s in (7, 8):  # every sample of the global batch once, the loss within 1e-4
        assert sorted(i for r in range(survivors) for i in after[r]["ids"][s]) == sorted(
            i for r in range(4) for i in base[r]["ids"][s]
        )
        assert abs(after[0]["losses"][s] - base[0]["losses"][s]) < 1e-4
    assert job.startswith("job-")


@pytest.mark.timeout(240)
def test_two_nodes_lost_with_one_replica_falls_back_to_the_durable_tier(tmp_path) -> None:
    nodes = ["a", "b", "c"]  # ring a -> b -> c -> a: b's shard lives on b and c
    opts = {"wrapper": "ddp", "ddp_fixed_buckets": True, "global_batch_size": 6, "no_dropout": True}
    _die(tmp_path, 3, nodes, until=6, **opts)
    for gone in ("b", "c"):
        shutil.rmtree(tmp_path / "mem" / gone)
    (after,) = _run(tmp_path, 1, ["a"], until=6, **opts)
    assert after["resumed"]["step"] == 4 and after["resumed"]["tier"] == "durable"
    assert any(
        "memory tier: step 6 lacks the shards of ranks [1] (lost with their nodes) -> the durable tier serves" in line
        for line in after["logs"]
    ), after["logs"]


@pytest.mark.timeout(240)
def test_a_corrupt_snapshot_is_served_by_its_replica(tmp_path) -> None:
    nodes = ["a", "a", "b", "b"]
    opts = {"wrapper": "ddp", "ddp_fixed_buckets": True}
    died = _die(tmp_path, 4, nodes, until=6, **opts)
    mem_a = tmp_path / "mem" / "a"
    (victim,) = mem_a.glob("*/step-000000006.rank-00000-of-4.*.snap")
    with open(victim, "r+b") as f:  # one byte of the data region
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    after = _run(tmp_path, 4, nodes, until=6, **opts)
    assert [a["resumed"]["step"] for a in after] == [6] * 4
    assert [a["resumed"]["tier"] for a in after] == ["memory"] * 4
    _same(after[0]["resumed"]["params"], died[0]["params"])
    warned = [line for a in after for line in a["logs"] if victim.name in line]
    assert warned and "data hash" in warned[0] and "a replica or the durable tier serves instead" in warned[0]
    assert sum(a["resumed"]["received"] for a in after[:2]) > 0  # node a's ranks fetched rank 0's shard from b


@pytest.mark.timeout(240)
def test_the_jobs_end_reclaims_the_memory_of_a_node_that_never_came_back(tmp_path) -> None:
    """Issue 35 item 5 (a, b): both nodes die, only node a comes back, the job ends cleanly: its
    close() deletes node b's snapshots of this job (reachable here through ``{node}``) and both job
    directories; another job's directory and a file that is not distckpt's are kept."""
    opts = {"wrapper": "ddp", "ddp_fixed_buckets": True, "no_dropout": True}
    _die(tmp_path, 2, ["a", "b"], until=6, **opts)
    mem = tmp_path / "mem"
    (job,) = os.listdir(mem / "b")
    assert sum(f.endswith(".snap") for f in os.listdir(mem / "b" / job)) == 4  # steps 5, 6: own + a's replica
    other = mem / "b" / "job-0123456789abcdef"
    other.mkdir()
    (other / "step-000000003.rank-00000-of-1.feed.snap").write_bytes(b"another job's")
    (mem / "b" / "notes.txt").write_text("the operator's")
    (after,) = _run(tmp_path, 1, ["a"], until=8, **opts)
    assert after["resumed"]["step"] == 6 and after["resumed"]["tier"] == "memory"
    freed = [line for line in after["logs"] if line.startswith("memory tier: freed")]
    assert len(freed) == 1 and freed[0].endswith(f"MiB of this job's snapshots in {mem / 'b' / job}"), freed
    assert os.listdir(mem / "a") == []
    assert sorted(os.listdir(mem / "b")) == ["job-0123456789abcdef", "notes.txt"]
    assert os.listdir(other) == ["step-000000003.rank-00000-of-1.feed.snap"]
    assert (other / "step-000000003.rank-00000-of-1.feed.snap").read_bytes() == b"another job's"


def _inline(fn: Any, *args: Any) -> Future:
    """:func:`distckpt._memory.worker.in_background`, run on the calling thread (the default device is per thread)."""
    done: Future = Future()
    fn(*args)
    done.set_result(None)
    return done


def _on_meta_by_default(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """A snapshot, its replication round and a restore's chunk transfer under ``set_default_device("meta")``:
    a tensor created without ``device=`` would be a meta tensor, which gloo refuses."""
    os.environ["DISTCKPT_NODE_ID"] = ["a", "b"][rank]
    model, optimizer, _, _, loader = build(rank, world_size, {"wrapper": "ddp"})
    memory = {"enabled": True, "dir": os.path.join(opts["mem"], "{node}"), "replicas": 1}
    manager = CheckpointManager(CheckpointConfig(root=opts["root"], memory=memory), model=model, optimizer=optimizer)
    tier = manager.memory
    state = {"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(4, 8, dtype=torch.float32)}
    tier_module.in_background = _inline
    torch.set_default_device("meta")
    try:
        tier.snapshot(1, lambda: state)  # replicated tensors: "a" stored by rank 0, "b" by rank 1
    finally:
        torch.set_default_device(None)
    mine, headers = inventory(tier.dir, tier.layout, rank, run="")
    entries = [e for part in manager.collective.all_gather(mine) for e in part]
    own = [e for e in entries if e[3] == e[0]]  # without the replicas, rank 0 must fetch "b" from rank 1
    cut, _ = find_cut(own)
    for _, theirs in manager.collective.all_gather(verify(tier.dir, rank, cut, headers)):
        cut.headers.update(theirs)
    metadata, where = memory_metadata(cut)
    fetch = plan_fetch(cut, where, sorted(where, key=str), layout=tier.layout, rank=rank)
    all_asks = manager.collective.all_gather(fetch.asks)
    torch.set_default_device("meta")
    try:
        files, local = map_chunks(fetch, cut, rank=rank, directory=tier.dir)
        chunks, received, _, error = fetch_chunks(fetch, all_asks, files, local, collective=manager.collective)
    finally:
        torch.set_default_device(None)
    out = {
        "values": {k.fqn: chunks[k].view(torch.float32).tolist() for k in chunks},
        "devices": sorted({str(c.device) for c in chunks.values()}),
        "received": received,
        "error": error,
        "replicas": len(entries) - len(own),
    }
    manager.close()
    release_workers(loader)
    return out


@pytest.mark.timeout(120)
def test_the_tensors_sent_through_gloo_are_on_cpu_whatever_the_default_device(tmp_path) -> None:
    """Issue 35 item 8: with ``torch.set_default_device("cuda")`` a size or receive buffer made
    without ``device=`` was a CUDA tensor handed to gloo; here "meta" stands in for "cuda"."""
    out = _run(tmp_path, 2, ["a", "b"], fn=_on_meta_by_default)
    for r in range(2):
        assert out[r]["values"] == {"a": [0.0, 1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0, 7.0]}
        assert out[r]["devices"] == ["cpu"] and out[r]["replicas"] == 2  # each rank's file went to the other node
        assert out[r]["received"] == 16  # the other rank's 4 float32 arrived over gloo
        assert out[r]["error"] is None


def _fsdp1_memory(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """The memory tier on FSDP1 (CPU, gloo): what every ``model.state_dict()`` it took returned."""
    os.environ["DISTCKPT_NODE_ID"] = ["a", "b"][rank]
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, {"wrapper": "fsdp1"})
    seen: list[set[str]] = []
    state_dict = model.state_dict

    def spy(*args: Any, **kwargs: Any) -> dict[str, Any]:
        sd = state_dict(*args, **kwargs)
        seen.append({type(v).__name__ for v in sd.values()})
        return sd

    model.state_dict = spy  # type: ignore[method-assign]
    estimate = estimate_bytes(model, optimizer, world_size)
    memory = {"enabled": True, "dir": os.path.join(opts["mem"], "{node}")}
    config = CheckpointConfig(root=opts["root"], schedule={"interval_steps": 100}, memory=memory)
    manager = CheckpointManager(config, model=model, optimizer=optimizer, lr_scheduler=scheduler, dataloader=loader)
    it = iter(loader)
    for step in (1, 2):
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
        manager.maybe_save(step)
    manager.memory.wait()
    files = sorted(os.listdir(manager.memory.dir))
    manager.close()
    release_workers(loader)
    return {"seen": seen, "estimate": estimate, "files": files}


@pytest.mark.timeout(180)
def test_the_memory_tier_never_gathers_an_fsdp1_model(tmp_path) -> None:
    """Issue 35 item 8: the tier sized its snapshot from FSDP1's default (full) ``state_dict()``,
    which gathers the whole model on every rank (GPU OOM at start-up); it reads the sharded one."""
    out = _run(tmp_path, 2, ["a", "b"], fn=_fsdp1_memory)
    # Net's 433 float32 parameters: the sharded state_dict chunks each along dim 0, rank 0 holding 225 of
    # them, rank 1 208 (a full one gave each rank the whole model, counted as 433 * 4 // 2 bytes); AdamW
    # before its first step: 2 bytes of state per parameter byte; 1 MiB for the rest
    assert [o["estimate"] for o in out] == [225 * 4 * 3 + 2**20, 208 * 4 * 3 + 2**20]
    for o in out:
        assert o["seen"] and all(kinds == {"ShardedTensor"} for kinds in o["seen"]), o["seen"]
        assert sum(f.endswith(".snap") for f in o["files"]) == 4  # steps 1 and 2, own and the other's replica


def _a_send_fails(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 (node b, no replicas) cannot build the chunks rank 0 asks of it: the memory restore
    must fail on both ranks, with rank 0 not left waiting for the bytes, and the durable tier serve."""
    import distckpt._memory.source as source_module

    os.environ["DISTCKPT_NODE_ID"] = ["a", "b"][rank]
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, {"wrapper": "ddp"})
    memory = {"enabled": True, "dir": os.path.join(opts["mem"], "{node}"), "replicas": 0}
    config = CheckpointConfig(root=opts["root"], schedule={"interval_steps": 1000}, memory=memory)
    writer = CheckpointManager(config, model=model, optimizer=optimizer)
    it = iter(loader)
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    writer.save(1)
    durable = copy.deepcopy(full_params(model))
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    writer.maybe_save(2)  # memory only: newer than the durable step 1
    writer.memory.wait()
    dist.barrier()
    if rank == 1:
        real = source_module.fetch_chunks

        class Broken:
            def __call__(self, *args: Any) -> torch.Tensor:
                raise OSError(5, "Input/output error")

        def failing(fetch, all_asks, files, local, *, collective):  # type: ignore[no-untyped-def]
            return real(fetch, all_asks, Broken(), local, collective=collective)

        source_module.fetch_chunks = failing
    crash(writer)  # its snapshots stay for the reader, the restarted job
    reader = CheckpointManager(config, model=model, optimizer=optimizer)
    state = reader.load()
    same = all(torch.equal(v, durable[k]) for k, v in full_params(model).items())
    out = {"step": state.step if state else None, "tier": reader.loader.tier, "same": same}
    reader.close()
    release_workers(loader)
    return out


@pytest.mark.timeout(120)
def test_a_failed_send_of_a_memory_restore_falls_back_on_every_rank_without_a_hang(tmp_path) -> None:
    out = values(
        run_ranks(_a_send_fails, 2, {"root": str(tmp_path / "root"), "mem": str(tmp_path / "mem")}, timeout_s=60)
    )
    assert out == [{"step": 1, "tier": "durable", "same": True}] * 2, out
