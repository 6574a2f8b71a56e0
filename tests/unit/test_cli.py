"""The ``distckpt`` CLI, called as ``main([...])`` on checkpoints made by CheckpointManager in
this process: output content (``--json`` parsed), exit codes, damage detection, unsafe pickles."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    RetentionConfig,
    ScheduleConfig,
)
from distckpt._cli import main
from distckpt._cli.main import COMMANDS
from distckpt._ondisk.integrity import hash_file
from distckpt._ondisk.manifest import Manifest
from distckpt._tools.export import export_checkpoint
from distckpt._tools.release import release_checkpoint
from tests.distributed.trainer import Net, build, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def make_root(root, steps=(2, 4), width=16, extra=True, shift=0.0):
    """Checkpoints of the tiny trainer at ``steps`` (loss = step / 10); returns the model.
    ``shift`` is added to the initial weights (another run with files of the same sizes)."""
    model, optimizer, scheduler, scaler, loader = build(0, 1, {"width": width})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    manager = CheckpointManager(
        CheckpointConfig(
            root=str(root), schedule=ScheduleConfig(interval_steps=None), retention=RetentionConfig(keep_last=None)
        ),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
        extra_state={"note": {"run": "cli-test"}} if extra else None,
    )
    done = 0
    for step in steps:
        train_steps(model, optimizer, scheduler, scaler, loader, step - done)
        manager.save(step, loss=step / 10)
        done = step
    manager.close()
    return model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    make_root(root)
    return root


@pytest.fixture
def root(pristine, tmp_path):
    """A private copy of a root with step-2 and step-4 checkpoints."""
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out)


# ---------------------------------------------------------------------------------- ls
def test_ls_lists_every_checkpoint_with_status(root, capsys):
    staging = root / ".pending-step-000000006-abc123"
    staging.mkdir()
    code, data = run_json(capsys, "ls", root)
    assert code == 0
    rows = {r["name"]: r for r in data["checkpoints"]}
    assert list(rows) == ["step-000000002", "step-000000004", staging.name]
    s4 = rows["step-000000004"]
    manifest = Manifest.read(root / "step-000000004")
    assert s4["status"] == "committed" and s4["latest"] and not rows["step-000000002"]["latest"]
    assert (s4["step"], s4["world_size"], s4["state_dict_type"], s4["wrapper"]) == (4, 1, "sharded", "plain")
    assert s4["loss"] == pytest.approx(0.4) and s4["size_bytes"] == sum(f.size_bytes for f in manifest.files)
    assert s4["time"].endswith("Z")
    assert rows[staging.name]["status"] == "pending"

    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    assert out.splitlines()[0].split() == [
        "NAME",
        "STEP",
        "TIME",
        "(UTC)",
        "SIZE",
        "REFS",
        "WORLD",
        "TYPE",
        "WRAPPER",
        "LOSS",
        "METRICS",
        "STATUS",
    ]
    line = next(line for line in out.splitlines() if line.startswith("step-000000004"))
    assert "*" in line and "committed" in line and "sharded" in line and "0.4" in line


def test_ls_shows_a_truncated_checkpoint_as_corrupt(root, capsys):
    data = next((root / "step-000000004").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-7])
    code, listing = run_json(capsys, "ls", root)
    row = next(r for r in listing["checkpoints"] if r["name"] == "step-000000004")
    assert code == 0 and row["status"] == "corrupt" and str(data) in row["reason"]
    code, out, _ = run(capsys, "ls", root)
    assert f"step-000000004: {data}" in out


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "prune"])
def test_missing_path_is_one_line_and_exit_2(tmp_path, capsys, command):
    extra = ["--keep-last", "1"] if command == "prune" else []
    code, out, err = run(capsys, command, tmp_path / "nope", *extra)
    assert code == 2 and out == ""
    assert err.startswith(f"distckpt {command}: error: ") and str(tmp_path / "nope") in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_not_a_checkpoint_exits_2(tmp_path, capsys, command):
    (tmp_path / "empty").mkdir()
    extra = [tmp_path / "out.safetensors"] if command == "export" else []
    code, _, err = run(capsys, command, tmp_path / "empty", *extra)
    assert code == 2 and "not a checkpoint" in err


def test_ls_of_a_checkpoint_dir_points_to_inspect(root, capsys):
    code, _, err = run(capsys, "ls", root / "step-000000002")
    assert code == 2 and "distckpt inspect" in err


def test_debug_reraises(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        main(["ls", str(tmp_path / "nope"), "--debug"])
    with pytest.raises(CheckpointNotFoundError):
        main(["--debug", "verify", str(tmp_path / "nope")])


@pytest.mark.parametrize("module", COMMANDS, ids=lambda m: m.NAME)
def test_every_help_has_an_example(capsys, module):
    code, out, _ = run(capsys, module.NAME, "--help")
    assert code == 0 and "example" in out and f"distckpt {module.NAME} " in out


def test_usage_error_exits_2(capsys):
    code, _, err = run(capsys, "prune", "/tmp")
    assert code == 2 and "--keep-last" in err


@pytest.mark.multiprocess
@pytest.mark.parametrize("module", ["distckpt", "distckpt._cli"])
def test_python_dash_m(root, module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "ls", str(root), "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["checkpoints"]) == 2


# ---------------------------------------------------------------------------------- inspect
def test_inspect_groups_and_summary(root, capsys):
    code, data = run_json(capsys, "inspect", root / "step-000000004")
    assert code == 0
    assert data["manifest"]["step"] == 4 and data["manifest"]["loss"] == pytest.approx(0.4)
    on_disk = [p for p in (root / "step-000000004").iterdir() if p.name != "distckpt.json"]
    assert data["manifest"]["world_size"] == 1 and data["manifest"]["files"] == len(on_disk) >= 2
    groups = data["groups"]
    assert list(groups) == ["model", "optimizer", "dataloader", "rng", "extra", "other"]
    model = {e["key"]: e for e in groups["model"]["entries"]}
    for fqn, param in Net().state_dict().items():
        entry = model[f"model.{fqn}"]
        assert entry["shape"] == list(param.shape) and entry["dtype"] == "torch.float32"
        assert entry["size_bytes"] == param.numel() * 4 and entry["kind"] == "tensor"
    assert groups["model"]["size_bytes"] == sum(p.numel() * 4 for p in Net().state_dict().values())
    optim = {e["key"] for e in groups["optimizer"]["entries"]}
    assert "optim.state.inp.weight.exp_avg" in optim and "optim.param_groups.0.lr" in optim
    assert {e["key"] for e in groups["dataloader"]["entries"]} == {"data", "rank_state.rank0.dataloader"}
    assert {e["key"] for e in groups["rng"]["entries"]} == {"rank_state.rank0.rng"}
    assert {e["key"] for e in groups["extra"]["entries"]} == {"extra.note"}
    assert {e["key"] for e in groups["other"]["entries"]} == {"train_state", "lr_scheduler", "grad_scaler"}

    code, out, _ = run(capsys, "inspect", root, "--group", "model")  # a root: its newest checkpoint
    assert code == 0 and "step-000000004" in out and "step 4" in out
    assert "model.hidden.weight  16x16  float32  1.0 KiB" in " ".join(out.split("\n"))
    assert "optimizer:" not in out


def test_inspect_plain_dcp_directory(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3, 2)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    code, data = run_json(capsys, "inspect", tmp_path / "plain")
    assert code == 0 and data["manifest"] is None
    assert data["groups"]["other"]["entries"][0]["shape"] == [3, 2]


# ---------------------------------------------------------------------------------- verify
def test_verify_ok(root, capsys):
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and out.count("ok ") == 2
    code, data = run_json(capsys, "verify", root / "step-000000002")
    assert code == 0 and data["ok"] and data["checkpoints"][0]["problems"] == []


def _flip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _damage(root, kind, other):
    ckpt = root / "step-000000004"
    data = next(ckpt.glob("*.distcp"))
    if kind == "flip":
        _flip(data)
        return data
    if kind == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
        return data
    if kind == "swap":  # same name, same size, from another run's checkpoint
        swapped = next((other / "step-000000004").glob("*.distcp"))
        assert swapped.stat().st_size == data.stat().st_size
        shutil.copy(swapped, data)
        return data
    if kind == "delete-metadata":
        (ckpt / ".metadata").unlink()
        return ckpt / ".metadata"
    if kind == "manifest-step":
        manifest = json.loads((ckpt / "distckpt.json").read_text())
        manifest["step"] = 3
        (ckpt / "distckpt.json").write_text(json.dumps(manifest))
        return ckpt / "distckpt.json"
    if kind == "manifest-garbage":
        (ckpt / "distckpt.json").write_text('{"schema_version": 2, "step": ')
        return ckpt / "distckpt.json"
    if kind == "extra-file":
        (ckpt / "__1_0.distcp").write_bytes(b"x" * 10)
        return ckpt / "__1_0.distcp"
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """Same layout, other weights (same sizes): a file of it swapped in passes a size check."""
    root = tmp_path_factory.mktemp("other") / "ckpt"
    make_root(root, shift=0.5)
    return root


@pytest.mark.parametrize(
    "kind", ["flip", "truncate", "swap", "delete-metadata", "manifest-step", "manifest-garbage", "extra-file"]
)
def test_verify_names_every_bad_file(root, other_run, capsys, kind):
    bad = _damage(root, kind, other_run)
    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    assert f"ok       {root / 'step-000000002'}" in out
    assert f"CORRUPT  {root / 'step-000000004'}" in out and str(bad) in out
    code, data = run_json(capsys, "verify", root / "step-000000004")
    assert code == 1 and not data["ok"]
    assert str(bad) in {p["path"] for p in data["checkpoints"][0]["problems"]}


def test_verify_reports_every_problem_not_the_first(root, capsys):
    files = sorted((root / "step-000000004").glob("*"))
    for f in files:
        if f.name != "distckpt.json":
            _flip(f)
    code, data = run_json(capsys, "verify", root / "step-000000004")
    problems = {p["path"] for p in data["checkpoints"][0]["problems"]}
    assert code == 1 and {str(f) for f in files if f.name != "distckpt.json"} <= problems


def test_verify_plain_dcp_directory_checks_its_hash_sidecar(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    import distckpt.dcp

    plain = tmp_path / "plain"
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 2)}
    dcp.save(state, storage_writer=distckpt.dcp.FileSystemWriter(str(plain)), no_dist=True)
    assert (plain / ".metadata.xxh3.json").is_file()
    code, out, _ = run(capsys, "verify", plain)
    assert code == 0 and f"ok       {plain}" in out and "plain DCP checkpoint with a hash sidecar" in out
    assert "manifest missing" not in out
    data_file = next(plain.glob("*.distcp"))
    _flip(data_file)
    code, out, _ = run(capsys, "verify", plain)
    assert code == 1 and f"CORRUPT  {plain}" in out and str(data_file) in out and "hash sidecar" in out
    assert "manifest missing" not in out
    code, data = run_json(capsys, "verify", plain)
    assert code == 1 and not data["ok"]
    assert [p["path"] for p in data["checkpoints"][0]["problems"]] == [str(data_file)]


def test_ls_and_verify_share_the_no_manifest_rule(root, capsys):
    # distckpt's own checkpoint without its manifest: "no manifest (uncommitted or damaged)" in both;
    # a user's plain dcp.save: unmanaged, import suggested, never called damaged.
    import torch.distributed.checkpoint as dcp

    damaged = root / "step-000000004"  # latest names it
    (damaged / "distckpt.json").unlink()
    plain = root / "step-000000007"
    dcp.save({"w": torch.ones(3, 2)}, checkpoint_id=str(plain), no_dist=True)
    words = f"{damaged}: no manifest (uncommitted or damaged)"
    code, data = run_json(capsys, "ls", root)
    rows = {r["name"]: r for r in data["checkpoints"]}
    assert code == 0 and rows["step-000000004"]["status"] == "no manifest"
    assert rows["step-000000004"]["reason"].startswith(words) and "import" not in rows["step-000000004"]["reason"]
    assert rows["step-000000007"]["status"] == "unmanaged" and "distckpt import" in rows["step-000000007"]["reason"]
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and words in out
    for target in (root, damaged):
        code, out, _ = run(capsys, "verify", target)
        assert code == 1 and words in out and f"{damaged / 'distckpt.json'}: manifest missing" not in out
        code, data = run_json(capsys, "verify", target)
        entry = next(c for c in data["checkpoints"] if c["path"] == str(damaged))
        assert [p["message"] for p in entry["problems"]][0].startswith(words)


def test_verify_calls_a_stock_dcp_save_unmanaged_as_ls_does_and_suggests_import(root, tmp_path, capsys):
    # A stock dcp.save (no manifest, no hash sidecar): nothing to verify it against. Alone: exit 2,
    # "unmanaged", `distckpt import`; in a root: listed as skipped, the exit code the checkpoints'.
    import torch.distributed.checkpoint as dcp

    plain = root / "step-000000007"
    dcp.save({"w": torch.ones(3, 2)}, checkpoint_id=str(plain), no_dist=True)
    words = f"{plain}: unmanaged: a plain DCP checkpoint"
    for target in (plain, tmp_path / "elsewhere"):
        if target != plain:
            shutil.copytree(plain, target)
        code, out, err = run(capsys, "verify", target)
        assert code == 2 and f"{target}: unmanaged" in err and f"distckpt import {target} NEW_ROOT" in err
        assert "manifest missing" not in out + err and "CORRUPT" not in out
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and f"skipped  {words}" in out and "distckpt import" in out and "CORRUPT" not in out
    assert out.count("ok       ") == 2
    code, data = run_json(capsys, "verify", root)
    assert code == 0 and data["ok"] and data["unmanaged"] == [str(plain)]
    assert str(plain) not in [c["path"] for c in data["checkpoints"]]
    only = tmp_path / "only"
    only.mkdir()
    plain.rename(only / plain.name)
    code, _, err = run(capsys, "verify", only)
    assert code == 2 and "holds no distckpt checkpoint to verify, only unmanaged" in err and "distckpt import" in err


# ---------------------------------------------------------------------------------- unsafe pickles
class _OpenFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


class _System:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("payload", [_OpenFile, _System])
def test_crafted_metadata_is_refused_and_never_run(root, tmp_path, capsys, payload):
    marker = tmp_path / "pwned"
    ckpt = root / "step-000000004"
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload(str(marker))))
    # Re-sign the manifest, as an attacker would: sizes and hashes then match.
    manifest = json.loads((ckpt / "distckpt.json").read_text())
    for f in manifest["files"]:
        if f["path"] == ".metadata":
            f["size_bytes"], f["hash"] = hash_file(ckpt / ".metadata")
    (ckpt / "distckpt.json").write_text(json.dumps(manifest))

    code, listing = run_json(capsys, "ls", root)
    row = next(r for r in listing["checkpoints"] if r["name"] == ckpt.name)
    assert code == 0 and row["status"] == "corrupt" and "refusing to unpickle" in row["reason"]
    code, out, err = run(capsys, "inspect", ckpt)
    assert code == 2 and out == "" and "refusing to unpickle" in err and str(ckpt / ".metadata") in err
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1 and "refusing to unpickle" in out and str(ckpt / ".metadata") in out
    code, _, err = run(capsys, "export", ckpt, tmp_path / "x.safetensors")
    assert code == 2 and "refusing to unpickle" in err
    code, _, err = run(capsys, "diff", ckpt, root / "step-000000002")
    assert code == 2 and "refusing to unpickle" in err
    assert not marker.exists()


# ---------------------------------------------------------------------------------- diff
def test_diff_identical_and_different(root, other_run, capsys):
    code, data = run_json(capsys, "diff", root / "step-000000004", root / "step-000000004")
    assert code == 0 and data["identical"] and data["only_a"] == data["only_b"] == []
    code, data = run_json(capsys, "diff", root / "step-000000002", root / "step-000000004", "--group", "model")
    assert code == 1 and not data["identical"]
    common = {d["key"]: d for d in data["common"]}
    assert set(common) == {f"model.{k}" for k in Net().state_dict()}
    assert all(d["max_abs_diff"] > 0 and not d["equal"] for d in common.values())
    code, out, _ = run(capsys, "diff", root / "step-000000002", root / "step-000000004")
    assert code == 1 and "checkpoints differ" in out and "model.inp.weight" in out


def test_diff_keys_and_shapes(tmp_path, capsys):
    make_root(tmp_path / "a", steps=(1,))
    make_root(tmp_path / "b", steps=(1,), width=12, extra=False)
    code, data = run_json(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert data["only_a"] == ["extra.note"] and data["only_b"] == []
    assert "model.inp.weight" in data["mismatched"] and "model.out.bias" not in data["mismatched"]
    entry = next(d for d in data["common"] if d["key"] == "model.inp.weight")
    assert (entry["shape_a"], entry["shape_b"], entry["max_abs_diff"]) == ([16, 8], [12, 8], None)
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert "only in A (1):" in out and "16x8 torch.float32" in out and "12x8 torch.float32" in out


# ---------------------------------------------------------------------------------- export / import
def test_export_and_import_commands(root, tmp_path, capsys):
    out_file = tmp_path / "w.safetensors"
    code, data = run_json(capsys, "export", root, out_file, "--dtype", "bf16", "--model-only")
    assert code == 0 and data["format"] == "safetensors" and data["dtype"] == "bf16"
    assert data["checkpoint"] == str(root / "step-000000004")
    weights = load_file(out_file)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    code, _, err = run(capsys, "export", root, out_file)
    assert code == 2 and "--force" in err
    code, out, _ = run(capsys, "export", root / "step-000000002", tmp_path / "all.pt", "--no-progress")
    assert code == 0 and "torch" in out and "optim.state.inp.weight.exp_avg" in torch.load(tmp_path / "all.pt")

    fp32 = {k: v.float() for k, v in weights.items()}
    save_file(fp32, tmp_path / "fp32.safetensors")
    code, data = run_json(capsys, "import", tmp_path / "fp32.safetensors", tmp_path / "new", "--step", "7")
    assert code == 0 and data["checkpoint"] == str(tmp_path / "new" / "step-000000007")
    assert data["tensors"] == len(fp32)
    model = Net()
    state = CheckpointManager(CheckpointConfig(root=str(tmp_path / "new")), model=model, optimizer=None).load()
    assert state.step == 7 and all(torch.equal(v, fp32[k]) for k, v in model.state_dict().items())
    assert run(capsys, "verify", tmp_path / "new")[0] == 0
    code, _, err = run(capsys, "import", tmp_path / "fp32.safetensors", tmp_path / "new", "--step", "8")
    assert code == 2 and "already holds 1 checkpoint" in err and "--archive-existing" in err, err
    assert err.count("another root") == 1 and "load.on_existing" not in err, err  # a manager's option
    (tmp_path / "junk").write_text("hello")
    code, _, err = run(capsys, "import", tmp_path / "junk", tmp_path / "new2")
    assert code == 2 and "not a safetensors file" in err


@pytest.mark.parametrize("command", ["export", "release"])
@pytest.mark.parametrize("url", ["s3://ckpt/out/model.safetensors", "gs://bucket/out/m.pt", "s3:/ckpt/out/x"])
def test_export_and_release_refuse_a_url_output(root, tmp_path, capsys, monkeypatch, command, url):
    """A URL is never a local path: refused (exit 2, what to do), nothing written anywhere --
    also after the ``mkdir -p`` an earlier message asked for."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "ckpt" / "out").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = run(capsys, command, root, url, "--no-progress")
    assert code == 2 and out == "", (out, err)
    assert url in err and "is a URL" in err and "local path, then upload" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    call = export_checkpoint if command == "export" else release_checkpoint
    with pytest.raises(ConfigError, match="is a URL"):
        call(root / "step-000000004", url, progress=False)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# ---------------------------------------------------------------------------------- prune
def test_prune(tmp_path, capsys):
    root = tmp_path / "ckpt"
    make_root(root, steps=(1, 2, 3, 4, 5))
    # The newest directory is corrupt: it is neither counted nor deleted.
    (root / "step-000000005" / "distckpt.json").unlink()
    code, data = run_json(capsys, "prune", root, "--keep-last", "2", "--dry-run")
    assert code == 0 and data["deleted"] == ["step-000000001", "step-000000002"]
    assert data["kept"] == ["step-000000003", "step-000000004"] and data["corrupt_untouched"] == ["step-000000005"]
    assert len(list(root.glob("step-*"))) == 5
    code, out, _ = run(capsys, "prune", root, "--keep-last", "2")
    assert code == 0 and "deleted 2, kept 2" in out and "step-000000005" in out
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000003", "step-000000004", "step-000000005"]
    code, data = run_json(capsys, "prune", root, "--keep-last", "1")
    assert data["deleted"] == ["step-000000003"] and (root / "step-000000004").is_dir()
    code, _, err = run(capsys, "prune", root, "--keep-last", "0")
    assert code == 2 and "newest checkpoint is always kept" in err


def test_prune_counts_only_checkpoints_that_verify(tmp_path, capsys):
    root = tmp_path / "ckpt"
    make_root(root, steps=(1, 2, 3))
    data_file = max((root / "step-000000003").glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only a hash check finds it
    data_file.write_bytes(bytes(raw))
    code, data = run_json(capsys, "prune", root, "--keep-last", "1")
    assert code == 0 and data["deleted"] == ["step-000000001"], data  # step 2 is the newest that loads
    assert data["kept"] == ["step-000000002"] and data["corrupt_untouched"] == ["step-000000003"]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000002", "step-000000003"]


def test_prune_refuses_a_root_a_job_is_writing(tmp_path, capsys):
    root = tmp_path / "ckpt"
    make_root(root, steps=(1, 2))
    (root / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "job_id": "J"}))
    code, _, err = run(capsys, "prune", root, "--keep-last", "1")
    assert code == 2 and "locked" in err and len(list(root.glob("step-*"))) == 2


@pytest.mark.parametrize("url", ["s3://", "s3:///run1"])
def test_s3_url_without_bucket_says_so(capsys, url):
    pytest.importorskip("boto3")
    code, _, err = run(capsys, "ls", url)
    assert code != 0 and "no bucket (expected s3://bucket/prefix)" in err and "not an s3:// URL" not in err


@pytest.mark.parametrize("url", ["s3://my bucket/ckpt", "s3://bucket:1/ckpt"])
def test_a_bad_bucket_name_is_a_config_error_naming_it(capsys, url):
    code, out, err = run(capsys, "ls", url)
    assert code != 0 and "is not a valid bucket name" in err and url.split("/")[2] in err
    assert "regex" not in err.lower()


def test_an_access_point_arn_is_accepted_as_the_bucket_part():
    from distckpt._storage.s3_client import split_url

    arn = "arn:aws:s3:us-east-1:123456789012:accesspoint:myap"
    assert split_url(f"s3://{arn}/ckpt/run") == (arn, "ckpt/run")
