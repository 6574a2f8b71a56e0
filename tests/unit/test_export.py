"""Export (checkpoint -> one safetensors / torch.save file) and import (weights -> checkpoint),
in one process without a process group; resharded checkpoints come from 2 gloo ranks."""

from __future__ import annotations

import os
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from distckpt import CheckpointConfig, CheckpointCorruptError, CheckpointManager, ScheduleConfig
from distckpt._errors import CheckpointNotFoundError, ConfigError
from distckpt._ondisk.manifest import Manifest
from distckpt._tools.compare import max_abs_diff
from distckpt._tools.export import export_checkpoint, import_weights
from distckpt._tools.reader import CheckpointReader
from distckpt._tools.single_file import SafetensorsWriter, TorchZipWriter
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import Net, build, full_params, save_after, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def trained_checkpoint(root, steps=3, **opts):
    """A step-``steps`` checkpoint of the tiny trainer; returns (dir, model, optimizer)."""
    model, optimizer, scheduler, scaler, loader = build(0, 1, opts)
    manager = CheckpointManager(
        CheckpointConfig(root=str(root), schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
    )
    train_steps(model, optimizer, scheduler, scaler, loader, steps)
    path = manager.save(steps, loss=0.25)
    manager.close()
    return Path(path), model, optimizer


def checkpoint_tensors(path):
    reader = CheckpointReader(path)
    return {k: v for k, v in reader.iter_read(reader.keys()) if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("dtype,torch_dtype", [(None, None), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_equals_checkpoint_after_cast(tmp_path, fmt, dtype, torch_dtype):
    path, model, optimizer = trained_checkpoint(tmp_path / "ckpt")
    out = tmp_path / f"out.{fmt}"
    result = export_checkpoint(path, out, format=fmt, dtype=dtype)
    loaded = load_file(out) if fmt == "safetensors" else torch.load(out, weights_only=True)
    expected = checkpoint_tensors(path)
    assert result.num_tensors == len(expected) and result.size_bytes == out.stat().st_size
    for key, tensor in expected.items():
        want = tensor.to(torch_dtype) if torch_dtype is not None and key.startswith("model.") else tensor
        assert loaded[key].dtype == want.dtype and torch.equal(loaded[key], want), key
    # The checkpoint's tensors are the live model's: the export is the model cast.
    for fqn, param in model.state_dict().items():
        assert torch.equal(loaded[f"model.{fqn}"], param.to(torch_dtype or param.dtype))
    assert loaded["optim.state.inp.weight.exp_avg"].dtype == torch.float32  # only model tensors cast
    if fmt == "safetensors":
        assert "train_state" in result.skipped and "train_state" not in loaded
    else:
        assert result.skipped == [] and isinstance(loaded["train_state"], bytes)
        assert loaded["optim.param_groups.0.lr"] == optimizer.param_groups[0]["lr"]
        assert zipfile.ZipFile(out).testzip() is None  # every CRC-32 patched
        mapped = torch.load(out, weights_only=True, mmap=True)
        assert torch.equal(mapped["model.inp.weight"], loaded["model.inp.weight"])


def test_model_only_keys_and_overwrite(tmp_path):
    path, model, _ = trained_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "m.safetensors"
    export_checkpoint(path, out, model_only=True, dtype="bf16")
    loaded = load_file(out)
    assert sorted(loaded) == sorted(model.state_dict())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_checkpoint(path, out, model_only=True)
    export_checkpoint(path, out, model_only=True, dtype="fp32", overwrite=True)
    assert load_file(out).keys() == loaded.keys()
    assert load_file(out)["inp.weight"].dtype == torch.float32
    export_checkpoint(path, tmp_path / "m.pt", model_only=True, format="torch")
    assert sorted(torch.load(tmp_path / "m.pt", weights_only=True)) == sorted(model.state_dict())
    assert not list(tmp_path.glob(".m.*.tmp-*"))


@pytest.mark.multiprocess
def test_export_of_a_sharded_fsdp2_checkpoint_assembles_full_tensors(tmp_path):
    opts = {"root": str(tmp_path / "ckpt"), "wrapper": "fsdp2", "steps": 2, "with_loader": False}
    out = values(run_ranks(save_after, 2, opts))
    path = tmp_path / "ckpt" / "step-000000002"
    assert {p.name.split("_")[2] for p in path.glob("*.distcp")} == {"0", "1"}  # written by both ranks
    reader = CheckpointReader(path)
    assert reader.items["model.hidden.weight"].shards == 2
    export_checkpoint(path, tmp_path / "w.safetensors", model_only=True)
    loaded = load_file(tmp_path / "w.safetensors")
    for fqn, tensor in out[0]["params"].items():
        assert torch.equal(loaded[fqn], tensor), fqn


def test_export_refuses_a_damaged_file(tmp_path):
    path, *_ = trained_checkpoint(tmp_path / "ckpt")
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as err:
        export_checkpoint(path, tmp_path / "x.safetensors")
    assert err.value.path == str(data)
    assert not (tmp_path / "x.safetensors").exists()


def test_writers_handle_odd_tensors(tmp_path):
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "ints": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(3, 2).bfloat16(),
        "strided": torch.randn(4, 6).t(),
    }
    entries = [(k, list(v.shape), v.dtype) for k, v in tensors.items()]
    with open(tmp_path / "a.safetensors", "wb") as f:
        writer = SafetensorsWriter(f, entries, {"note": "x"})
        for k, v in tensors.items():
            writer.write(k, v)
        writer.close()
    writer = TorchZipWriter(tmp_path / "a.pt", entries, {"meta": {"step": 3, "names": ["a"]}})
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    st, pt = load_file(tmp_path / "a.safetensors"), torch.load(tmp_path / "a.pt", weights_only=True)
    for k, v in tensors.items():
        assert torch.equal(st[k], v) and torch.equal(pt[k], v), k
    assert pt["meta"] == {"step": 3, "names": ["a"]}
    with open(tmp_path / "b.safetensors", "wb") as f:
        writer = SafetensorsWriter(f, entries)
        with pytest.raises(ValueError, match="expected tensor 'scalar'"):
            writer.write("ints", tensors["ints"])
        with pytest.raises(ValueError, match="only 0 of 6"):
            writer.close()


def test_max_abs_diff_semantics():
    nan, inf = float("nan"), float("inf")
    assert max_abs_diff(torch.tensor([1.0, nan, inf]), torch.tensor([1.0, nan, inf])) == 0.0
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0])) == 0.5
    assert max_abs_diff(torch.tensor([nan]), torch.tensor([0.0])) == inf
    assert max_abs_diff(torch.arange(5), torch.arange(5) + 2) == 2.0


# ---------------------------------------------------------------------------------- import
@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_import_then_manager_load_gives_identical_weights(tmp_path, kind):
    torch.manual_seed(1)
    source = Net()
    weights = {k: v.clone() for k, v in source.state_dict().items()}
    path = tmp_path / f"w.{kind}"
    save_file(weights, path) if kind == "safetensors" else torch.save(weights, path)
    ckpt = import_weights(path, tmp_path / "root")
    assert ckpt == str(tmp_path / "root" / "step-000000000")
    torch.manual_seed(2)
    model = Net()
    state = CheckpointManager(CheckpointConfig(root=str(tmp_path / "root")), model=model, optimizer=None).load()
    assert state.step == 0 and state.saved_world_size == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    # The import is itself a checkpoint: export gives the file back.
    export_checkpoint(ckpt, tmp_path / "back.safetensors", model_only=True)
    back = load_file(tmp_path / "back.safetensors")
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)


def test_import_is_committed_as_a_training_save(tmp_path):
    """The import is CheckpointManager.save on one rank: its manifest is a training save's of the same
    weights but for the random and timed fields, and the process is left as it was."""
    torch.manual_seed(4)
    model = Net()
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    rng = torch.get_rng_state()
    imported = Manifest.read(import_weights(tmp_path / "w.safetensors", tmp_path / "root"))
    assert not dist.is_initialized() and torch.equal(torch.get_rng_state(), rng)  # its gloo group is gone
    config = CheckpointConfig(root=str(tmp_path / "trained"), save={"state_dict_type": "full"})
    with CheckpointManager(config, model=model, optimizer=None) as manager:
        trained = Manifest.read(manager.save(0))
    assert imported.hardware == trained.hardware and imported.hardware["cpu_count"] == os.cpu_count()
    assert len(imported.run_id) == 16 and imported.run_id != trained.run_id  # the tracker run id of a fresh run
    random_or_timed = ("files", "run_id", "timings_s", "wall_time")
    assert {k: v for k, v in asdict(imported).items() if k not in random_or_timed} == {
        k: v for k, v in asdict(trained).items() if k not in random_or_timed
    }
    assert [f.path for f in imported.files] == [f.path for f in trained.files]


def _import_in_a_job(rank, world_size, tmp):
    try:
        import_weights(os.path.join(tmp, "w.safetensors"), os.path.join(tmp, f"root{rank}"))
    except ConfigError as e:
        return str(e)


@pytest.mark.multiprocess
def test_import_inside_a_multi_rank_job_is_refused(tmp_path):
    save_file(Net().state_dict(), tmp_path / "w.safetensors")
    errors = values(run_ranks(_import_in_a_job, 2, str(tmp_path), timeout_s=60))
    assert all("torch.distributed is initialised with 2 ranks" in e and "a process of its own" in e for e in errors)
    assert not any(p.name.startswith("root") for p in tmp_path.iterdir())  # nothing written


def _load_imported(rank, world_size, opts):
    from tests.distributed.trainer import build as build_model

    model = build_model(rank, world_size, {"wrapper": opts["wrapper"], "global_batch_size": 12})[0]
    manager = CheckpointManager(CheckpointConfig(root=opts["root"]), model=model, optimizer=None)
    state = manager.load()
    manager.close()
    return {"step": state.step, "params": full_params(model)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("wrapper,world_size", [("fsdp2", 3)])
def test_import_loads_under_any_wrapper_and_world_size(tmp_path, wrapper, world_size):
    torch.manual_seed(3)
    weights = Net().state_dict()
    save_file(weights, tmp_path / "w.safetensors")
    import_weights(tmp_path / "w.safetensors", tmp_path / "root")
    results = values(run_ranks(_load_imported, world_size, {"root": str(tmp_path / "root"), "wrapper": wrapper}))
    assert [r["step"] for r in results] == [0] * world_size
    assert results[0]["params"].keys() == weights.keys()
    for result in results:  # FULL state dicts with cpu_offload: rank 0 only under FSDP2
        for k, v in result["params"].items():
            assert torch.equal(v, weights[k]), k


def test_import_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        import_weights(tmp_path / "absent.safetensors", tmp_path / "root")
    torch.save({"state_dict": Net().state_dict()}, tmp_path / "nested.pt")
    with pytest.raises(ValueError, match="nested state dict"):
        import_weights(tmp_path / "nested.pt", tmp_path / "root")
    (tmp_path / "junk.bin").write_bytes(b"not weights at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        import_weights(tmp_path / "junk.bin", tmp_path / "root")
    save_file(Net().state_dict(), tmp_path / "w.safetensors")
    import_weights(tmp_path / "w.safetensors", tmp_path / "root")
    with pytest.raises(ConfigError, match="holds 1 checkpoint.*newest step-000000000"):
        import_weights(tmp_path / "w.safetensors", tmp_path / "root")
    (tmp_path / "other" / "step-000000000").mkdir(parents=True)  # not distckpt's: never replaced
    with pytest.raises(FileExistsError, match="step-000000000 already exists"):
        import_weights(tmp_path / "w.safetensors", tmp_path / "other")
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith(".pending")]
