"""FastFileSystemReader: bitwise equal to DCP's stock reader, partial reads, integrity errors."""

from __future__ import annotations

import contextlib
import io
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from distckpt._engine.read import fast_reader
from distckpt._engine.read.fast_reader import FastFileSystemReader, parse_torch_save_header
from distckpt._engine.safe_io import SafeLoadPlanner
from distckpt._engine.torch_format.save_format import HeaderCache, LruCache, NeedMoreBytes, UnsupportedLayout
from distckpt._errors import CheckpointCorruptError
from distckpt._ondisk.integrity import hash_file

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

SMALL_DIRECT = dict(direct_min_bytes=4096)  # forces the direct/predicted path on small items
# Small requests, more threads than files: with hashes each file is still one ordered stream.
SPARE_THREADS = dict(thread_count=3, max_request_bytes=1 << 20, chunk_bytes=1 << 20)
CONFIGS = [
    pytest.param({}, id="default"),
    pytest.param(dict(thread_count=1), id="tc1"),
    pytest.param(dict(thread_count=4, chunk_bytes=1 << 20, max_request_bytes=1 << 20), id="tc4-small-requests"),
    pytest.param(SMALL_DIRECT, id="direct-small-items"),
    pytest.param(dict(direct_min_bytes=1 << 40), id="all-through-arena"),
]


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(512, 600, generator=g) for _ in range(3)]  # 1.2 MB each: direct + predicted
    return {
        "fp32": torch.randn(10, 7, generator=g),
        "bf16": torch.randn(300, 5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(17, generator=g).to(torch.float16),
        "int64": torch.arange(100, dtype=torch.int64) * 7919,
        "int8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "bool": torch.rand(40, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "step": torch.tensor(12345, dtype=torch.int64),
        "noncontig": torch.randn(64, 32, generator=g).t(),
        "empty": torch.empty(0, 4),
        "big0": big[0],
        "big1": big[1],
        "big2": big[2],
        "big_f64": torch.randn(700, 300, generator=g, dtype=torch.float64),
        "big_bf16": torch.randn(1024, 700, generator=g).to(torch.bfloat16),
        "obj": {"epoch": 3, "name": "run-a", "lst": [1, 2.5, "x"]},
        "blob": b"\x00\x01binary\xff" * 10,
    }


def _empty_like(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 0) if v.dtype != torch.bool else torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(_bits(a[k]), _bits(b[k])), k
        else:
            assert a[k] == b[k], k


def _load(state: dict, path: Path, reader) -> dict:
    """``dcp.load`` (single process); DCP's ``CheckpointException`` (a ``BaseException``) is
    unwrapped to the reader's own error, as ``distckpt._engine.blocking.dcp_load`` does."""
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except BaseException as e:  # noqa: BLE001
        for pair in (getattr(e, "failures", None) or {}).values():
            inner = pair[0] if isinstance(pair, tuple) else pair
            if isinstance(inner, Exception):
                raise inner from e
        raise
    return state


def _data_file(path: Path) -> Path:
    files = sorted(path.glob("*.distcp"))
    assert len(files) == 1
    return files[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written by plain ``dcp.save`` (FileSystemWriter, torch.save items)."""
    path = tmp_path_factory.mktemp("ckpt")
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path, state


def _copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ============================================================================ equality
@pytest.mark.parametrize("kw", CONFIGS)
def test_bitwise_equal_to_stock_reader(saved, kw):
    path, state = saved
    stock = _load(_empty_like(state), path, FileSystemReader(str(path)))
    reader = FastFileSystemReader(path, **kw)
    fast = _load(_empty_like(state), path, reader)
    _assert_same(stock, state)
    _assert_same(fast, stock)
    # With small items on the direct path, the stored non-contiguous tensor follows contiguous
    # ones: its predicted header misses and it is decoded again the stock way (correctly).
    assert reader.last_stats["fallback_items"] <= (1 if kw == SMALL_DIRECT else 0), reader.last_stats
    assert reader.last_stats["read_bytes"] >= sum(f.stat().st_size for f in path.glob("*.distcp")) * 0.99


def test_big_items_are_read_straight_into_the_destination(saved):
    path, state = saved
    reader = FastFileSystemReader(path)
    _load(_empty_like(state), path, reader)
    big = sum(v.numel() * v.element_size() for k, v in state.items() if k.startswith("big"))
    assert reader.last_stats["direct_bytes"] == big
    # Six big items read in very few requests (headers predicted, items coalesced).
    assert reader.last_stats["syscalls"] <= 4, reader.last_stats


def test_whole_small_items_are_one_copy_each_and_other_targets_take_the_general_path(saved, monkeypatch):
    from distckpt._engine.read import item_decode

    path, state = saved
    general: list[str] = []
    real = item_decode.ItemDecoder.copy_from

    def spy(self, layout, base, off, req, base_mv=None):
        general.append(req.item.dest_index.fqn)
        return real(self, layout, base, off, req, base_mv)

    monkeypatch.setattr(item_decode.ItemDecoder, "copy_from", spy)
    target = _empty_like(state)
    target["fp32"] = torch.zeros(7, 10).t()  # a non-contiguous destination of a compact item
    _assert_same(_load(target, path, FastFileSystemReader(path)), state)
    # The stored transposed tensor is not compact; every other small item is copied whole.
    assert sorted(general) == ["fp32", "noncontig"]


@pytest.mark.parametrize("writer", ["distckpt", "stock"])
def test_equal_records_back_to_back_are_decoded_as_one_run_when_their_framing_is_equal(tmp_path, monkeypatch, writer):
    from distckpt._engine.read import item_decode
    from distckpt._engine.writer import CheckedFileSystemWriter

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64) for i in range(30)} | {f"s{i}": torch.tensor(float(i)) for i in range(30)}
    if writer == "distckpt":  # records of one layout, CRC off: one framing per run
        dcp.save(state, storage_writer=CheckedFileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    else:  # torch.save's CRC-32 differs per record: each decoded alone
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path), thread_count=1), no_dist=True)
    alone: list[str] = []
    real = item_decode.ItemDecoder.decode_whole

    def spy(self, st, mv, t=None):
        alone.append(st.reqs[0].item.dest_index.fqn)
        return real(self, st, mv, t)

    monkeypatch.setattr(item_decode.ItemDecoder, "decode_whole", spy)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["w3"] = torch.zeros(64, dtype=torch.float64)  # another dtype: copy_ converts, as DCP
    loaded = _load(target, tmp_path, FastFileSystemReader(tmp_path))
    assert all(torch.equal(loaded[k], state[k].to(loaded[k].dtype)) for k in state)
    assert len(alone) == (0 if writer == "distckpt" else len(state))


@pytest.mark.parametrize(
    "kw", [{}, SMALL_DIRECT, SPARE_THREADS], ids=["default", "direct-small-items", "spare-threads"]
)
def test_with_matching_hashes_loads_and_marks_files_verified(saved, kw):
    path, state = saved
    expected = {f.name: hash_file(f) for f in path.glob("*.distcp")}
    reader = FastFileSystemReader(path, expected_files=expected, **kw)
    _assert_same(_load(_empty_like(state), path, reader), state)
    assert reader._checked == set(expected)
    read = reader.last_stats["read_bytes"]
    # Verified once per reader: a second load reads only what it needs, without hashing.
    _assert_same(_load(_empty_like(state), path, reader), state)
    assert reader.last_stats["read_bytes"] <= read


def test_a_non_contiguous_big_tensor_is_decoded_correctly(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {
        "a": torch.randn(600, 700, generator=g),
        "t": torch.randn(800, 600, generator=g).t(),
        "b": torch.randn(600, 700, generator=g),
        "sl": torch.randn(900, 600, generator=g)[::2],
    }
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    for kw in ({}, SMALL_DIRECT, dict(thread_count=1)):
        out = _load(_empty_like(state), tmp_path, FastFileSystemReader(tmp_path, **kw))
        _assert_same(out, state)


# ============================================================================ partial reads
class _StubPlanner:
    """Resolves read items into ``dest`` the way DefaultLoadPlanner does (narrow by dest box)."""

    def __init__(self, dest: dict[str, torch.Tensor]) -> None:
        self.dest, self.committed, self.bytes = dest, [], {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        t = self.dest[item.dest_index.fqn]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.bytes[item.dest_index.fqn] = torch.load(value, weights_only=True)


def _item(fqn: str, dest: str, stored_offsets, lengths, dest_offsets=None, ndim=2) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(dest),
        dest_offsets=torch.Size(dest_offsets or [0] * ndim),
        storage_index=MetadataIndex(fqn, torch.Size([0] * ndim)),
        storage_offsets=torch.Size(stored_offsets),
        lengths=torch.Size(lengths),
    )


class _ViewsPlanner(DefaultLoadPlanner):
    """DCP's own ``resolve_tensor`` / ``commit_tensor`` over ``dest``: the fast reader resolves
    every request up front and reads in parallel (``_StubPlanner`` gets the per-item order)."""

    def __init__(self, dest: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.state_dict = dest


def _read(reader, items, dest, planner_type=_StubPlanner):
    reader.set_up_storage_reader(reader.read_metadata(), True)
    planner = planner_type(dest)
    reader.read_data(LoadPlan(items), planner).wait()
    return planner


@pytest.mark.parametrize("planner_type", [_StubPlanner, _ViewsPlanner], ids=["per-item", "up-front"])
@pytest.mark.parametrize("cold", [False, True], ids=["cached", "uncached"])
@pytest.mark.parametrize("kw", CONFIGS)
def test_partial_reads_match_stock(saved, kw, cold, monkeypatch, planner_type):
    """Resharding reads: sub-boxes of stored chunks into (views of) destinations. Uncached
    files read the bytes between needed ranges through (gaps up to ``gap_read_bytes``); cached
    ones skip them."""
    path, state = saved
    if cold:
        monkeypatch.setattr(fast_reader, "page_cached", lambda fd, start, end: False)

    def plan_and_dest():
        dest = {
            "rows": torch.zeros(100, 600),
            "cols": torch.zeros(512, 250),
            "box": torch.zeros(30, 40),
            "into": torch.zeros(200, 600),
            "convert": torch.zeros(512, 600, dtype=torch.bfloat16),
            "tdest": torch.zeros(600, 512).t(),
            "two_a": torch.zeros(300, 600),
            "two_b": torch.zeros(300, 600),
            "bf": torch.zeros(10, 700, dtype=torch.bfloat16),
            "f64": torch.zeros(700, 5, dtype=torch.float64),
            "nc": torch.zeros(10, 64),
        }
        items = [
            _item("big0", "rows", [200, 0], [100, 600]),  # contiguous sub-range: direct
            _item("big1", "cols", [0, 350], [512, 250]),  # column slice: buffer + strided copy
            _item("big2", "box", [17, 33], [30, 40]),  # box
            _item("big0", "into", [0, 0], [100, 600], [100, 0]),  # second request on big0 (no overlap)
            _item("big1", "convert", [0, 0], [512, 600]),  # dtype conversion fp32 -> bf16
            _item("big2", "tdest", [0, 0], [512, 600]),  # non-contiguous destination
            _item("big_bf16", "bf", [1000, 0], [10, 700]),  # tail rows
            _item("big_f64", "f64", [0, 295], [700, 5]),  # last columns
            _item("noncontig", "nc", [0, 0], [32, 64][::-1] and [10, 64]),  # stored non-contiguous, rows
        ]
        # Two requests over the same bytes of one stored item (overlap path).
        items += [_item("big_f64", "two_a", [100, 0], [300, 300]), _item("big_f64", "two_b", [200, 0], [300, 300])]
        dest["two_a"] = torch.zeros(300, 300, dtype=torch.float64)
        dest["two_b"] = torch.zeros(300, 300, dtype=torch.float64)
        return items, dest

    items, dest_stock = plan_and_dest()
    _read(FileSystemReader(str(path)), items, dest_stock)
    items, dest_fast = plan_and_dest()
    reader = FastFileSystemReader(path, **kw)
    planner = _read(reader, items, dest_fast, planner_type)
    for k in dest_stock:
        assert torch.equal(_bits(dest_fast[k]), _bits(dest_stock[k])), k
    assert torch.equal(dest_fast["rows"], state["big0"][200:300])
    assert torch.equal(dest_fast["cols"], state["big1"][:, 350:])
    assert torch.equal(dest_fast["two_b"], state["big_f64"][200:500, :300])
    if planner_type is _StubPlanner:
        assert len(planner.committed) == len(items)
    elif kw.get("direct_min_bytes") != 1 << 40:  # up front: big contiguous ranges straight in
        assert reader.last_stats["direct_bytes"] > 0, reader.last_stats


def test_partial_read_with_hashes_still_verifies_the_whole_file(saved, tmp_path):
    path, _ = saved
    ck = _copy_ckpt(path, tmp_path / "ck")
    f = _data_file(ck)
    expected = {f.name: hash_file(f)}
    dest = {"rows": torch.zeros(10, 600)}
    _read(FastFileSystemReader(ck, expected_files=expected), [_item("big0", "rows", [0, 0], [10, 600])], dest)
    # Flip a byte far from the 10 rows this "rank" needs: the file hash must still catch it.
    data = bytearray(f.read_bytes())
    data[-2000] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as err:
        _read(
            FastFileSystemReader(ck, expected_files=expected),
            [_item("big0", "rows", [0, 0], [10, 600])],
            {"rows": torch.zeros(10, 600)},
        )
    assert str(f) in str(err.value) and err.value.path == str(f)


# ============================================================================ planner contract
class _ScratchPlanner(SafeLoadPlanner):
    """A memory-bounded planner: ``resolve_tensor`` hands out one shared scratch buffer and
    ``commit_tensor`` copies it into the real target, which is only right when the reader
    resolves, copies and commits one item at a time (DCP's ``LoadPlanner`` contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = torch.empty(1 << 16, dtype=torch.uint8)
        self.calls: list[tuple[str, str]] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        target = super().resolve_tensor(item)
        n = target.numel() * target.element_size()
        if self.scratch.numel() < n:
            self.scratch = torch.empty(n, dtype=torch.uint8)
        self.calls.append(("resolve", item.dest_index.fqn))
        return self.scratch[:n].view(target.dtype).view(target.shape)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.calls.append(("commit", item.dest_index.fqn))
        super().resolve_tensor(item).copy_(tensor)


@pytest.mark.parametrize("kw", CONFIGS)
def test_a_planner_reusing_one_scratch_buffer_loads_bitwise(saved, kw):
    path, state = saved
    planner = _ScratchPlanner()
    out = _empty_like(state)
    dcp.load(out, storage_reader=FastFileSystemReader(path, **kw), planner=planner, no_dist=True)
    _assert_same(out, state)
    # Per item: resolve, then (after the copy) commit of that same item, before the next resolve.
    assert planner.calls[0::2] == [("resolve", k) for _, k in planner.calls[1::2]], planner.calls
    assert {k for _, k in planner.calls} == {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel()}
    if not kw:  # with the manifest's hashes: verified from the bytes the per-item path reads
        expected = {f.name: hash_file(f) for f in path.glob("*.distcp")}
        out = _empty_like(state)
        reader = FastFileSystemReader(path, expected_files=expected)
        dcp.load(out, storage_reader=reader, planner=_ScratchPlanner(), no_dist=True)
        _assert_same(out, state)
        assert reader._checked == set(expected)


class _ScratchStub(_StubPlanner):
    """``_StubPlanner`` that resolves into one shared scratch buffer and copies it into the
    destination view at commit (resharding reads through a memory-bounded planner)."""

    scratch = torch.empty(0, dtype=torch.uint8)

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        target = super().resolve_tensor(item)
        n = target.numel() * target.element_size()
        if self.scratch.numel() < n:
            self.scratch = torch.empty(n, dtype=torch.uint8)
        return self.scratch[:n].view(target.dtype).view(target.shape)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        super().resolve_tensor(item).copy_(tensor)
        super().commit_tensor(item, tensor)


@pytest.mark.parametrize("kw", CONFIGS)
def test_partial_reads_through_a_scratch_planner_match_the_saved_values(saved, kw):
    path, state = saved
    items = [
        _item("big0", "rows", [200, 0], [100, 600]),
        _item("big1", "cols", [0, 350], [512, 250]),
        _item("big2", "box", [17, 33], [30, 40]),
        _item("big0", "into", [0, 0], [100, 600], [100, 0]),
        _item("big_f64", "two_a", [100, 0], [300, 300]),
        _item("big_f64", "two_b", [200, 0], [300, 300]),
        _item("fp32", "small", [0, 0], [10, 7]),
    ]
    dest = {
        "rows": torch.zeros(100, 600),
        "cols": torch.zeros(512, 250),
        "box": torch.zeros(30, 40),
        "into": torch.zeros(200, 600),
        "two_a": torch.zeros(300, 300, dtype=torch.float64),
        "two_b": torch.zeros(300, 300, dtype=torch.float64),
        "small": torch.zeros(10, 7),
    }
    reader = FastFileSystemReader(path, **kw)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    planner = _ScratchStub(dest)
    reader.read_data(LoadPlan(items), planner).wait()
    assert torch.equal(dest["rows"], state["big0"][200:300])
    assert torch.equal(dest["cols"], state["big1"][:, 350:])
    assert torch.equal(dest["box"], state["big2"][17:47, 33:73])
    assert torch.equal(dest["into"][100:], state["big0"][:100]) and not dest["into"][:100].any()
    assert torch.equal(dest["two_a"], state["big_f64"][100:400, :300])
    assert torch.equal(dest["two_b"], state["big_f64"][200:500, :300])
    assert torch.equal(dest["small"], state["fp32"])
    assert len(planner.committed) == len(items)


# ============================================================================ integrity
def _truncate(f: Path, keep: int) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(keep)


@pytest.mark.parametrize("with_manifest", [False, True])
def test_truncated_file_raises_naming_it(saved, tmp_path, with_manifest):
    path, state = saved
    ck = _copy_ckpt(path, tmp_path / "ck")
    f = _data_file(ck)
    expected = {f.name: hash_file(f)} if with_manifest else None
    _truncate(f, f.stat().st_size // 2)
    with pytest.raises(CheckpointCorruptError) as err:
        _load(_empty_like(state), ck, FastFileSystemReader(ck, expected_files=expected))
    assert err.value.path == str(f) and str(f) in str(err.value)
    assert "truncated" in str(err.value)


def test_short_read_is_never_accepted(saved, tmp_path, monkeypatch):
    """The file shrinks after its size was checked: the read that ends early is an error."""
    path, state = saved
    ck = _copy_ckpt(path, tmp_path / "ck")
    f = _data_file(ck)
    full = f.stat().st_size
    _truncate(f, full - 5000)
    monkeypatch.setattr(fast_reader, "fstat_size", lambda fd: full)
    with pytest.raises(CheckpointCorruptError) as err:
        _load(_empty_like(state), ck, FastFileSystemReader(ck))
    assert err.value.path == str(f) and "short read" in str(err.value)


def test_flipped_byte_with_hashes_raises_naming_the_file(saved, tmp_path):
    path, state = saved
    ck = _copy_ckpt(path, tmp_path / "ck")
    f = _data_file(ck)
    expected = {f.name: hash_file(f)}
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    for kw in ({}, dict(thread_count=1), SMALL_DIRECT, SPARE_THREADS):
        with pytest.raises(CheckpointCorruptError) as err:
            _load(_empty_like(state), ck, FastFileSystemReader(ck, expected_files=expected, **kw))
        assert err.value.path == str(f) and "does not match" in str(err.value)


def test_manifest_size_mismatch_and_unlisted_file(saved):
    path, state = saved
    f = _data_file(path)
    size, digest = hash_file(f)
    with pytest.raises(CheckpointCorruptError, match="manifest expects"):
        _load(_empty_like(state), path, FastFileSystemReader(path, expected_files={f.name: (size + 1, digest)}))
    with pytest.raises(CheckpointCorruptError, match="does not list"):
        _load(_empty_like(state), path, FastFileSystemReader(path, expected_files={"other.distcp": (1, None)}))
    # A size-only entry (no digest) loads.
    out = _load(_empty_like(state), path, FastFileSystemReader(path, expected_files={f.name: (size, None)}))
    _assert_same(out, state)


def test_missing_data_file_raises(saved, tmp_path):
    path, state = saved
    ck = _copy_ckpt(path, tmp_path / "ck")
    f = _data_file(ck)
    f.unlink()
    with pytest.raises(CheckpointCorruptError) as err:
        _load(_empty_like(state), ck, FastFileSystemReader(ck))
    assert err.value.path == str(f)


# ============================================================================ transforms, parser
class _ZlibExtension(StreamTransformExtension):
    """A stream transform (like DCP's ZStandard) so items carry transform descriptors."""

    @staticmethod
    def registry_name() -> str:
        return "test.zlib"

    @staticmethod
    def from_descriptor(version: str) -> "_ZlibExtension":
        return _ZlibExtension()

    def get_descriptor(self) -> str:
        return "test.zlib/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def __init__(self) -> None:
                self.z = zlib.compressobj()

            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                output.write(self.z.compress(bytes(b)))
                return len(b)

            def close(self) -> None:
                if not self.closed:
                    output.write(self.z.flush())
                super().close()

        return Writer()

    def transform_from(self, input):
        return io.BytesIO(zlib.decompress(input.read()))


def test_items_with_transform_descriptors_take_the_stock_decode(tmp_path):
    state = {k: v for k, v in _state().items() if k in ("fp32", "bf16", "big0", "obj", "scalar")}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path), _extensions=[_ZlibExtension()]), no_dist=True)
    registry = ExtensionRegistry()
    registry.register(_ZlibExtension)
    stock = _load(_empty_like(state), tmp_path, FileSystemReader(str(tmp_path), _extension_registry=registry))
    reader = FastFileSystemReader(tmp_path, _extension_registry=registry)
    fast = _load(_empty_like(state), tmp_path, reader)
    _assert_same(stock, state)
    _assert_same(fast, state)
    assert reader.last_stats["fallback_items"] == 4  # every tensor item (the bytes item is not counted)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        torch.tensor(2.5, dtype=torch.float64),
        torch.randn(5, 6, 7).to(torch.bfloat16)[:, 1:3],
        torch.zeros(0, 3, dtype=torch.int32),
        torch.nn.Parameter(torch.ones(4, 4)),
        torch.arange(10, dtype=torch.uint8),
        torch.ones(3, dtype=torch.complex64),
    ],
    ids=["transposed", "scalar", "sliced-bf16", "empty", "parameter", "uint8", "complex"],
)
def test_parse_header_locates_the_storage_bytes(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    blob = buf.getvalue()
    layout = parse_torch_save_header(blob)
    storage = t.detach().untyped_storage()
    assert layout.nbytes == storage.nbytes()
    raw = bytes(blob[layout.data_offset : layout.data_offset + layout.nbytes])
    assert raw == bytes(storage)
    m = layout.meta
    assert (m.dtype, m.shape, m.stride(), m.storage_offset()) == (t.dtype, t.shape, t.stride(), t.storage_offset())
    # Any prefix that stops before the data is "need more", never a wrong answer.
    with pytest.raises(NeedMoreBytes):
        parse_torch_save_header(blob[: layout.data_offset - 1])


def test_parse_header_refuses_code_in_the_pickle():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    buf = io.BytesIO()
    torch.save(Evil(), buf)
    with pytest.raises(UnsupportedLayout):
        parse_torch_save_header(buf.getvalue())


def test_cached_header_parse_equals_the_full_parse_and_is_shared_by_equal_headers():
    cache = HeaderCache()

    def blob(t: torch.Tensor) -> memoryview:
        buf = io.BytesIO()
        torch.save(t, buf)
        return memoryview(buf.getvalue())

    a, b = blob(torch.arange(7, dtype=torch.float32)), blob(torch.ones(7))
    c, d = blob(torch.zeros(3, 5, dtype=torch.bfloat16)), blob(torch.arange(9, dtype=torch.int64))
    for mv in (a, b, c, d):
        cached, full = cache.parse(mv), parse_torch_save_header(mv)
        assert (cached.data_offset, cached.nbytes, cached.flags, cached.sig) == (
            full.data_offset,
            full.nbytes,
            full.flags,
            full.sig,
        )
    assert cache.parse(b) is cache.parse(a)  # same dtype and shape
    assert cache.parse(c).sig != cache.parse(a).sig
    with pytest.raises(NeedMoreBytes):
        cache.parse(blob(torch.ones(11))[:64])  # a header cut short is never served


def test_header_caches_are_per_reader_and_bounded(saved):
    """Parse caches live on the reader (none at module level, shared by every reader), each
    bounded; a cache far smaller than the checkpoint's distinct headers still loads bitwise."""
    from distckpt._engine.read import item_decode, item_planner, read_stream
    from distckpt._engine.torch_format import save_format as torch_save_format

    for mod in (fast_reader, item_decode, item_planner, read_stream, torch_save_format):
        shared = [
            n
            for n, v in vars(mod).items()
            if isinstance(v, (dict, list, set)) and not (n.startswith("__") and n.endswith("__"))
        ]
        assert shared == [], f"{mod.__name__}: module-level mutable state {shared}"
    path, state = saved
    tiny = FastFileSystemReader(path, **SMALL_DIRECT)
    tiny.header_cache = HeaderCache(max_entries=2)
    other = FastFileSystemReader(path, **SMALL_DIRECT)
    _assert_same(_load(_empty_like(state), path, tiny), state)
    caches = [
        tiny.header_cache.pickles,
        tiny.header_cache.layouts,
        tiny.header_cache.heads,
        tiny.header_cache.predicted,
    ]
    assert all(len(c) <= 2 for c in caches) and len(tiny.header_cache.pickles) == 2
    assert [len(c) for c in (other.header_cache.pickles, other.header_cache.layouts)] == [0, 0]  # not shared
    _assert_same(_load(_empty_like(state), path, other), state)
    assert len(other.header_cache.pickles) > 2 and len(other.header_cache.predicted) > 0


def test_lru_cache_forgets_the_least_recently_used():
    cache = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recently used
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b", "gone"), cache.get("c"), len(cache)) == (1, "gone", 3, 2)
    with pytest.raises(ValueError):
        LruCache(0)


# ============================================================================ zip CRC off
def test_distckpt_writer_skips_zip_crc_and_every_reader_still_loads(tmp_path):
    """distckpt's writer switches torch.save's CRC-32 off (xxh3 covers the files); torch.load,
    the stock reader and the fast reader (no fallback) all read such files, and the user's
    own CRC setting is back afterwards."""
    import zipfile

    from distckpt._engine.writer import CheckedFileSystemWriter

    state = _state()
    path = tmp_path / "ckpt"
    assert torch.serialization.get_crc32_options()
    dcp.save(state, storage_writer=CheckedFileSystemWriter(path, thread_count=2), no_dist=True)
    assert torch.serialization.get_crc32_options()  # restored
    # Each tensor item is a torch.save zip whose records all carry CRC 0.
    storage = FileSystemReader(str(path)).read_metadata().storage_data
    for info in storage.values():
        blob = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        if blob[:2] == b"PK":
            assert {i.CRC for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()} == {0}
    _assert_same(_load(_empty_like(state), path, FileSystemReader(str(path))), state)
    reader = FastFileSystemReader(path, direct_min_bytes=4096)
    _assert_same(_load(_empty_like(state), path, reader), state)
    assert reader.last_stats["fallback_items"] <= 1, reader.last_stats  # as with CRC on (see above)


@contextlib.contextmanager
def _default_device(device: str):
    saved = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(saved)


@pytest.mark.parametrize("kw", CONFIGS)
def test_reads_create_their_buffers_on_cpu_whatever_the_default_device(saved, kw, monkeypatch):
    """Under ``torch.set_default_device("cuda")`` a buffer made without ``device=`` would be a
    CUDA tensor (issue 35, item 8); "meta" stands in for it here: any such buffer breaks the read."""
    real = FastFileSystemReader.read_data

    def guarded(self, plan, planner):
        with _default_device("meta"):
            return real(self, plan, planner)

    monkeypatch.setattr(FastFileSystemReader, "read_data", guarded)
    test_bitwise_equal_to_stock_reader(saved, kw)
    for planner_type in (_StubPlanner, _ViewsPlanner):  # resharding: ranged reads into buffers
        test_partial_reads_match_stock(saved, kw, True, monkeypatch, planner_type)
