"""The contract between distckpt and torch's private ``torch.save`` byte format, for the torch
this runs on (issue 35, item 9): the record writer writes what ``torch.save`` writes, byte for
byte, and the fast reader reads what torch's writers write, bitwise. ``make test-compat
TORCH=<version>`` runs this file under another torch; a torch on which it passes is listed in
``distckpt._engine.torch_format.internals.FORMAT_TESTED_TORCH`` (the gate: the last tests here)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from distckpt import dcp as ddcp
from distckpt._engine import writer
from distckpt._engine.blocking import dcp_load
from distckpt._engine.read.fast_reader import FastFileSystemReader, parse_torch_save_header
from distckpt._engine.safe_io import SafeFileSystemReader, SafeLoadPlanner
from distckpt._engine.torch_format import internals as torch_internals
from distckpt._engine.torch_format.record_writer import RecordTemplates, zip_crc32_off
from distckpt._storage.posix import PosixStore

CASES = {
    "float32": lambda: torch.randn(1000),
    "float16 2-D": lambda: torch.randn(7, 3, dtype=torch.float16),
    "bfloat16": lambda: torch.randn(33, dtype=torch.bfloat16),
    "float64": lambda: torch.randn(5, dtype=torch.float64),
    "int64 scalar": lambda: torch.tensor(-7),
    "int32": lambda: torch.randint(-(2**31), 2**31 - 1, (11,), dtype=torch.int32),
    "uint8": lambda: torch.randint(0, 256, (13,), dtype=torch.uint8),
    "bool": lambda: torch.rand(9) > 0.5,
    "complex64": lambda: torch.randn(4, dtype=torch.complex64),
    "transposed": lambda: torch.randn(4, 6).t().clone(),
    "requires_grad": lambda: torch.randn(5, requires_grad=True),
    "large": lambda: torch.randn(300_000),  # over 1 MiB
}


def _saved(tensor: torch.Tensor, crc32: bool) -> bytes:
    out = io.BytesIO()
    if crc32:
        torch.save(tensor, out)
    else:
        with zip_crc32_off():
            torch.save(tensor, out)
    return out.getvalue()


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    sd: dict = {name: make() for name, make in sorted(CASES.items()) if name != "requires_grad"}
    sd["w"] = torch.randn(64, 32, generator=g)
    sd["extra"] = {"step": 12, "name": "run"}
    return sd


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(_bytes(a[k]), _bytes(b[k])), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_record_writer_writes_torch_saves_bytes(name):
    templates = RecordTemplates()
    for _ in range(2):  # learnt, then reused with other values
        tensor = CASES[name]()
        head, data, tail = templates.record(tensor)
        assert data is not None, "the template applies"
        assert head + bytes(data) + tail == _saved(tensor, crc32=False)
    assert templates.fallbacks == 0


@pytest.mark.parametrize("crc32", [True, False], ids=["crc32", "no-crc32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fast_reader_parses_torch_saves_header(name, crc32):
    tensor = CASES[name]().detach()
    blob = _saved(tensor, crc32)
    layout = parse_torch_save_header(blob)
    assert layout.sig == (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
    storage = tensor.untyped_storage()
    assert layout.nbytes == storage.nbytes()
    raw = bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes())
    assert blob[layout.data_offset : layout.data_offset + layout.nbytes] == raw


@pytest.mark.parametrize("threads", [1, 2])
def test_the_fast_reader_reads_what_torchs_writer_wrote_bitwise(tmp_path, threads):
    sd = _state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, thread_count=threads))
    stock = _zeros(sd)
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path))
    fast = _zeros(sd)
    dcp.load(fast, storage_reader=FastFileSystemReader(tmp_path), planner=SafeLoadPlanner())
    _assert_bitwise(stock, sd)
    _assert_bitwise(fast, sd)


def test_the_record_writers_files_are_torchs_byte_for_byte(tmp_path, monkeypatch):
    """One writer thread each, CRC-32 off in it: distckpt's files equal DCP's own."""
    monkeypatch.setattr(writer, "format_tested", lambda: True)  # the record writer, on any torch
    calls = []
    real = writer.write_files
    monkeypatch.setattr(writer, "write_files", lambda *a, **k: calls.append(1) or real(*a, **k))
    sd = _state()
    with zip_crc32_off():  # DCP's writer serialises in the calling thread with thread_count=1
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", thread_count=1))
    dcp.save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path / "ours", thread_count=1))
    assert calls, "the record writer did not run"
    data = sorted(p.name for p in (tmp_path / "stock").glob("*.distcp"))
    assert data == sorted(p.name for p in (tmp_path / "ours").glob("*.distcp")) and data
    for name in data:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "stock" / name).read_bytes(), name
    back = _zeros(sd)
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "ours"))
    _assert_bitwise(back, sd)


def test_this_torch_is_listed_as_tested():
    assert torch_internals.format_tested(), (
        f"torch {torch.__version__}: the contract tests above pass here? Then add "
        f"{tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])} to "
        "distckpt._engine.torch_format.internals.FORMAT_TESTED_TORCH"
    )


def test_an_untested_torch_gets_the_stock_reader_and_writer_with_one_info_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch_internals, "FORMAT_TESTED_TORCH", ())
    monkeypatch.setattr(torch_internals, "_untested_logged", [])
    monkeypatch.setattr(writer, "write_files", lambda *a, **k: pytest.fail("the record writer ran"))
    caplog.set_level(logging.INFO, logger="distckpt")
    sd = _state()
    for i in range(2):
        dcp.save(sd, storage_writer=ddcp.FileSystemWriter(tmp_path / f"c{i}"))
        reader = ddcp.FileSystemReader(tmp_path / f"c{i}")
        back = _zeros(sd)
        dcp.load(back, storage_reader=reader)
        _assert_bitwise(back, sd)
        assert type(reader._inner) is SafeFileSystemReader  # noqa: SLF001 - which reader it chose
        assert (
            type(
                PosixStore(str(tmp_path)).dcp_reader(
                    str(tmp_path / "c0"), expected_files=None, fast=True, thread_count=1
                )
            )
            is SafeFileSystemReader
        )
        back = _zeros(sd)
        dcp_load(back, tmp_path / f"c{i}", process_group=None, fast=True)
        _assert_bitwise(back, sd)
    lines = [r.getMessage() for r in caplog.records if "stock DCP reader and writer" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"torch {torch.__version__}: ")
    assert not torch_internals.format_tested("2.12.0") and torch_internals.format_tested("2.13.0+cpu") is False
    monkeypatch.setattr(torch_internals, "FORMAT_TESTED_TORCH", ((2, 13),))
    assert torch_internals.format_tested("2.13.0+cpu") and torch_internals.format_tested("2.13.1")
    assert not torch_internals.format_tested("2.14.1+cu130")


def test_a_tested_torch_gets_the_fast_reader(tmp_path):
    dcp.save(_state(), storage_writer=ddcp.FileSystemWriter(tmp_path))
    assert isinstance(ddcp.FileSystemReader(tmp_path)._inner, FastFileSystemReader)  # noqa: SLF001
    assert Path(tmp_path, ".metadata").exists()
