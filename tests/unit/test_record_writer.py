"""distckpt/_engine/torch_format/record_writer.py: torch.save's bytes from templates, and many small tensors
saved and loaded bitwise, readable by plain dcp.load."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from distckpt import CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig
from distckpt._engine.torch_format.record_writer import BUFFER_BYTES, GatheringWriter, RecordTemplates, zip_crc32_off
from distckpt._engine.writer import CheckedFileSystemWriter


def _torch_save(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    with zip_crc32_off():
        torch.save(tensor, out)
    return out.getvalue()


CASES = {
    "float32": lambda: torch.randn(256),
    "bfloat16 2-D": lambda: torch.randn(3, 5, dtype=torch.bfloat16),
    "int64 scalar": lambda: torch.tensor(7),
    "bool": lambda: torch.rand(9) > 0.5,
    "transposed": lambda: torch.randn(4, 6).t().clone(),  # non-contiguous strides, own storage
    "requires_grad": lambda: torch.randn(5, requires_grad=True),
    "large": lambda: torch.randn(300_000),  # over 1 MiB: its own write
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_record_is_byte_for_byte_what_torch_save_writes(name):
    templates = RecordTemplates()
    for _ in range(3):  # learnt once, then reused with other values
        tensor = CASES[name]()
        head, data, tail = templates.record(tensor)
        assert data is not None, "the template applies"
        assert head + bytes(data) + tail == _torch_save(tensor)
    assert templates.learnt == 1 and templates.fallbacks == 0


def test_tensors_the_template_cannot_describe_are_written_by_torch_save():
    templates = RecordTemplates()
    tagged = torch.randn(4)
    tagged.note = "extra attribute"  # type: ignore[attr-defined]
    for tensor in (nn.Parameter(torch.randn(4)), tagged, torch.randn(3, dtype=torch.complex64).conj(), torch.empty(0)):
        head, data, tail = templates.record(tensor)
        assert data is None and tail == b"" and head == _torch_save(tensor)
    assert templates.fallbacks == 4


def test_gathering_writer_keeps_small_writes_below_a_block_and_large_ones_whole():
    writes: list[int] = []

    class Sink:
        def write(self, data):
            writes.append(len(data))

    out = GatheringWriter(Sink())
    for _ in range(5000):
        out.write(b"h" * 100, memoryview(b"d" * 300), b"t" * 50)
    out.write(b"x" * (2 << 20))
    out.flush()
    assert out.offset == 5000 * 450 + (2 << 20) == sum(writes)
    assert writes[-1] == 2 << 20 and max(writes[:-1]) <= BUFFER_BYTES and len(writes) <= 4


class ManyParams(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(count)])


def save_and_load_many(root: str, count: int, numel: int, optimizer: bool, plain_every: int) -> None:
    """``count`` parameters (and AdamW's state): save through the manager, load into a
    perturbed copy bitwise, and read every ``plain_every``-th parameter back with plain
    ``dcp.load`` (stock DCP reads about a millisecond per item)."""
    torch.manual_seed(0)
    model = ManyParams(count, numel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    if opt is not None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    config = CheckpointConfig(
        root=root, schedule=ScheduleConfig(interval_steps=None), retention=RetentionConfig(keep_last=2)
    )
    with CheckpointManager(config, model=model, optimizer=opt) as manager:
        path = manager.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())} if opt else {}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if opt is not None:
        for s in opt.state.values():
            s["exp_avg"].zero_()
    with CheckpointManager(config, model=model, optimizer=opt) as manager:
        assert manager.load() is not None
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    if opt is not None:
        for i, s in enumerate(opt.state.values()):
            assert all(torch.equal(v, saved_opt[i][k]) for k, v in s.items())
    # Plain DCP reads the files: every model tensor, bitwise.
    plain = {f"model.{k}": torch.empty_like(v) for k, v in list(saved.items())[::plain_every]}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(plain[f"model.{k}"], saved[k]) for k in list(saved)[::plain_every])
    assert len(os.listdir(path)) >= 2


def test_three_hundred_parameters_with_adamw_save_and_load_bitwise_and_plain_dcp_reads_them(tmp_path):
    save_and_load_many(str(tmp_path), 300, 16, optimizer=True, plain_every=10)


@pytest.mark.slow
def test_ten_thousand_parameters_with_adamw_save_and_load_bitwise_and_plain_dcp_reads_them(tmp_path):
    save_and_load_many(str(tmp_path), 10_000, 256, optimizer=True, plain_every=1)


def test_templates_are_learnt_on_cpu_whatever_the_default_device():
    """A template's probe tensors are made with ``device="cpu"``: under a default device of
    "cuda" (here "meta", which breaks any tensor made without it) records are still torch.save's."""
    templates, tensor = RecordTemplates(), torch.randn(3, 5)
    saved = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        head, data, tail = templates.record(tensor)
    finally:
        torch.set_default_device(saved)
    assert data is not None and head + bytes(data) + tail == _torch_save(tensor)


class _Doubling(DefaultSavePlanner):
    """A planner overriding DCP's lookup: the record writer must resolve items through it."""

    def lookup_object(self, index):
        obj = super().lookup_object(index)
        return obj * 2 if isinstance(obj, torch.Tensor) else obj


def test_a_planner_overriding_the_lookup_is_honoured_and_plain_tensors_match_dcps_writer(tmp_path):
    torch.manual_seed(0)
    state = {"a": torch.randn(4), "b": nn.Parameter(torch.randn(3)), "c": torch.randn(2, 3).t(), "n": 5}
    dcp.save(state, storage_writer=CheckedFileSystemWriter(tmp_path / "x", thread_count=2), no_dist=True)
    loaded = {"a": torch.zeros(4), "b": torch.zeros(3), "c": torch.zeros(3, 2), "n": 0}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "x"), no_dist=True)
    assert loaded["n"] == 5 and all(torch.equal(loaded[k], state[k].detach()) for k in "abc")
    doubled = CheckedFileSystemWriter(tmp_path / "y", thread_count=1)
    dcp.save(state, storage_writer=doubled, planner=_Doubling(), no_dist=True)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "y"), no_dist=True)
    assert all(torch.equal(loaded[k], 2 * state[k].detach()) for k in "abc")
    # DCP's own writer (one torch.save per item) writes the same bytes for the plain tensors.
    stock = dcp.FileSystemWriter(str(tmp_path / "z"), thread_count=1)
    with zip_crc32_off():
        dcp.save({"a": state["a"]}, storage_writer=stock, no_dist=True)
    dcp.save({"a": state["a"]}, storage_writer=CheckedFileSystemWriter(tmp_path / "w", thread_count=1), no_dist=True)
    assert (tmp_path / "z" / "__0_0.distcp").read_bytes() == (tmp_path / "w" / "__0_0.distcp").read_bytes()


def test_small_records_are_written_in_runs_by_layout_and_load_bitwise(tmp_path, monkeypatch):
    from distckpt._engine.torch_format import record_writer

    torch.manual_seed(0)
    state: dict = {}
    for i in range(40):  # interleaved layouts, as a parameter and its optimizer state
        state |= {f"w{i}": torch.randn(256), f"step{i}": torch.tensor(float(i)), f"h{i}": torch.randn(3, 5)}
    state |= {f"mask{i}": torch.rand(9) > 0.5 for i in range(5)}
    state |= {"t": torch.randn(4, 6).t(), "big": torch.randn(300_000), "n": torch.tensor(7)}
    runs: list[int] = []
    real_write = record_writer._Run.write
    monkeypatch.setattr(record_writer, "RUN_MAX_BYTES", 16 * 1024)  # the w rows span writes
    monkeypatch.setattr(record_writer._Run, "write", lambda run, *a: runs.append(len(a[2])) or real_write(run, *a))
    dcp.save(state, storage_writer=CheckedFileSystemWriter(tmp_path / "runs", thread_count=1), no_dist=True)
    assert sorted(runs) == [5, 40, 40, 40]
    data = (tmp_path / "runs" / "__0_0.distcp").read_bytes()
    metadata = dcp.FileSystemReader(str(tmp_path / "runs")).read_metadata()
    for index, info in metadata.storage_data.items():  # each record is torch.save's bytes
        if index.fqn in state:
            assert data[info.offset : info.offset + info.length] == _torch_save(state[index.fqn]), index.fqn
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "runs"), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_frozen_parameter_is_written_as_dcps_own_writer_writes_it(tmp_path):
    torch.manual_seed(0)
    state = {"frozen": nn.Parameter(torch.randn(5), requires_grad=False), "t": torch.randn(5)}
    stock = dcp.FileSystemWriter(str(tmp_path / "stock"), thread_count=1)
    with zip_crc32_off():
        dcp.save(state, storage_writer=stock, no_dist=True)
    dcp.save(state, storage_writer=CheckedFileSystemWriter(tmp_path / "ours", thread_count=1), no_dist=True)
    assert (tmp_path / "stock" / "__0_0.distcp").read_bytes() == (tmp_path / "ours" / "__0_0.distcp").read_bytes()


@pytest.mark.parametrize(("numel", "files"), [(256, 1), (64 * 1024, 4)])
def test_small_items_are_written_into_one_file_and_large_ones_a_file_per_thread(tmp_path, numel, files):
    # Small records are Python work under the GIL that threads contend for; large ones are byte writes.
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(numel) for i in range(8)}
    dcp.save(state, storage_writer=CheckedFileSystemWriter(tmp_path, thread_count=4), no_dist=True)
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == [f"__0_{i}.distcp" for i in range(files)]
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_failed_write_in_one_of_the_writer_threads_fails_the_save_with_its_error(tmp_path, monkeypatch):
    import errno

    from distckpt._engine.writer import GuardedFileSystem

    real = GuardedFileSystem.create_stream

    def create_stream(self, path, mode):
        if str(path).endswith("__0_2.distcp"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(self, path, mode)

    monkeypatch.setattr(GuardedFileSystem, "create_stream", create_stream)
    state = {f"t{i}": torch.randn(64 * 1024) for i in range(8)}  # large items: a thread per file
    with pytest.raises(CheckpointException) as err:
        dcp.save(state, storage_writer=CheckedFileSystemWriter(tmp_path, thread_count=4), no_dist=True)
    (failure,) = err.value.failures.values()
    assert "No space left on device (injected)" in str(failure)
