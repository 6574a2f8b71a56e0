"""distckpt.dcp: torch's FileSystemWriter/FileSystemReader arguments and files, plus hashes
recorded while writing and verified while reading (issue 28, item 1). One process (no_dist)."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import SerializationFormat

from distckpt import dcp as ddcp
from distckpt._errors import CheckpointCorruptError
from distckpt._ondisk import dcp_hashes
from distckpt._ondisk.integrity import hash_file

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

SIDECAR = dcp_hashes.sidecar_name(".metadata")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(512, 300, generator=g),  # 600 KB
        "big": torch.randn(700, 1024, generator=g),  # 2.8 MB: block digests
        "ids": torch.randint(0, 1000, (333,), generator=g),
        "half": torch.randn(64, 8, generator=g).to(torch.bfloat16),
        "extra": {"step": 7, "name": "run-a", "lr": 0.125},
    }


def _zeros(sd: dict) -> dict:
    """Load targets: zero tensors, and for non-tensor values a placeholder of their type."""
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else _zeros(v) if isinstance(v, dict) else type(v)()
        for k, v in sd.items()
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            _assert_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def _load(path, reader) -> dict:
    out = _zeros(_state())
    dcp.load(out, storage_reader=reader)
    return out


def _storage_data(path) -> dict:
    md = dcp.FileSystemReader(path).read_metadata()
    return {k: (v.relative_path, v.offset, v.length, v.transform_descriptors) for k, v in md.storage_data.items()}


def _zstd():
    pytest.importorskip("zstandard", reason="DCP's ZStandard extension needs the zstandard package (test extra)")
    from torch.distributed.checkpoint._extension import ZStandard

    return [ZStandard()]


def test_signatures_are_torchs_with_distckpt_keywords_after():
    for ours, stock in ((ddcp.FileSystemWriter, dcp.FileSystemWriter), (ddcp.FileSystemReader, dcp.FileSystemReader)):
        theirs = list(inspect.signature(stock.__init__).parameters.values())
        mine = list(inspect.signature(ours.__init__).parameters.values())
        assert [(p.name, p.kind, p.default) for p in mine[: len(theirs)]] == [
            (p.name, p.kind, p.default) for p in theirs
        ]
        assert all(p.kind == p.KEYWORD_ONLY for p in mine[len(theirs) :])  # distckpt's own, keyword-only


OPTIONS = [
    pytest.param({}, id="defaults"),
    pytest.param(dict(single_file_per_rank=False), id="file-per-item"),
    pytest.param(dict(thread_count=3), id="threads"),
    pytest.param(dict(thread_count=3, single_file_per_rank=False), id="threads-file-per-item"),
    pytest.param(dict(sync_files=False), id="no-sync"),
    pytest.param(dict(per_thread_copy_ahead=0), id="copy-ahead-0"),
    pytest.param(dict(per_thread_copy_ahead=123), id="copy-ahead-123"),
    pytest.param(dict(overwrite=False), id="no-overwrite"),
    pytest.param("zstd", id="zstandard"),
    pytest.param(dict(serialization_format=SerializationFormat.SAFETENSORS), id="safetensors"),
]
ATTRS = ["single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead", "overwrite"]


@pytest.mark.parametrize("options", OPTIONS)
def test_every_writer_option_gives_what_stock_gives(tmp_path, monkeypatch, options):
    if options == "zstd":
        options = dict(_extensions=_zstd())
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):  # which files each writer fsyncs (DCP's: every data file and .metadata)
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sd = _state()
    runs = {}
    for name, cls in (("stock", dcp.FileSystemWriter), ("ours", ddcp.FileSystemWriter)):
        synced.clear()
        writer = cls(tmp_path / name, **options)
        dcp.save(sd, storage_writer=writer)
        runs[name] = (writer, sorted(synced), sorted(os.listdir(tmp_path / name)))
    (stock_w, stock_sync, stock_files), (our_w, our_sync, our_files) = runs["stock"], runs["ours"]
    assert [getattr(our_w, a) for a in ATTRS] == [getattr(stock_w, a) for a in ATTRS]
    assert our_w.transforms.extensions == stock_w.transforms.extensions
    assert our_w.serialization_format == stock_w.serialization_format
    # The same files (plus the sidecar), fsynced alike (plus the sidecar when sync_files).
    assert our_files == sorted(stock_files + [SIDECAR])
    sidecar_sync = [SIDECAR + ".tmp"] if options.get("sync_files", True) else []
    assert our_sync == sorted(stock_sync + sidecar_sync)
    assert len(stock_sync) == (len(stock_files) if options.get("sync_files", True) else 0)
    # The same .metadata: items, their files, offsets, lengths and transforms. (Compressed
    # lengths differ: distckpt leaves torch.save's zip CRC-32 zero, which compresses otherwise.)
    ours_sd, stock_sd = _storage_data(tmp_path / "ours"), _storage_data(tmp_path / "stock")
    if "_extensions" in options:
        ours_sd = {k: (v[0], v[3]) for k, v in ours_sd.items()}
        stock_sd = {k: (v[0], v[3]) for k, v in stock_sd.items()}
    assert ours_sd == stock_sd
    assert dcp.FileSystemReader(tmp_path / "ours").read_metadata().state_dict_metadata == (
        dcp.FileSystemReader(tmp_path / "stock").read_metadata().state_dict_metadata
    )
    if options.get("serialization_format") == SerializationFormat.SAFETENSORS:
        # torch's FileSystemReader does not read this format (HF readers do): the same sizes,
        # and the same safetensors bytes after the non-tensor items.
        for f in set(stock_files) - {".metadata"}:  # .metadata holds the path (storage_meta)
            assert (tmp_path / "ours" / f).stat().st_size == (tmp_path / "stock" / f).stat().st_size
        start = max(off + n for rel, off, n, _t in stock_sd.values() if rel == "__0_0.distcp")
        assert (tmp_path / "ours" / "__0_0.distcp").read_bytes()[start:] == (
            tmp_path / "stock" / "__0_0.distcp"
        ).read_bytes()[start:]
        return
    # Values: stock reads ours, ours reads stock and ours (verified), bitwise.
    _assert_equal(_load(None, dcp.FileSystemReader(tmp_path / "ours")), sd)
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path / "stock")), sd)
    reader = ddcp.FileSystemReader(tmp_path / "ours")
    _assert_equal(_load(None, reader), sd)
    assert reader.hashes is not None and set(reader.hashes) == set(stock_files)
    if options.get("overwrite") is False:  # a second save into the same directory: the same refusal
        errors = []
        for name, cls in (("stock", dcp.FileSystemWriter), ("ours", ddcp.FileSystemWriter)):
            with pytest.raises(BaseException) as info:
                dcp.save(sd, storage_writer=cls(tmp_path / name, **options))
            inner = [v[0] if isinstance(v, tuple) else v for v in info.value.failures.values()]
            errors.append([(type(e).__name__, str(e)) for e in inner])
        assert errors[0] == errors[1] == [("RuntimeError", "Checkpoint already exists and self.overwrite=False.")]


def test_stage_and_cache_staged_state_dict_as_stock(tmp_path):
    sd = _state()
    stock = dcp.FileSystemWriter(tmp_path / "a", cache_staged_state_dict=False)
    ours = ddcp.FileSystemWriter(tmp_path / "b", cache_staged_state_dict=False)
    for w in (stock, ours):
        w.stage(sd)
    assert ours.per_thread_copy_ahead == stock.per_thread_copy_ahead == 0
    assert ours.cache_staged_state_dict == stock.cache_staged_state_dict is False
    # True pins the staged copy (page-locked memory): on a machine without an accelerator both
    # raise the same error; with one, both keep the cache.
    outcomes = []
    for cls in (dcp.FileSystemWriter, ddcp.FileSystemWriter):
        w = cls(tmp_path / "c", cache_staged_state_dict=True)
        try:
            w.stage(sd)
            outcomes.append(("cached", w.state_dict_cache is not None))
        except RuntimeError as e:
            outcomes.append(("error", str(e)))
    assert outcomes[0] == outcomes[1]


def test_async_save_through_the_drop_in_writer(tmp_path):
    sd = _state()
    dcp.async_save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path, thread_count=2)).result()
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path)), sd)
    _assert_equal(_load(None, dcp.FileSystemReader(tmp_path)), sd)


def test_zstandard_both_ways(tmp_path):
    ext = _zstd()
    sd = _state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "stock", _extensions=ext))
    dcp.save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path / "ours", _extensions=_zstd()))
    for d in ("stock", "ours"):
        assert all(v[3] == ["stream.zstd/1"] for v in _storage_data(tmp_path / d).values())
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path / "stock")), sd)  # stock -> distckpt (fast)
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path / "stock", fast=False)), sd)
    _assert_equal(_load(None, dcp.FileSystemReader(tmp_path / "ours")), sd)  # distckpt -> stock
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path / "ours")), sd)  # verified
    # Compressed on disk: the file is smaller than the raw tensor bytes of the ids and zeros.
    z = {"z": torch.zeros(1 << 20)}
    dcp.save(z, storage_writer=ddcp.FileSystemWriter(tmp_path / "z", _extensions=_zstd()))
    assert (tmp_path / "z" / "__0_0.distcp").stat().st_size < 100_000


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def _corrupt_error(excinfo) -> CheckpointCorruptError:
    """The CheckpointCorruptError raised directly or inside DCP's CheckpointException."""
    e = excinfo.value
    if isinstance(e, CheckpointCorruptError):
        return e
    inner = [v[0] if isinstance(v, tuple) else v for v in getattr(e, "failures", {}).values()]
    found = [x for x in inner if isinstance(x, CheckpointCorruptError)]
    assert found, f"no CheckpointCorruptError in {e!r}"
    return found[0]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "item-by-item"])
def test_a_flipped_byte_in_a_data_file_is_named(tmp_path, fast):
    sd = _state()
    dcp.save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path))
    sizes = {f: hash_file(tmp_path / f) for f in os.listdir(tmp_path)}
    assert dcp_hashes.decode((tmp_path / SIDECAR).read_bytes(), "x")["__0_0.distcp"][:2] == sizes["__0_0.distcp"]
    _flip(tmp_path / "__0_0.distcp")
    with pytest.raises(BaseException) as info:
        _load(None, ddcp.FileSystemReader(tmp_path, fast=fast))
    err = _corrupt_error(info)
    assert err.path == str(tmp_path / "__0_0.distcp") and "__0_0.distcp" in str(err)
    assert "xxh3_128" in str(err) or "block" in str(err)
    # A plain DCP directory has no manifest: the message names the record it has.
    assert "the hash sidecar's" in str(err) and "manifest" not in str(err)
    # verify=False reads as stock does (the flip lands in a tensor: no error, wrong values).
    out = _load(None, ddcp.FileSystemReader(tmp_path, verify=False))
    assert not all(torch.equal(out[k], sd[k]) for k in ("w", "big", "ids", "half"))


def test_a_flipped_byte_in_metadata_and_a_damaged_sidecar_are_named(tmp_path):
    dcp.save(_state(), storage_writer=ddcp.FileSystemWriter(tmp_path))
    original = (tmp_path / ".metadata").read_bytes()
    _flip(tmp_path / ".metadata", at=0.9)
    with pytest.raises(BaseException) as info:
        _load(None, ddcp.FileSystemReader(tmp_path))
    # DCP turns a failed metadata read into an AssertionError carrying its message.
    assert f"{tmp_path / '.metadata'}: " in str(info.value) and "the hash sidecar records" in str(info.value)
    (tmp_path / ".metadata").write_bytes(original)
    (tmp_path / SIDECAR).write_text("{not json")
    with pytest.raises(BaseException) as info:
        _load(None, ddcp.FileSystemReader(tmp_path))
    assert f"{tmp_path / SIDECAR}: not valid JSON" in str(info.value)
    (tmp_path / SIDECAR).unlink()  # no sidecar: read unverified, as stock
    reader = ddcp.FileSystemReader(tmp_path)
    _assert_equal(_load(None, reader), _state())
    assert reader.hashes is None


def test_a_truncated_file_is_named(tmp_path):
    dcp.save(_state(), storage_writer=ddcp.FileSystemWriter(tmp_path, thread_count=2))
    victim = tmp_path / "__0_1.distcp"
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(BaseException) as info:
        _load(None, ddcp.FileSystemReader(tmp_path))
    assert _corrupt_error(info).path == str(victim)
    assert "hash sidecar expects" in str(_corrupt_error(info)) and "manifest" not in str(_corrupt_error(info))


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "item-by-item"])
def test_a_directory_without_sidecar_warns_once_per_load(tmp_path, caplog, fast):
    sd = _state()
    dcp.save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path))
    caplog.set_level(logging.WARNING, logger="distckpt")
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path, fast=fast)), sd)
    assert [r for r in caplog.records if "unverified" in r.getMessage()] == []  # verified: silent
    (tmp_path / SIDECAR).unlink()
    reader = ddcp.FileSystemReader(tmp_path, fast=fast)
    for n in (1, 2):  # one line per load, with the directory and the file it looked for
        _assert_equal(_load(None, reader), sd)
        lines = [r.getMessage() for r in caplog.records if "unverified" in r.getMessage()]
        assert len(lines) == n and lines[-1].startswith(f"{tmp_path}: no hash sidecar ({SIDECAR})")
    caplog.clear()
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path, verify=False)), sd)  # asked for: silent
    assert [r for r in caplog.records if "unverified" in r.getMessage()] == []


def test_an_overwritten_directory_gets_fresh_hashes(tmp_path):
    dcp.save(_state(0), storage_writer=ddcp.FileSystemWriter(tmp_path))
    dcp.save(_state(1), storage_writer=ddcp.FileSystemWriter(tmp_path))  # overwrite=True, as stock
    _assert_equal(_load(None, ddcp.FileSystemReader(tmp_path)), _state(1))


def test_reset_moves_the_reader_and_writer_like_stock(tmp_path):
    sd = _state()
    w = ddcp.FileSystemWriter(tmp_path / "first")
    dcp.save(sd, storage_writer=w, checkpoint_id=tmp_path / "second")
    assert not (tmp_path / "first").exists() and (tmp_path / "second" / SIDECAR).exists()
    r = ddcp.FileSystemReader(tmp_path / "nowhere")
    out = _zeros(sd)
    dcp.load(out, storage_reader=r, checkpoint_id=tmp_path / "second")
    _assert_equal(out, sd)
    assert r.hashes is not None and os.fspath(r.checkpoint_id) == str(tmp_path / "second")
    assert ddcp.FileSystemWriter.validate_checkpoint_id("s3://bucket/prefix")
    assert ddcp.FileSystemReader.validate_checkpoint_id(tmp_path / "x")


def test_a_save_without_rank_coordination_has_its_own_sidecar(tmp_path):
    sd = _state()
    dcp.save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path), use_collectives=False)
    assert sorted(os.listdir(tmp_path)) == ["__0.metadata", "__0.metadata.xxh3.json", "__0_0.distcp"]
    reader = ddcp.FileSystemReader(tmp_path)
    _assert_equal(_load(None, reader), sd)  # DCP falls back to the rank's own metadata
    assert reader.hashes is not None and set(reader.hashes) == {"__0.metadata", "__0_0.distcp"}
    _flip(tmp_path / "__0_0.distcp")
    with pytest.raises(BaseException) as info:
        _load(None, ddcp.FileSystemReader(tmp_path))
    assert _corrupt_error(info).path == str(tmp_path / "__0_0.distcp")
