"""Incremental checkpoints (``incremental: true``): unchanged tensors are referenced in the
earlier checkpoint's files, plain ``dcp.load`` follows the references, retention and prune
defer deleting referenced checkpoints, corruption of a referenced file names both checkpoints,
and a kill during an incremental save leaves a loadable checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from distckpt import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    ConfigError,
    LoadConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
)
from distckpt._cli import main
from distckpt._engine import read_dcp_metadata
from distckpt._tools.export import export_checkpoint
from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(180)]

WIDTH = 128
S1, S2, S3 = "step-000000001", "step-000000002", "step-000000003"


class Frozen(nn.Module):
    """A frozen base (``frozen`` layers) and a trained head: the LoRA / fine-tuning shape."""

    def __init__(self, frozen: int = 8) -> None:
        super().__init__()
        self.base = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(frozen)])
        self.head = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


def setup(root, seed=0, frozen=8, on_phase=None, **cfg):
    torch.manual_seed(seed)
    model = Frozen(frozen)
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=0.01)
    config = CheckpointConfig(
        root=str(root), schedule=ScheduleConfig(interval_steps=None), **{"save": SaveConfig(incremental=True), **cfg}
    )
    return CheckpointManager(config, model=model, optimizer=optimizer, on_phase=on_phase), model, optimizer


def train(model, optimizer, steps=1):
    for _ in range(steps):
        model(torch.randn(4, WIDTH)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def run_saves(root, steps=(1, 2), frozen=8, **cfg):
    """Train one step before each save; return (model state, optimizer state) at the end."""
    manager, model, optimizer = setup(root, frozen=frozen, **cfg)
    for step in steps:
        train(model, optimizer)
        manager.save(step)
    manager.close()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state_dict()["state"].items()},
    )


def references(checkpoint_dir):
    """``{item fqn: relative path}`` of the items stored in another checkpoint's file."""
    md = read_dcp_metadata(checkpoint_dir)
    return {i.fqn: s.relative_path for i, s in md.storage_data.items() if s.relative_path.startswith("../")}


def own_bytes(checkpoint_dir):
    return sum(p.stat().st_size for p in checkpoint_dir.iterdir() if p.name != "distckpt.json")


def assert_state_equal(model, optimizer, expected):
    params, optim = expected
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    for k, s in optimizer.state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, optim[k][n]), (k, n)


@pytest.mark.parametrize("fast_load", [True, False])
def test_incremental_save_loads_bitwise_and_plain_dcp_follows_references(tmp_path, fast_load):
    expected = run_saves(tmp_path)
    refs = references(tmp_path / S2)
    frozen_keys = {f"model.base.{i}.{w}" for i in range(8) for w in ("weight", "bias")}
    assert set(refs) == frozen_keys  # every frozen tensor and nothing else
    assert all(r.startswith(f"../{S1}/") for r in refs.values())
    manifest = json.loads((tmp_path / S2 / "distckpt.json").read_text())
    assert {f["path"] for f in manifest["files"] if f["path"].startswith("../")} == set(refs.values())

    manager, model, optimizer = setup(tmp_path, seed=1, load=LoadConfig(fast_reader=fast_load))
    state = manager.load()
    manager.close()
    assert state is not None and state.step == 2
    assert_state_equal(model, optimizer, expected)

    # Stock DCP reader, no distckpt involved: follows ../step-000000001/ itself.
    plain = {f"model.{k}": torch.zeros_like(v) for k, v in expected[0].items()}
    dcp.load(plain, storage_reader=FileSystemReader(str(tmp_path / S2)), no_dist=True)
    for k, v in expected[0].items():
        assert torch.equal(plain[f"model.{k}"], v), k


def test_second_save_with_frozen_tensors_writes_little(tmp_path):
    run_saves(tmp_path, frozen=30)
    first, second = own_bytes(tmp_path / S1), own_bytes(tmp_path / S2)
    # Frozen: 30 layers; written again: the head and its two Adam moments (3 layers' worth).
    assert second / first < 0.15, (first, second)


def test_reference_points_at_the_original_file_never_a_chain(tmp_path):
    run_saves(tmp_path, steps=(1, 2, 3), retention=RetentionConfig(keep_last=None))
    refs = references(tmp_path / S3)
    assert refs and all(r.startswith(f"../{S1}/") for r in refs.values())  # not ../step-2/ -> step-1


def test_ls_size_is_what_each_checkpoint_adds_and_refs_what_it_refers_to(tmp_path, capsys):
    run_saves(tmp_path, steps=(1, 2, 3), retention=RetentionConfig(keep_last=None))
    assert main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert [rows[n]["size_bytes"] for n in (S1, S2, S3)] == [own_bytes(tmp_path / n) for n in (S1, S2, S3)]
    for name in (S1, S2, S3):
        referenced = set(references(tmp_path / name).values())
        on_disk = sum((tmp_path / name / rel).stat().st_size for rel in referenced)
        assert rows[name]["referenced_bytes"] == on_disk, name  # S1's files it refers to
    assert rows[S1]["referenced_bytes"] == 0 and rows[S2]["referenced_bytes"] > rows[S2]["size_bytes"] > 0
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[4:6] == ["SIZE", "REFS"], header  # NAME STEP TIME (UTC) SIZE REFS ...
    s2 = next(line.split() for line in lines if line.startswith(S2))
    kib = f"{own_bytes(tmp_path / S2) / 1024:.1f}"
    assert s2[3:5] == [kib, "KiB"], s2
    assert s2[5:7] == [f"{rows[S2]['referenced_bytes'] / 1024:.1f}", "KiB"], s2


def test_full_every_writes_everything_again(tmp_path):
    run_saves(
        tmp_path,
        steps=(1, 2, 3),
        retention=RetentionConfig(keep_last=None),
        save=SaveConfig(incremental=True, full_every=2),
    )
    assert references(tmp_path / S2) and not references(tmp_path / S3)


def test_unchanged_bytes_decide_not_requires_grad(tmp_path):
    """A frozen tensor changed in place (requires_grad is still False) is written again."""
    manager, model, optimizer = setup(tmp_path)
    train(model, optimizer)
    manager.save(1)
    with torch.no_grad():
        model.base[0].weight[0, 0] += 1.0
    manager.save(2)
    manager.close()
    refs = references(tmp_path / S2)
    assert "model.base.0.weight" not in refs and "model.base.1.weight" in refs
    manager, model2, optimizer2 = setup(tmp_path, seed=3)
    manager.load()
    manager.close()
    assert torch.equal(model2.base[0].weight, model.base[0].weight)


def test_retention_defers_a_referenced_checkpoint_then_deletes_it(tmp_path, capsys):
    run_saves(tmp_path, steps=(1, 2), retention=RetentionConfig(keep_last=1))
    # step 1 is past retention, but step 2 refers to its file: deferred, not deleted.
    deferred = tmp_path / S1
    assert not (deferred / "distckpt.json").exists() and (deferred / "distckpt.deferred.json").exists()
    kept = {p.name for p in deferred.iterdir()}
    assert kept == {"distckpt.deferred.json"} | {r.split("/")[-1] for r in references(tmp_path / S2).values()}
    assert main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows == {S1: "deferred", S2: "committed"}

    # Never offered for resume: with step 2 unloadable (in a copy) there is nothing to fall back to.
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy", ".lock"))
    own = min(p for p in (copy / S2).glob("*.distcp"))
    own.write_bytes(own.read_bytes()[:-1])
    manager, *_ = setup(copy, seed=1, load=LoadConfig(fallback_to_older=True))
    with pytest.raises(CheckpointCorruptError, match="no committed checkpoint"):
        manager.load()
    manager.close()
    assert (copy / S1 / "distckpt.deferred.json").exists()

    # A full save: nobody refers to step 1 any more, and step 2 is past retention.
    manager, model, optimizer = setup(
        tmp_path, seed=1, retention=RetentionConfig(keep_last=1), save=SaveConfig(incremental=True, full_every=1)
    )
    manager.load()
    train(model, optimizer)
    manager.save(3)
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [S3]


def test_prune_defers_a_referenced_checkpoint(tmp_path, capsys):
    run_saves(tmp_path, steps=(1, 2, 3), retention=RetentionConfig(keep_last=None))
    assert main(["prune", str(tmp_path), "--keep-last", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["deleted"] == [S1, S2] and data["deferred"] == [S1] and data["kept"] == [S3]
    assert not (tmp_path / S2).exists() and (tmp_path / S1 / "distckpt.deferred.json").exists()
    assert main(["verify", str(tmp_path)]) == 0  # follows step 3's references into step 1
    manager, model, optimizer = setup(tmp_path, seed=1)
    assert manager.load().step == 3
    manager.close()


def corrupt_referenced_file(root):
    ref = sorted(references(root / S2).values())[0]
    path = (root / S2 / ref).resolve()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the hash finds it
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("fast_load", [True, False])
def test_corrupt_referenced_file_names_both_checkpoints(tmp_path, fast_load, capsys):
    run_saves(tmp_path)
    path = corrupt_referenced_file(tmp_path)
    both = f"a file of checkpoint {S1}, which the incremental checkpoint {S2} being read refers to"
    manager, *_ = setup(tmp_path, seed=1, load=LoadConfig(fast_reader=fast_load))
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    manager.close()
    assert both in str(err.value) and str(path) in str(err.value)

    assert main(["verify", str(tmp_path / S2)]) == 1
    out = capsys.readouterr().out
    assert both in out and "CORRUPT" in out
    with pytest.raises(CheckpointCorruptError, match=both):
        export_checkpoint(tmp_path / S2, tmp_path / "w.safetensors")


def test_export_follows_references(tmp_path):
    params, _ = run_saves(tmp_path)
    export_checkpoint(tmp_path / S2, tmp_path / "w.safetensors", model_only=True)
    weights = load_file(tmp_path / "w.safetensors")
    assert set(weights) == set(params)
    for k, v in params.items():
        assert torch.equal(weights[k], v), k


def test_incremental_needs_a_local_root(tmp_path):
    with pytest.raises(ConfigError, match="local"):
        CheckpointConfig(root="s3://bucket/ckpt", save=SaveConfig(incremental=True))
    with pytest.raises(ConfigError, match="full_every"):
        CheckpointConfig(root=str(tmp_path), save=SaveConfig(incremental=True, full_every=0))
    with pytest.raises(ConfigError, match="incremental"):
        CheckpointConfig(root=str(tmp_path), save=SaveConfig(incremental="yes"))
    CheckpointConfig(root="s3://bucket/ckpt")  # not incremental: not refused here
    cfg = CheckpointConfig.from_dict({"root": str(tmp_path), "save": {"incremental": True, "full_every": 5}})
    assert cfg.save.incremental is True and cfg.save.full_every == 5


def save_and_die(rank, world_size, opts):
    """Save step 1 (full), then die (SIGKILL) at ``opts['phase']`` of the incremental save of step 2."""

    def hook(phase, step, rank):
        if step == opts["die_step"] and phase == opts["phase"]:
            os.kill(os.getpid(), signal.SIGKILL)

    manager, model, optimizer = setup(opts["root"], on_phase=hook, retention=RetentionConfig(keep_last=1))
    train(model, optimizer)
    manager.save(1)
    torch.save(model.state_dict(), opts["expected1"])
    train(model, optimizer)
    torch.save(model.state_dict(), opts["expected2"])
    manager.save(2)
    return "survived"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "phase,die_step,loaded_step",
    [
        ("write", 2, 1),
        ("manifest", 2, 1),
        ("rename", 2, 1),
        ("latest", 2, 2),
        ("retention", 1, 2),
    ],
)
def test_kill_during_incremental_save_leaves_a_loadable_checkpoint(tmp_path, phase, die_step, loaded_step):
    root = tmp_path / "ckpt"
    opts = {
        "root": str(root),
        "phase": phase,
        "die_step": die_step,
        "expected1": str(tmp_path / "e1.pt"),
        "expected2": str(tmp_path / "e2.pt"),
    }
    results = run_ranks(save_and_die, 1, opts, expect_death=True, timeout_s=90)
    assert results[0] is None  # killed
    manager, model, _ = setup(root, seed=1)
    state = manager.load()
    manager.close()
    assert state is not None and state.step == loaded_step
    expected = torch.load(tmp_path / f"e{loaded_step}.pt")
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k
    if loaded_step == 2:
        assert references(root / S2)  # the loaded checkpoint is the incremental one


def test_references_carry_their_owners_digest_files_and_blocks(tmp_path, capsys):
    """An incremental checkpoint refers to its owner's digest file too (schema 7: the block
    digests are no longer in the owner's manifest), so a partial read of a referenced file still
    has its blocks; a deferred owner keeps the digest file."""
    from distckpt._ondisk.manifest import Manifest
    from distckpt._storage import digest_index
    from distckpt._storage.posix import PosixStore

    expected = run_saves(
        tmp_path, frozen=30, save=SaveConfig(incremental=True, thread_count=1), retention=RetentionConfig(keep_last=1)
    )
    owner_digests = f"../{S1}/.digests-rank-00000.json"
    manifest = Manifest.read(tmp_path / S2)
    listed = {f.path: f for f in manifest.files}
    assert owner_digests in listed and json.loads((tmp_path / S2 / "distckpt.json").read_text())["schema_version"] == 7
    referenced = sorted(set(references(tmp_path / S2).values()))
    blocks = digest_index(PosixStore(str(tmp_path)), str(tmp_path / S2), manifest)
    assert referenced and all(blocks[r].ends[-1] == listed[r].size_bytes for r in referenced)
    assert (tmp_path / S1 / "distckpt.deferred.json").exists() and (tmp_path / S1 / ".digests-rank-00000.json").exists()
    assert main(["verify", str(tmp_path / S2)]) == 0
    manager, model, optimizer = setup(tmp_path, seed=1, frozen=30)
    assert manager.load().step == 2
    manager.close()
    assert_state_equal(model, optimizer, expected)
