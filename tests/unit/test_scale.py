"""Costs that must not grow with the job (issue 34): the manifest's size at a thousand ranks, rank 0's
retention work against the number of kept checkpoints, the digest files' integrity, who receives
the save's hashes and who reads a load's metadata, and the arrival check's failure path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from benchmarks.manifest_size import manifest_size
from distckpt import CheckpointConfig, CheckpointCorruptError, CheckpointManager, LoadConfig, ScheduleConfig
from distckpt._cli import main
from distckpt._coord import collective as collective_mod
from distckpt._coord.collective import Collective
from distckpt._ondisk.digests import DigestIndex
from distckpt._ondisk.integrity import MAX_BLOCK_BYTES, BlockDigests, WrittenFile
from distckpt._ondisk.manifest import Manifest
from distckpt._storage import find_committed
from distckpt._storage.posix import PosixStore
from tests.distributed.harness import run_ranks, values
from tests.unit.test_transaction import _ctx, _save

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("DISTCKPT_EVENT_LOG", raising=False)


def test_manifest_of_1024_ranks_of_8_gib_stays_under_1_mb():
    """The save's own code (each rank's write_digests, rank 0's list_files and to_json) on 1,024
    synthetic ranks of 8 GiB in 4 files: the block digests go to the digest files, the manifest
    keeps one small entry per file."""
    workdir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    got = manifest_size(1024, 8 << 30, files_per_rank=4, workdir=workdir)
    assert got["files"] == 1024 * 5  # 4 data files and one digest file per rank
    assert got["manifest_bytes"] <= 1 << 20, got
    assert got["digest_bytes"] > 40 * got["manifest_bytes"]  # the blocks (1,024 per rank) are there


def _counting(store: PosixStore, monkeypatch) -> dict[str, int]:
    """Count what rank 0's commit and retention ask of the store and of the manifests on disk."""
    calls = {"location_of": 0, "validate": 0, "read_manifest": 0, "Manifest.read": 0}
    for name in ("location_of", "validate", "read_manifest"):  # find_committed: location_of, validate
        real = getattr(store, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(store, name, counted)
    real_read = Manifest.read.__func__  # type: ignore[attr-defined]

    def read(cls: type, path: Any) -> Manifest:
        calls["Manifest.read"] += 1
        return real_read(cls, path)

    monkeypatch.setattr(Manifest, "read", classmethod(read))
    return calls


@pytest.mark.parametrize("keep_last", [None, "k"])
def test_rank_0_commit_work_is_the_same_with_1_or_10_kept_checkpoints(tmp_path: Path, monkeypatch, keep_last) -> None:
    """A save's commit validates no kept checkpoint again (each was validated at its commit or
    by the first retention of this manager) nor re-reads their manifests, deleting or not."""
    counts = {}
    for kept in (1, 10):
        root = tmp_path / f"root{kept}"
        first = _ctx(root, [])
        for step in range(1, kept + 1):
            _save(first, step)
        ctx = _ctx(root, [], keep_last=None if keep_last is None else kept)  # a new manager's context
        _save(ctx, kept + 1)  # its first retention validates what it finds, once
        with monkeypatch.context() as mp:
            calls = _counting(ctx.store, mp)  # type: ignore[arg-type]
            _save(ctx, kept + 2)
            _save(ctx, kept + 3)
        counts[kept] = calls
        expect = list(range(1, kept + 4)) if keep_last is None else list(range(4, kept + 4))
        assert [s for s, _, r in find_committed(ctx.store) if isinstance(r, Manifest)] == expect[::-1]
    assert counts[1] == counts[10], counts
    assert counts[10]["validate"] == counts[10]["location_of"] == counts[10]["read_manifest"] == 0, counts
    assert counts[10]["Manifest.read"] <= 2, counts  # the new checkpoints' own, when deleting


def _big_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    return model, torch.optim.AdamW(model.parameters())


def test_a_flipped_byte_in_a_digest_file_is_corrupt_and_falls_back(tmp_path: Path, capsys) -> None:
    """One hex digit changed in a block digest (valid JSON, same size): verify names the digest
    file, a load raises CheckpointCorruptError naming it, and falls back to the older checkpoint."""
    model, opt = _big_model(0)
    cfg = CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None))
    saved = {}
    with CheckpointManager(cfg, model=model, optimizer=opt) as m:
        for step in (1, 2):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            m.save(step)
            saved[step] = model[0].weight.clone()
    digests = tmp_path / "step-000000002" / ".digests-rank-00000.json"
    data = bytearray(digests.read_bytes())
    at = data.index(b'"block_hashes": ["') + len(b'"block_hashes": ["')
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    digests.write_bytes(bytes(data))

    capsys.readouterr()
    assert main(["verify", str(tmp_path / "step-000000002")]) != 0
    assert ".digests-rank-00000.json" in capsys.readouterr().out

    strict = CheckpointConfig(
        root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None), load=LoadConfig(fallback_to_older=False)
    )
    with CheckpointManager(strict, model=_big_model(1)[0], optimizer=None) as m:
        with pytest.raises(CheckpointCorruptError, match=r"\.digests-rank-00000\.json") as info:
            m.load()
    assert info.value.path is not None and info.value.path.endswith(".digests-rank-00000.json")

    fresh, fresh_opt = _big_model(1)
    fallback = CheckpointConfig(
        root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None), load=LoadConfig(fallback_to_older=True)
    )
    with CheckpointManager(fallback, model=fresh, optimizer=fresh_opt) as m:
        assert m.load().step == 1
    assert torch.equal(fresh[0].weight, saved[1])


def _save_and_load_on_two(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Save with a spy on what each rank receives from the outcome exchange, then load with a spy
    on which ranks read the manifest, .metadata and the digest files."""
    received: list[Any] = []
    real_all_gather, real_gather = Collective.all_gather, Collective.gather

    def all_gather(self: Collective, obj: Any) -> list[Any]:
        out = real_all_gather(self, obj)
        received.extend(o for o in out if type(o).__name__ == "RankOutcome")
        return out

    def gather(self: Collective, obj: Any) -> list[Any] | None:
        out = real_gather(self, obj)
        received.extend(out or [])
        return out

    Collective.all_gather, Collective.gather = all_gather, gather  # type: ignore[method-assign]
    reads = {"read_manifest": 0, ".metadata": 0, "digest files": 0}
    real_manifest, real_file = PosixStore.read_manifest, PosixStore.read_file

    def read_manifest(self: Any, location: str) -> Manifest:
        reads["read_manifest"] += 1
        return real_manifest(self, location)

    def read_file(self: Any, location: str, name: str) -> bytes:
        reads[".metadata" if name == ".metadata" else "digest files"] += 1
        return real_file(self, location, name)

    PosixStore.read_manifest, PosixStore.read_file = read_manifest, read_file  # type: ignore[method-assign]
    reads["Manifest.read"] = 0
    real_read = Manifest.read.__func__  # type: ignore[attr-defined]

    def read(cls: type, path: Any) -> Manifest:
        reads["Manifest.read"] += 1
        return real_read(cls, path)

    Manifest.read = classmethod(read)  # type: ignore[method-assign,assignment]
    model, opt = _big_model(0)
    cfg = CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=None))
    with CheckpointManager(cfg, model=model, optimizer=opt) as m:
        m.save(1)
        saved_files = sorted(name for o in received for name in o.files)
    fresh, fresh_opt = _big_model(1)
    with CheckpointManager(cfg, model=fresh, optimizer=fresh_opt) as m2:
        before = dict(reads)
        step = m2.load().step
        loaded = {k: reads[k] - before[k] for k in reads}
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    return {"saved_files": saved_files, "loaded": loaded, "step": step, "same": same}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_only_rank_0_receives_the_hashes_and_reads_the_load_metadata(tmp_path: Path) -> None:
    r0, r1 = values(run_ranks(_save_and_load_on_two, 2, {"root": str(tmp_path)}, timeout_s=150))
    ckpt = tmp_path / "step-000000001"
    listed = sorted(f.path for f in Manifest.read(ckpt).files)
    assert r0["saved_files"] == listed and r1["saved_files"] == []  # rank 1 received no rank's files
    assert {".digests-rank-00000.json", ".digests-rank-00001.json"} <= set(listed)
    assert r0["loaded"]["read_manifest"] >= 1 and r0["loaded"][".metadata"] >= 1
    for r in (r0, r1):  # the digest files of the files each rank reads (both ranks read both files here)
        assert r["loaded"]["digest files"] <= 2, r["loaded"]
    no_metadata = {k: v for k, v in r1["loaded"].items() if k != "digest files"}
    assert no_metadata == dict.fromkeys(no_metadata, 0), r1["loaded"]  # not one manifest or .metadata read
    assert r0["step"] == r1["step"] == 1 and r0["same"] and r1["same"]


class _CountingStore:
    """A key-value store recording every request (the arrival check's view of the TCP store)."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*a: Any, **kw: Any) -> Any:
            self.requests += 1
            return method(*a, **kw)

        return counted


def test_a_failed_arrival_check_costs_each_rank_one_store_request_whatever_w(monkeypatch) -> None:
    """Rank 5 of 1,024 made another call and rank 7 none: the error names both, from one read of
    the arrival record (was one request per rank of the group: W^2 in all)."""
    world = 1024
    monkeypatch.setattr(collective_mod.dist, "get_global_rank", lambda group, r: r)
    store = _CountingStore()
    for r in range(world):
        if r != 7:
            store.inner.append("3/ranks", f"{r} {'load()' if r == 5 else 'save(step=2)'}\n")
    c = Collective.__new__(Collective)
    c.group, c.rank, c.world_size = object(), 0, world
    store.requests = 0
    error = c._mismatch(store, 3, "save(step=2)", timeout_s=5.0)
    assert store.requests == 1
    assert error.missing_ranks == [7] and error.other_calls == {5: "load()"}
    store.requests = 0
    assert c._ranks_without(store, 3) == [7] and store.requests == 1


def _synthetic_checkpoint(tmp_path: Path, world_size: int) -> tuple[PosixStore, str, Manifest]:
    """A pending checkpoint of ``world_size`` synthetic ranks, 2 sparse 16 MiB files each, with each
    rank's digest file written by the save's own code (as benchmarks/manifest_size.py builds it)."""
    store = PosixStore(str(tmp_path))
    pending = store.pending_location(1, "probe")
    store.begin_write(pending)
    size = 2 * MAX_BLOCK_BYTES
    reported: dict[str, Any] = {}
    for rank in range(world_size):
        written = {}
        for i in range(2):
            name = f"__{rank}_{i}.distcp"
            with open(Path(pending) / name, "wb") as f:
                f.truncate(size)
            blocks = BlockDigests((MAX_BLOCK_BYTES, size), (f"{rank:030x}{i}0", f"{rank:030x}{i}1"))
            written[name] = WrittenFile(size, f"{rank:016x}{i:016x}", blocks)
        reported.update(store.write_digests(pending, rank, written))
    manifest = Manifest(
        step=1, world_size=world_size, wrapper="fsdp2", state_dict_type="sharded", torch_version="probe",
        distckpt_version="probe", model={}, model_fingerprint="", files=store.list_files(pending, reported),
    )  # fmt: skip
    return store, pending, manifest


def test_a_load_reads_only_the_digest_files_of_the_files_it_reads(tmp_path: Path) -> None:
    """At 64 ranks, the blocks of one rank's file cost one digest file read (its writer's), not 64;
    a name no digest file covers reads the rest once; a changed digest file fails its lookup."""
    store, pending, manifest = _synthetic_checkpoint(tmp_path, 64)
    reads: list[str] = []

    def read(name: str) -> bytes:
        reads.append(name)
        return store.read_file(pending, name)

    index = DigestIndex(manifest, read, location=pending)
    blocks = index.get("__37_1.distcp")
    assert reads == [".digests-rank-00037.json"]
    assert blocks is not None and blocks.hashes == (f"{37:030x}10", f"{37:030x}11")
    assert index.get("__37_0.distcp").hashes[0] == f"{37:030x}00" and len(reads) == 1  # already read
    assert index.get(".metadata") is None and len(reads) == 64  # the others, once each
    assert index.get("__5_0.distcp").hashes[1] == f"{5:030x}01" and len(reads) == 64

    digests = Path(pending) / ".digests-rank-00009.json"
    data = bytearray(digests.read_bytes())
    at = data.index(b'"block_hashes": ["') + len(b'"block_hashes": ["')
    data[at] = ord("f") if data[at] != ord("f") else ord("e")
    digests.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"\.digests-rank-00009\.json.*changed after the commit"):
        DigestIndex(manifest, read, location=pending).get("__9_0.distcp")
