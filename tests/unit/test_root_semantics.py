"""What a checkpoint root holds and who may change it (issue 12, items 1-3), in one process:
a fresh run in a used root, a rollback with load_path, and directories distckpt did not write."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    LoadConfig,
    RetentionConfig,
    ScheduleConfig,
)
from distckpt._cli import main
from distckpt._ondisk.manifest import Manifest
from distckpt._save.retention import steps_to_delete
from distckpt._storage.commit import delete_checkpoint, remove_leftovers
from distckpt._tools.reader import CheckpointReader
from tests.distributed.trainer import Net, build, optimizer_step, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def manager_for(root, **kw):
    objs = build(0, 1, kw.pop("build", {}))
    model, optimizer, scheduler, scaler, loader = objs
    cfg = CheckpointConfig(root=str(root), schedule=ScheduleConfig(interval_steps=None), **kw)
    return CheckpointManager(
        cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    ), objs


def run_a(root, steps=(30, 35, 40)):
    """Another run's checkpoints in ``root`` (trained one step between saves)."""
    manager, objs = manager_for(root, retention=RetentionConfig(keep_last=None))
    for s in steps:
        train_steps(*objs, 1)
        manager.save(s)
    manager.close()


def listing(root):
    """``{dir name: {file: bytes}}`` of every directory under ``root``."""
    return {
        d.name: {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.is_file()}
        for d in sorted(root.iterdir())
        if d.is_dir()
    }


def model_tensors(checkpoint):
    reader = CheckpointReader(checkpoint)
    return reader.read(reader.keys("model"))


def train_saving(manager, objs, steps, save_at):
    """Train ``steps`` (global step numbers) from one loader iterator, saving at ``save_at``."""
    model, optimizer, scheduler, scaler, loader = objs
    it = iter(loader)
    for step in steps:
        batch = next(it)
        optimizer_step(model, optimizer, scheduler, scaler, batch)
        if step in save_at:
            manager.save(step)


def latest(root):
    return (root / "latest").read_text().strip()


# ------------------------------------------------------------------ item 1: fresh run, used root
def test_fresh_run_in_a_used_root_refuses_or_archives_and_never_loses_its_commits(tmp_path, caplog):
    root = tmp_path / "ckpt"
    run_a(root)
    before = listing(root)
    with pytest.raises(ConfigError) as err:
        manager_for(root, load=LoadConfig(enabled=False))
    assert "step-000000040" in str(err.value) and "on_existing: archive" in str(err.value)
    assert "load.enabled: true" in str(err.value)
    assert listing(root) == before and not (root / ".lock").exists()  # nothing touched, lock released
    with pytest.raises(ConfigError, match="would be archived"):
        CheckpointConfig(root=str(root), load=LoadConfig(on_existing="archive"))  # load: true: it would be ignored
    with pytest.raises(ConfigError, match="on_existing='keep'"):
        CheckpointConfig(root=str(root), load=LoadConfig(enabled=False, on_existing="keep"))

    with caplog.at_level("WARNING"):
        manager, objs = manager_for(
            root, load=LoadConfig(enabled=False, on_existing="archive"), retention=RetentionConfig(keep_last=2)
        )
    assert "on_existing=archive" in caplog.text
    for step in (30, 35, 40):  # renamed with every byte, not deleted
        assert listing(root)[f"archived-step-{step:09d}-0"] == before[f"step-{step:09d}"]
    assert not (root / "latest").exists()  # it named an archived checkpoint
    for s in (5, 10, 15):
        train_steps(*objs, 1)
        manager.save(s)
        assert latest(root) == f"step-{s:09d}" and (root / latest(root) / "distckpt.json").is_file()
    manager.close()
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000010", "step-000000015"]
    mine = {f"model.{k}": v for k, v in objs[0].state_dict().items()}
    resumed, _ = manager_for(root)
    assert resumed.load().step == 15  # this run's, not the archived step 40
    saved = model_tensors(root / "step-000000015")
    assert saved.keys() == mine.keys() and all(torch.equal(saved[k], mine[k]) for k in mine)
    resumed.close()


def test_retention_never_deletes_a_just_committed_checkpoint(tmp_path, caplog):
    root = tmp_path / "ckpt"
    run_a(root)
    before = listing(root)
    manager, objs = manager_for(root, retention=RetentionConfig(keep_last=2))  # load: true, but saves without loading
    train_steps(*objs, 1)
    with caplog.at_level("WARNING"):
        manager.save(5)
    assert latest(root) == "step-000000005" and (root / "step-000000005" / "distckpt.json").is_file()
    assert "retention leaves them" in caplog.text
    assert {k: v for k, v in listing(root).items() if k != "step-000000005"} == before
    manager.close()
    caplog.clear()
    manager, _ = manager_for(root)
    with caplog.at_level("WARNING"):
        assert manager.load().step == 40
    assert "although the last commit was step-000000005" in caplog.text  # said, not silent
    manager.close()
    assert steps_to_delete([30, 35, 40, 5], keep_last=2, keep_every_steps=None, just_committed=5) == []
    assert steps_to_delete([1, 2, 3, 30, 35], keep_last=2, keep_every_steps=None, just_committed=3) == [1]


def test_import_into_a_root_with_checkpoints_refuses_unless_archive_existing(tmp_path, capsys):
    root = tmp_path / "ckpt"
    run_a(root, steps=(30, 40))
    before = listing(root)
    torch.save(Net().state_dict(), tmp_path / "w.pt")
    code = main(["import", str(tmp_path / "w.pt"), str(root)])
    err = capsys.readouterr().err
    assert code == 2 and "step-000000040" in err and "--archive-existing" in err
    assert listing(root) == before
    code = main(["import", str(tmp_path / "w.pt"), str(root), "--archive-existing", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["step"] == 0
    assert listing(root)["archived-step-000000040-0"] == before["step-000000040"]
    assert latest(root) == "step-000000000"
    assert [p.name for p in root.glob("step-*")] == ["step-000000000"]


# ------------------------------------------------------------------ item 2: rollback
def test_rollback_with_load_path_sets_newer_checkpoints_aside_at_the_first_save(tmp_path, caplog, capsys):
    root = tmp_path / "ckpt"
    manager, objs = manager_for(root, retention=RetentionConfig(keep_last=None))
    train_saving(manager, objs, range(1, 10), save_at=(3, 6, 9))
    manager.close()
    before = listing(root)

    evaluation, _ = manager_for(root, load=LoadConfig(path=str(root / "step-000000003")))
    assert evaluation.load().step == 3
    evaluation.close()
    assert listing(root) == before  # a manager that only loads changes nothing

    manager, objs = manager_for(
        root, load=LoadConfig(path=str(root / "step-000000003")), retention=RetentionConfig(keep_last=2)
    )
    with caplog.at_level("WARNING"):
        assert manager.load().step == 3
        train_saving(manager, objs, range(4, 7), save_at=(6,))  # used to fail: step-000000006 already exists
    assert "will be renamed rolledback-step-M-<n>" in caplog.text and "set aside 2 newer" in caplog.text
    for step in (6, 9):
        assert listing(root)[f"rolledback-step-{step:09d}-0"] == before[f"step-{step:09d}"]
    assert latest(root) == "step-000000006"
    # Same-world resume is exact: the retrained step 6 equals the first run's, bitwise.
    old, new = model_tensors(root / "rolledback-step-000000006-0"), model_tensors(root / "step-000000006")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    train_steps(*objs, 3)
    manager.save(9)
    manager.save(12)
    manager.close()
    # Retention counts only step-* directories: step 3 goes, the rolled-back ones stay.
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000009", "step-000000012"]
    assert (root / "rolledback-step-000000006-0").is_dir() and (root / "rolledback-step-000000009-0").is_dir()
    mine = {f"model.{k}": v for k, v in objs[0].state_dict().items()}
    saved = model_tensors(root / "step-000000012")
    assert all(torch.equal(saved[k], mine[k]) for k in mine)
    capsys.readouterr()
    assert main(["ls", str(root), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["rolledback-step-000000009-0"] == {
        "name": "rolledback-step-000000009-0",
        "step": 9,
        "status": "set aside",
        "reason": "rolledback",
        "latest": False,
    }
    assert rows["step-000000012"]["status"] == "committed" and rows["step-000000012"]["latest"]


# ------------------------------------------------------------------ item 3: directories distckpt did not write
def _plain_dcp(path, state):
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_step_dir_without_manifest_is_never_deleted(tmp_path, caplog, capsys):
    root = tmp_path / "ckpt"
    run_a(root, steps=(3,))
    plain = root / "step-000000005"
    _plain_dcp(plain, {"model": Net().state_dict()})
    files = listing(root)[plain.name]
    manager, _ = manager_for(root)
    with caplog.at_level("WARNING"):
        assert manager.load().step == 3
    manager.close()
    assert f"ignoring {plain}" in caplog.text and listing(root)[plain.name] == files
    manager, _ = manager_for(root, load=LoadConfig(path=str(plain)))
    with pytest.raises(CheckpointNotFoundError, match="without a distckpt manifest.*distckpt import"):
        manager.load()
    manager.close()
    assert listing(root)[plain.name] == files  # used to be deleted, then reported missing
    capsys.readouterr()
    assert main(["ls", str(root), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[plain.name]["status"] == "unmanaged" and "distckpt import" in rows[plain.name]["reason"]


def test_retention_delete_is_marked_so_only_its_leftover_is_removed(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    run_a(root, steps=(3, 6))
    files = listing(root)["step-000000003"]
    monkeypatch.setattr("distckpt._storage.commit.shutil.rmtree", lambda *a, **k: None)  # crash after the rename
    delete_checkpoint(root / "step-000000003")
    monkeypatch.undo()
    (doomed,) = root.glob(".deleting-step-000000003-*")
    assert listing(root)[doomed.name] == files and not (root / "step-000000003").exists()
    assert remove_leftovers(root) == [doomed.name] and not doomed.exists()
    assert (root / "step-000000006" / "distckpt.json").is_file()


@pytest.mark.parametrize("layout", ["bare", "prefixed"])
def test_import_a_plain_dcp_directory(tmp_path, capsys, layout):
    torch.manual_seed(3)
    model = Net()
    weights = model.state_dict()
    src = tmp_path / "plain"
    if layout == "bare":
        _plain_dcp(src, dict(weights))
    else:
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        _plain_dcp(src, {"model": model.state_dict(), "optim": opt.state_dict()})
        weights = model.state_dict()
    before = listing(tmp_path)["plain"]
    code = main(["import", str(src), str(tmp_path / "root"), "--step", "5", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["step"] == 5 and data["tensors"] == len(weights)
    assert listing(tmp_path)["plain"] == before  # the source is never changed
    assert main(["verify", str(tmp_path / "root")]) == 0
    capsys.readouterr()
    manifest = Manifest.read(tmp_path / "root" / "step-000000005")
    assert sorted(manifest.model) == sorted(weights)
    target = Net()
    manager = CheckpointManager(CheckpointConfig(root=str(tmp_path / "root")), model=target, optimizer=None)
    assert manager.load().step == 5
    manager.close()
    assert all(torch.equal(v, weights[k]) for k, v in target.state_dict().items())


def test_import_refuses_a_dcp_directory_it_cannot_read_as_model_weights(tmp_path, capsys):
    _plain_dcp(tmp_path / "plain", {"w": torch.ones(2), "note": {"x": 1}})
    code = main(["import", str(tmp_path / "plain"), str(tmp_path / "root")])
    err = capsys.readouterr().err
    assert code == 2 and "no model.* items" in err and "note" in err
    assert not list((tmp_path / "root").glob("step-*"))


# ------------------------------------------------------------------ issue 24 item 6: one unchanged config
def state_tensors(objs):
    """Model and optimizer tensors of the live objects, cloned: ``{name: tensor}``."""
    model, optimizer = objs[0], objs[1]
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in optimizer.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("on_existing", ["refuse", "archive"])
def test_a_fine_tune_restarted_with_its_unchanged_config_resumes_its_own_checkpoints(tmp_path, caplog, on_existing):
    pre, ft = tmp_path / "pre" / "ckpt", tmp_path / "ft" / "ckpt"
    run_a(pre)
    opts = dict(
        load=LoadConfig(path=str(pre / "step-000000040"), only=["model"], on_existing=on_existing),
        retention=RetentionConfig(keep_last=None),
    )
    recorded = {"load_path": opts["load"].path, "load_step": None, "load_only": ["model"], "exclude_from_loading": None}
    reference, ref_objs = manager_for(tmp_path / "ref", **opts)  # the same fine-tune, never interrupted
    reference.load()
    train_saving(reference, ref_objs, range(1, 7), save_at=())
    reference.close()

    with caplog.at_level("INFO", logger="distckpt"):
        manager, objs = manager_for(ft, **opts)
        assert manager.load().step == 0  # the pre-training's weights, nothing else: a new run
    assert "this is the run's first start" in caplog.text
    train_saving(manager, objs, range(1, 5), save_at=(2, 4))
    manager.close()  # then killed: a restart finds two commits of this run
    assert Manifest.read(ft / "step-000000004").initial_load == recorded
    before = listing(ft)
    caplog.clear()
    with caplog.at_level("INFO", logger="distckpt"):
        restarted, objs2 = manager_for(ft, **opts)  # used to raise ConfigError, or archive and train from step 0
        state = restarted.load()
    assert state.step == 4 and state.checkpoint_path == str(ft / "step-000000004")
    assert f"restart: {ft} holds step-000000004, committed by this run" in caplog.text
    assert listing(ft) == before and not list(ft.glob("archived-*"))
    train_saving(restarted, objs2, range(5, 7), save_at=(6,))
    restarted.close()
    want, got = state_tensors(ref_objs), state_tensors(objs2)  # the whole state was resumed, not the selection
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_rollback_restarted_with_its_unchanged_config_rolls_back_once(tmp_path, caplog):
    root = tmp_path / "ckpt"
    manager, objs = manager_for(root, retention=RetentionConfig(keep_last=None))
    train_saving(manager, objs, range(1, 10), save_at=(3, 6, 9))
    manager.close()
    opts = dict(load=LoadConfig(step=3), retention=RetentionConfig(keep_last=None))
    stopped, _ = manager_for(root, **opts)  # killed before the rolled-back run committed: nothing of it exists
    assert stopped.load().step == 3
    stopped.close()
    manager, objs = manager_for(root, **opts)
    assert manager.load().step == 3  # so this start rolls back again
    train_saving(manager, objs, range(4, 6), save_at=(5,))  # its first commit sets 6 and 9 aside
    mine = state_tensors(objs)
    manager.close()
    assert sorted(p.name for p in root.iterdir() if "step" in p.name) == [
        "rolledback-step-000000006-0",
        "rolledback-step-000000009-0",
        "step-000000003",
        "step-000000005",
    ]
    with caplog.at_level("INFO", logger="distckpt"):
        restarted, objs2 = manager_for(root, **opts)
        assert restarted.load().step == 5  # used to roll back to step 3 again, setting step 5 aside
    assert "restart:" in caplog.text and "load_step=3" in caplog.text
    got = state_tensors(objs2)
    assert all(torch.equal(mine[k], got[k]) for k in mine)
    train_saving(restarted, objs2, range(6, 8), save_at=(7,))
    restarted.close()
    assert sorted(p.name for p in root.iterdir() if "step" in p.name) == [
        "rolledback-step-000000006-0",
        "rolledback-step-000000009-0",
        "step-000000003",
        "step-000000005",
        "step-000000007",
    ]
    again, _ = manager_for(root, load=LoadConfig(path=str(root / "step-000000003")))  # changed options: a new rollback
    assert again.load().step == 3
    again.close()
