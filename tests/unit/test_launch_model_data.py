"""Fast unit tests for the demonstration job's model (launch.model) and data (launch.data)."""

from __future__ import annotations

import math
import pathlib
import pickle
import sys

import pytest
import torch

# Make `launch` importable however pytest is invoked (it is not an installed package).
_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from launch.data import (  # noqa: E402
    ByteWindowDataset,
    corpus_fingerprint,
    stdlib_source_files,
)
from launch.model import GPT, GPTConfig, lr_lambda_warmup_cosine, num_parameters  # noqa: E402

SMALL_BYTES = 256 * 1024  # keeps dataset tests fast; same code path as the 4 MiB default


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig())


@pytest.fixture(scope="module")
def files() -> list[pathlib.Path]:
    return stdlib_source_files()


def test_param_count_defaults(model: GPT) -> None:
    n = num_parameters(model)
    assert 1_000_000 <= n <= 3_000_000, n
    # Tied head: counted once.
    assert model.lm_head.weight is model.tok_emb.weight
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 4


def test_forward_shapes_and_initial_loss(model: GPT) -> None:
    model.eval()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (3, 128), generator=g)
    tgt = torch.randint(0, 256, (3, 128), generator=g)
    logits, loss = model(idx, tgt)
    assert logits.shape == (3, 128, 256) and logits.dtype == torch.float32
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(256)) < 0.5, loss.item()
    logits2, loss2 = model(idx[:, :17])
    assert logits2.shape == (3, 17, 256) and loss2 is None
    with pytest.raises(ValueError):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_init_deterministic() -> None:
    torch.manual_seed(123)
    a = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    torch.manual_seed(123)
    b = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_dropout_train_vs_eval(model: GPT) -> None:
    assert GPTConfig().dropout > 0
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    model.train()
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx)
    assert not torch.equal(a, b)
    # Same RNG state -> same dropout masks (what exact resume relies on).
    torch.manual_seed(7)
    with torch.no_grad():
        c, _ = model(idx)
    torch.manual_seed(7)
    with torch.no_grad():
        d, _ = model(idx)
    assert torch.equal(c, d)
    model.eval()
    with torch.no_grad():
        e, _ = model(idx)
        f, _ = model(idx)
    assert torch.equal(e, f)


def test_backward_reaches_all_params() -> None:
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16))
    idx = torch.randint(0, 256, (2, 16))
    _, loss = m(idx, idx)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_stdlib_files_rule(files: list[pathlib.Path]) -> None:
    assert len(files) > 50
    assert files == stdlib_source_files()  # deterministic
    root = pathlib.Path(__import__("sysconfig").get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels)
    assert all(r.endswith(".py") for r in rels)
    for r in rels:
        parts = r.split("/")
        assert not {"site-packages", "test", "tests", "__pycache__"} & set(parts[:-1]), r
        assert parts[0] not in {"idlelib", "lib2to3", "tkinter", "turtledemo"}, r
    assert stdlib_source_files(max_files=5) == files[:5]


def test_dataset_deterministic_and_real_bytes(files: list[pathlib.Path]) -> None:
    ds1 = ByteWindowDataset(files, max_bytes=SMALL_BYTES)
    ds2 = ByteWindowDataset(files, max_bytes=SMALL_BYTES)
    assert corpus_fingerprint(ds1) == corpus_fingerprint(ds2)
    assert len(corpus_fingerprint(ds1)) == 16
    assert len(ds1.corpus) == SMALL_BYTES
    assert len(ds1) == SMALL_BYTES // 129

    # Window 0 starts with the first file's bytes; all windows are slices of the stdlib text.
    expected = b"\n".join(p.read_bytes() for p in ds1.files)[:SMALL_BYTES]
    assert ds1.files[0] == files[0]
    first = files[0].read_bytes()
    w0 = ds1[0]
    n = min(len(first), 129)
    full0 = bytes(w0["input_ids"].tolist() + [w0["targets"][-1].item()])
    assert full0[:n] == first[:n]
    assert full0 == expected[:129]
    assert bytes(ds1[0]["input_ids"].tolist()).decode("utf-8", errors="strict")[:5] == first[:5].decode()
    k = len(ds1) // 2
    wk = ds1[k]
    assert bytes(wk["input_ids"].tolist()) == expected[k * 129 : k * 129 + 128]

    # Different cap -> different fingerprint.
    assert corpus_fingerprint(ByteWindowDataset(files, max_bytes=SMALL_BYTES // 2)) != corpus_fingerprint(ds1)


def test_dataset_item_format_and_shift() -> None:
    corpus = bytes(range(256)) * 4  # 1024 bytes
    ds = ByteWindowDataset(corpus, seq_len=10, max_bytes=None)
    assert len(ds) == 1024 // 11
    for i in (0, 1, len(ds) - 1):
        item = ds[i]
        assert set(item) == {"input_ids", "targets", "sample_id"}
        x, y, sid = item["input_ids"], item["targets"], item["sample_id"]
        assert x.shape == (10,) and y.shape == (10,) and sid.shape == ()
        assert x.dtype == y.dtype == sid.dtype == torch.long
        assert sid.item() == i
        assert torch.equal(x[1:], y[:-1])
        assert x.tolist() == list(corpus[i * 11 : i * 11 + 10])
        assert y.tolist() == list(corpus[i * 11 + 1 : i * 11 + 11])
    assert ds[-1]["sample_id"].item() == len(ds) - 1
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError):
        ByteWindowDataset(b"abc", seq_len=10)


def test_dataset_default_cap_and_pickle(files: list[pathlib.Path]) -> None:
    ds = ByteWindowDataset(files)  # 4 MiB default
    assert len(ds.corpus) <= 4 * 1024 * 1024
    assert len(ds) == len(ds.corpus) // 129
    clone = pickle.loads(pickle.dumps(ds))
    assert corpus_fingerprint(clone) == corpus_fingerprint(ds)
    assert torch.equal(clone[5]["input_ids"], ds[5]["input_ids"])


def test_dataloader_collates() -> None:
    ds = ByteWindowDataset(bytes(range(256)) * 8, seq_len=16)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)))
    assert batch["input_ids"].shape == (4, 16) and batch["sample_id"].tolist() == [0, 1, 2, 3]


def test_lr_schedule() -> None:
    f = lr_lambda_warmup_cosine(10, 100, min_ratio=0.1)
    assert f(0) == 0.0
    assert f(5) == pytest.approx(0.5)
    assert [f(s) for s in range(11)] == pytest.approx([s / 10 for s in range(11)])
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5)  # cosine midpoint
    assert f(100) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)
    vals = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))  # monotone decay
    # Works with LambdaLR and its state_dict round trip.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)
    sd = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda_warmup_cosine(10, 100, 0.1))
    sched2.load_state_dict(sd)
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    with pytest.raises(ValueError):
        lr_lambda_warmup_cosine(10, 5)
