"""Block digests: recorded by the POSIX writer, kept in per-rank digest files the manifest lists
(schema 7; in the manifest itself in schemas 4-6), and used by the fast reader to read and verify
only the blocks a partial load needs."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from distckpt import CheckpointConfig, CheckpointManager, LoadConfig, ScheduleConfig
from distckpt._engine.blocking import dcp_load, dcp_save
from distckpt._engine.read import fast_reader
from distckpt._engine.read.fast_reader import FastFileSystemReader
from distckpt._errors import CheckpointCorruptError
from distckpt._ondisk.integrity import MIN_BLOCK_BYTES, BlockDigests, BlockHasher, WrittenFile, hash_file, new_hasher
from distckpt._ondisk.manifest import Manifest

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

_MIB = 1 << 20


def _digest(data: bytes) -> str:
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def test_block_hasher_cuts_around_large_writes():
    """Small writes are grouped up to MIN_BLOCK_BYTES; a large write starts its own blocks,
    cut into eighths of at least MIN_BLOCK_BYTES; every block's digest is that of its bytes."""
    small, large = b"h" * 700, bytes(range(256)) * (16 * _MIB // 256)
    writes = [small, large, small, small]
    hasher = BlockHasher()
    for w in writes:
        hasher.update(memoryview(w))
    blocks = hasher.finish()
    data = b"".join(writes)
    assert blocks.ends == (700,) + tuple(700 + 2 * _MIB * k for k in range(1, 9)) + (len(data),)
    assert blocks.valid_for(len(data))
    starts = (0,) + blocks.ends[:-1]
    assert list(blocks.hashes) == [_digest(data[a:b]) for a, b in zip(starts, blocks.ends)]


def _save(tmp_path, state) -> tuple[str, dict, dict]:
    """``dcp_save`` one file: ``(dir, expected_files, block_digests)``."""
    path = str(tmp_path / "ckpt")
    written = dcp_save(state, path, process_group=None)
    expected = {k: tuple(v) for k, v in written.items()}
    blocks = {k: v.blocks for k, v in written.items() if v.blocks is not None}
    return path, expected, blocks


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(1024, 1024, generator=g),
        "b": torch.randn(1024, 1024, generator=g),
        "c": torch.randn(1024, 512, generator=g),
        "small": torch.arange(10.0),
    }


def _load_part(path, expected, blocks, keys=("a",)) -> tuple[dict, dict]:
    target = {k: torch.full_like(v, float("nan")) for k, v in _state().items() if k in keys}
    reader = FastFileSystemReader(path, expected_files=expected, block_digests=blocks)
    from distckpt._engine.blocking import run_load

    run_load(target, reader, process_group=None, directory=path)
    return target, reader.last_stats


def test_writer_records_blocks_and_they_survive_pickling(tmp_path):
    path, expected, blocks = _save(tmp_path, _state())
    (name,) = [k for k in expected if k.endswith(".distcp")]
    size, digest = expected[name]
    assert (size, digest) == hash_file(f"{path}/{name}")
    assert blocks[name].valid_for(size) and len(blocks[name].ends) >= 3 * 4
    assert ".metadata" not in blocks  # at most MIN_BLOCK_BYTES: no block list
    entry = WrittenFile(size, digest, blocks[name])
    again = pickle.loads(pickle.dumps(entry))
    assert again == (size, digest) and again.blocks == blocks[name]


def test_partial_load_reads_only_its_blocks(tmp_path):
    state = _state()
    path, expected, blocks = _save(tmp_path, state)
    target, stats = _load_part(path, expected, blocks)
    assert torch.equal(target["a"], state["a"])
    assert stats["ranged_files"] == 1 and stats["verified_blocks"] >= 4
    assert stats["needed_bytes"] == 4 * _MIB
    # 'a' is 4 MiB of a 10 MiB file: the reader reads its blocks (plus the small ones around it).
    assert stats["read_bytes"] <= 1.05 * stats["needed_bytes"], stats
    # Without block digests the file is verified whole: all of it is read.
    _, whole = _load_part(path, expected, None)
    assert whole["ranged_files"] == 0 and whole["read_bytes"] >= 10 * _MIB


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_flipped_byte_in_a_read_block_names_file_and_range(tmp_path):
    state = _state()
    path, expected, blocks = _save(tmp_path, state)
    (name,) = blocks
    # A byte in the middle of 'a''s data, then one in 'c' (a block the load of 'a' never reads).
    a_bytes = state["a"].numpy().tobytes()
    data = open(f"{path}/{name}", "rb").read()
    at = data.index(a_bytes[:64]) + 3 * _MIB
    _flip(f"{path}/{name}", at)
    ends = blocks[name].ends
    k = next(i for i, e in enumerate(ends) if e > at)
    lo, hi = (ends[k - 1] if k else 0), ends[k]
    with pytest.raises(CheckpointCorruptError) as err:
        _load_part(path, expected, blocks)
    assert err.value.path == f"{path}/{name}"
    assert f"bytes [{lo}, {hi})" in str(err.value) and "does not match the manifest" in str(err.value)
    assert "fallback_to_older" in str(err.value)
    _flip(f"{path}/{name}", at)  # repaired
    c_at = data.index(state["c"].numpy().tobytes()[:64]) + 1000
    _flip(f"{path}/{name}", c_at)
    target, stats = _load_part(path, expected, blocks)  # 'c''s blocks are not read
    assert torch.equal(target["a"], state["a"]) and stats["ranged_files"] == 1
    with pytest.raises(CheckpointCorruptError, match="does not match"):
        _load_part(path, expected, blocks, keys=("a", "c"))


def test_mispredicted_item_is_reread_with_verified_blocks(tmp_path, monkeypatch):
    """An item decoded apart from the stream (its predicted header did not match) is read again
    with the blocks that cover it, verified, in a ranged load."""
    state = _state()
    path, expected, blocks = _save(tmp_path, state)
    monkeypatch.setattr(fast_reader.HeaderCache, "same_layout", lambda self, mv, layout: False)
    reread = []
    real = fast_reader.BlockCheck.read_verified
    monkeypatch.setattr(
        fast_reader.BlockCheck, "read_verified", lambda self, fd, off, n: reread.append(n) or real(self, fd, off, n)
    )
    target, stats = _load_part(path, expected, blocks, keys=("a", "b"))
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])
    assert stats["ranged_files"] == 1 and reread  # 'b' was predicted from 'a', then re-read


def test_manifest_keeps_blocks_and_reads_v3(tmp_path):
    """A manager's save records block digests in its digest file (schema 7); a v4 manifest holding
    them itself and a v3 manifest without them (an older distckpt's) still load, whole-file
    verified; malformed block lists are refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None))
    with CheckpointManager(cfg, model=model, optimizer=opt) as m:
        m.save(1)
    path = tmp_path / "step-000000001" / "distckpt.json"
    data = json.loads(path.read_text())
    assert data["schema_version"] == 7
    assert all("block_ends" not in f for f in data["files"])  # the manifest stays small
    digests_file = path.parent / ".digests-rank-00000.json"
    digests = json.loads(digests_file.read_bytes())["files"]
    assert [f for f in data["files"] if f["path"] == digests_file.name] == [
        {"path": digests_file.name, "size_bytes": digests_file.stat().st_size, "hash": hash_file(digests_file)[1]}
    ]
    big = {f["path"]: f["size_bytes"] for f in data["files"] if f["size_bytes"] > MIN_BLOCK_BYTES}
    big.pop(digests_file.name, None)
    assert big and sorted(digests) == sorted(big)
    assert all(digests[name]["block_ends"][-1] == size for name, size in big.items())
    assert Manifest.from_dict(json.loads(Manifest.from_dict(data).to_json())) == Manifest.from_dict(data)

    # Only the model is loaded: the files also hold the optimizer's state, so the reader reads
    # the model's blocks (the manager passes the manifest's block digests).
    stats: list[dict] = []
    real = FastFileSystemReader.read_data

    def spy(self, plan, planner):
        out = real(self, plan, planner)
        stats.append(self.last_stats)
        return out

    def fresh():
        torch.manual_seed(1)
        mod = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
        return mod, torch.optim.AdamW(mod.parameters())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FastFileSystemReader, "read_data", spy)
        mod, o = fresh()
        with CheckpointManager(
            CheckpointConfig(
                root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None), load=LoadConfig(only=["model"])
            ),
            model=mod,
            optimizer=o,
        ) as m2:
            m2.load()
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), model.state_dict().values()))
    assert stats[-1]["ranged_files"] >= 1 and stats[-1]["read_bytes"] < 1.2 * stats[-1]["needed_bytes"]

    # A v4 manifest (blocks in the manifest, no digest file) reads its blocks as before.
    v4 = dict(data, schema_version=4)
    v4["files"] = [dict(f, **digests.get(f["path"], {})) for f in data["files"] if f["path"] != digests_file.name]
    digests_file.rename(tmp_path / "digests.json")
    path.write_text(json.dumps(v4))
    assert json.loads(Manifest.from_dict(v4).to_json())["schema_version"] == 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FastFileSystemReader, "read_data", spy)
        mod, o = fresh()
        only_model = LoadConfig(only=["model"])
        cfg4 = CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None), load=only_model)
        with CheckpointManager(cfg4, model=mod, optimizer=o) as m4:
            m4.load()
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), model.state_dict().values()))
    assert stats[-1]["ranged_files"] >= 1 and stats[-1]["read_bytes"] < 1.2 * stats[-1]["needed_bytes"]
    data = v4

    old = dict(data, schema_version=3)
    old["files"] = [{k: v for k, v in f.items() if not k.startswith("block_")} for f in data["files"]]
    path.write_text(json.dumps(old))
    mod, o = fresh()
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)), model=mod, optimizer=o
    ) as m3:
        assert m3.load().step == 1
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), model.state_dict().values()))

    # Without block digests (S3 manifests, process-mode async saves) it stays a v3 manifest,
    # which an older distckpt reads.
    assert json.loads(Manifest.from_dict(old).to_json())["schema_version"] == 3

    bad = json.loads(json.dumps(data))
    bad["files"][[i for i, f in enumerate(data["files"]) if "block_ends" in f][0]]["block_ends"][-1] += 1
    with pytest.raises(CheckpointCorruptError, match="block digests of .* do not tile"):
        Manifest.from_dict(bad)


def test_block_digests_reject_bad_tilings_and_bad_types():
    x, y, z = "0" * 32, "1" * 32, "f" * 32
    assert BlockDigests((4, 8), (x, y)).valid_for(8)
    assert not BlockDigests((4, 8), (x,)).valid_for(8)
    assert not BlockDigests((4, 4, 8), (x, y, z)).valid_for(8)
    assert not BlockDigests((4, 8), (x, y)).valid_for(9)
    # Types a hand-edited manifest can carry: the manifest is at fault, not the data file.
    assert not BlockDigests((4.0, 8), (x, y)).valid_for(8)
    assert not BlockDigests((True, 8), (x, y)).valid_for(8)
    assert not BlockDigests((4, 8), (x, 7)).valid_for(8)
    assert not BlockDigests((4, 8), (x, "abc")).valid_for(8)


@pytest.mark.parametrize("field,value", [("block_hashes", "0" * 64), ("block_ends", 8)])
def test_block_lists_that_are_not_lists_are_refused(field, value):
    from distckpt._ondisk.manifest import FileEntry

    entry = FileEntry(
        path="__0_0.distcp", size_bytes=8, hash="0" * 32, block_ends=[4, 8], block_hashes=["0" * 32, "1" * 32]
    )
    assert entry.blocks().valid_for(8)
    setattr(entry, field, value)
    with pytest.raises(TypeError):
        entry.blocks()


def test_dcp_load_whole_file_path_unchanged(tmp_path):
    """Without block digests a full load reads and verifies each file whole, as before."""
    state = _state()
    path, expected, _ = _save(tmp_path, state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_load(target, path, process_group=None, expected_files=expected, fast=True)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_verify_checks_block_digests_too(tmp_path, capsys):
    """A manifest whose block list does not match bytes that match its whole-file digest is
    reported by `distckpt verify`: a load reading part of the file would refuse it."""
    from distckpt._cli import main

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)), model=model, optimizer=opt
    ) as m:
        m.save(1)
    ckpt = tmp_path / "step-000000001"
    assert main(["verify", str(ckpt)]) == 0
    path, digests_file = ckpt / "distckpt.json", ckpt / ".digests-rank-00000.json"
    digests = json.loads(digests_file.read_bytes())
    name, entry = next((n, f) for n, f in digests["files"].items() if len(f["block_hashes"]) > 1)
    entry["block_hashes"][1] = "0" * 32  # well formed, wrong
    digests_file.write_text(json.dumps(digests))
    data = json.loads(path.read_text())  # the manifest vouches for the edited digest file
    listed = next(f for f in data["files"] if f["path"] == digests_file.name)
    listed["size_bytes"], listed["hash"] = hash_file(digests_file)
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["verify", str(ckpt)]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert name in text and "block 1 of" in text and "block list is wrong" in text
