"""CheckpointManager in one process (no process group): errors, discovery, pitfalls."""

import contextlib
import json
import subprocess

import pytest
import torch
from torch import nn

from distckpt import (
    AsyncSaveConfig,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CoordinationConfig,
    IncompatibleCheckpointError,
    LoadConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
)
from tests.distributed.trainer import Net, build, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def manager_for(root, **kw):
    model, optimizer, scheduler, scaler, loader = build(0, 1, kw.pop("build", {}))
    cfg = CheckpointConfig(root=str(root), schedule=ScheduleConfig(interval_steps=kw.pop("interval_steps", None)), **kw)
    return CheckpointManager(
        cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    ), (model, optimizer, scheduler, scaler, loader)


def trained_manager(root, steps=(3,), **kw):
    manager, objs = manager_for(root, **kw)
    done = 0
    for s in steps:
        train_steps(*objs, s - done)
        manager.save(s)
        done = s
    return manager, objs


@pytest.mark.parametrize(
    "change,expect",
    [
        (
            {"rename": True},
            ["missing in checkpoint: hidden2.weight", "unexpected (in checkpoint, not in model): hidden.weight"],
        ),
        ({"width": 12}, ["shape mismatch for inp.weight: checkpoint [16, 8], model [12, 8]"]),
        ({"dtype": torch.bfloat16}, ["dtype mismatch for inp.weight: checkpoint torch.float32, model torch.bfloat16"]),
    ],
)
def test_incompatible_model_names_every_difference(tmp_path, change, expect):
    trained_manager(tmp_path)
    manager, (model, *_) = manager_for(tmp_path, build=change)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IncompatibleCheckpointError) as err:
        manager.load()
    for line in expect:
        assert line in str(err.value)
    for k, v in model.state_dict().items():  # nothing was touched
        assert torch.equal(v, before[k])


def test_missing_optimizer_in_checkpoint_is_incompatible(tmp_path):
    model = Net()
    m = CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None)
    m.save(1)
    m.close()
    manager, _ = manager_for(tmp_path)
    with pytest.raises(IncompatibleCheckpointError, match="missing in checkpoint: optim"):
        manager.load()


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_corrupt_newest_raises_or_falls_back(tmp_path, damage, caplog):
    _, (model, *_) = trained_manager(tmp_path, steps=(3, 6))
    data = sorted((tmp_path / "step-000000006").glob("*.distcp"))[0]
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
    else:
        data.unlink()
    manager, _ = manager_for(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    assert str(data) in str(err.value) and err.value.path == str(data)
    manager.close()
    manager, (model2, *_) = manager_for(tmp_path, load=LoadConfig(fallback_to_older=True))
    with caplog.at_level("WARNING"):
        state = manager.load()
    assert state.step == 3
    assert "falling back" in caplog.text and "step-000000006" in caplog.text


def _flip_a_byte(checkpoint):
    """Change one byte in the middle of the biggest data file (its size stays the same)."""
    data = max(checkpoint.glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return data


@pytest.mark.parametrize("fast_load", [False, True])
def test_bit_flip_found_while_reading_falls_back_to_older(tmp_path, fast_load, caplog):
    trained_manager(tmp_path, steps=(3, 6))
    expected_manager, (expected_model, *_) = manager_for(
        tmp_path, load=LoadConfig(path=str(tmp_path / "step-000000003"))
    )
    expected_manager.load()
    expected_manager.close()
    expected = {k: v.clone() for k, v in expected_model.state_dict().items()}
    data = _flip_a_byte(tmp_path / "step-000000006")

    manager, _ = manager_for(tmp_path, load=LoadConfig(fast_reader=fast_load))
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    assert err.value.path == str(data) and "does not match" in str(err.value)
    manager.close()

    manager, (model, *_) = manager_for(tmp_path, load=LoadConfig(fast_reader=fast_load, fallback_to_older=True))
    with caplog.at_level("WARNING"):
        state = manager.load()
    assert state.step == 3 and state.checkpoint_path.endswith("step-000000003")
    assert "falling back" in caplog.text and str(data) in caplog.text
    for k, v in model.state_dict().items():  # every tensor the failed read touched is rewritten
        assert torch.equal(v, expected[k]), k
    assert (tmp_path / "corrupt-step-000000006-0").is_dir()  # set aside, kept for inspection
    manager.save(6)  # the resumed run saves step 6 again
    manager.close()

    _flip_a_byte(tmp_path / "step-000000003")
    _flip_a_byte(tmp_path / "step-000000006")
    manager, _ = manager_for(tmp_path, load=LoadConfig(fast_reader=fast_load, fallback_to_older=True))
    with pytest.raises(CheckpointCorruptError, match="no committed checkpoint in .* is loadable"):
        manager.load()  # never a silent fresh start over a run's checkpoints


def test_newest_without_manifest_is_set_aside_not_deleted(tmp_path, caplog):
    trained_manager(tmp_path, steps=(3, 6))
    (tmp_path / "step-000000006" / "distckpt.json").unlink()  # not how retention deletes: latest names it
    files = sorted(p.name for p in (tmp_path / "step-000000006").iterdir())
    manager, _ = manager_for(tmp_path, load=LoadConfig(fallback_to_older=True))
    with caplog.at_level("WARNING"):
        assert manager.load().step == 3
    assert sorted(p.name for p in (tmp_path / "corrupt-step-000000006-0").iterdir()) == files
    assert "set aside" in caplog.text and "removed" not in caplog.text
    assert "no manifest (uncommitted or damaged)" in caplog.text


def test_newest_without_manifest_is_refused_without_fallback_as_by_ls_and_verify(tmp_path, caplog, capsys):
    # One rule for load, ls and verify: distckpt's files without a manifest are a damaged checkpoint.
    from distckpt._cli import main

    trained_manager(tmp_path, steps=(3, 6))[0].close()
    ckpt = tmp_path / "step-000000006"
    (ckpt / "distckpt.json").unlink()
    files = sorted(p.name for p in ckpt.iterdir())
    manager, _ = manager_for(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    words = f"{ckpt}: no manifest (uncommitted or damaged)"
    assert words in str(err.value) and "fallback_to_older" in str(err.value)
    manager.close()
    assert sorted(p.name for p in ckpt.iterdir()) == files  # untouched: nothing renamed or deleted
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert words in out and "distckpt import" not in out and "unmanaged" not in out
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert words in out and "manifest missing" not in out


def test_every_manifest_deleted_names_what_was_found(tmp_path):
    import torch.distributed.checkpoint as dcp

    trained_manager(tmp_path, steps=(3, 6))[0].close()
    for step in (3, 6):
        (tmp_path / f"step-00000000{step}" / "distckpt.json").unlink()
    dcp.save({"w": torch.ones(3, 2)}, checkpoint_id=str(tmp_path / "step-000000001"), no_dist=True)  # a user's
    manager, _ = manager_for(tmp_path, load=LoadConfig(fallback_to_older=True))
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    message = str(err.value)
    assert "no manifest (uncommitted or damaged)" in message
    assert "corrupt-step-000000006-0" in message and "corrupt-step-000000003-0" in message and "Restore" in message
    assert f"unmanaged {tmp_path / 'step-000000001'}" in message  # only plain DCP files: not distckpt's


def test_a_small_checkpoint_that_lost_its_manifest_is_damaged_not_unmanaged(tmp_path, capsys):
    # Small state only (no file gets block digests): rank 0's digest file still marks the directory
    # distckpt's, so with latest naming another checkpoint it is "no manifest", never "unmanaged".
    from distckpt._cli import main
    from distckpt._storage import commit as commit_mod

    trained_manager(tmp_path, steps=(3, 6))[0].close()
    ckpt = tmp_path / "step-000000003"
    assert all(p.stat().st_size < 1 << 20 for p in ckpt.iterdir())
    (ckpt / "distckpt.json").unlink()
    assert commit_mod.damaged_step_dirs(tmp_path) == [ckpt] and commit_mod.unmanaged_step_dirs(tmp_path) == []
    words = f"{ckpt}: no manifest (uncommitted or damaged)"
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert words in out and "unmanaged" not in out and "distckpt import" not in out
    assert main(["verify", str(tmp_path)]) == 1
    assert words in capsys.readouterr().out
    manager, _ = manager_for(tmp_path)
    assert manager.load().step == 6  # the newest committed one; the damaged one is skipped, untouched
    manager.close()
    assert ckpt.is_dir() and not (tmp_path / "corrupt-step-000000003-0").exists()


def test_a_save_of_a_damaged_steps_directory_says_no_manifest_and_what_to_do(tmp_path):
    trained_manager(tmp_path, steps=(3, 6))[0].close()
    ckpt = tmp_path / "step-000000003"
    (ckpt / "distckpt.json").unlink()
    files = sorted(p.name for p in ckpt.iterdir())
    manager, _ = manager_for(tmp_path, load=LoadConfig(enabled=False, on_existing="archive"))  # a fresh run
    assert (tmp_path / "archived-step-000000006-0").is_dir() and ckpt.is_dir()  # only committed ones archived
    with pytest.raises(CheckpointSaveError) as err:
        manager.save(3)
    manager.close()
    message = str(err.value)
    assert f"{ckpt}: no manifest (uncommitted or damaged)" in message and "not a distckpt checkpoint" not in message
    assert "move it out of the root" in message and "save another step" in message
    assert sorted(p.name for p in ckpt.iterdir()) == files  # untouched


def test_changed_dcp_metadata_is_found_before_planning(tmp_path):
    trained_manager(tmp_path)
    meta = tmp_path / "step-000000003" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[-20] ^= 0x01  # same size; the pickle may still load, with wrong offsets or shapes
    meta.write_bytes(bytes(raw))
    manager, _ = manager_for(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    assert err.value.path == str(meta) and "does not match" in str(err.value)


@pytest.mark.parametrize("edit", ["step", "unlisted file"])
def test_an_edited_checkpoint_is_refused_by_load_as_by_verify(tmp_path, edit, caplog, capsys):
    # Issue 24 item 5: verify called it corrupt, but discovery loaded it silently.
    from distckpt._cli import main

    trained_manager(tmp_path, steps=(3, 6))[0].close()
    ckpt = tmp_path / "step-000000006"
    if edit == "step":
        bad = ckpt / "distckpt.json"
        data = json.loads(bad.read_text())
        bad.write_text(json.dumps(dict(data, step=9, loss=0.001)))
        reason = "manifest says step 9, directory is step 6"
    else:
        bad = ckpt / "notes.txt"
        bad.write_text("added after the commit")
        reason = "file not listed in the manifest"
    assert main(["verify", str(tmp_path)]) == 1 and reason in capsys.readouterr().out
    assert main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["step-000000006"]["status"] == "corrupt" and reason in rows["step-000000006"]["reason"]
    assert rows["step-000000003"]["status"] == "committed"
    for load_path in (None, str(ckpt)):
        manager, _ = manager_for(tmp_path, load=LoadConfig(path=load_path))
        with pytest.raises(CheckpointCorruptError, match=reason) as err:
            manager.load()
        assert err.value.path == str(bad) and str(bad) in str(err.value)
        manager.close()
    expected, (model1, *_) = manager_for(tmp_path, load=LoadConfig(path=str(tmp_path / "step-000000003")))
    expected.load()
    want = {k: v.clone() for k, v in model1.state_dict().items()}
    expected.close()
    manager, (model2, *_) = manager_for(tmp_path, load=LoadConfig(fallback_to_older=True))
    with caplog.at_level("WARNING"):
        assert manager.load().step == 3
    assert reason in caplog.text and "falling back to" in caplog.text
    assert all(torch.equal(model2.state_dict()[k], want[k]) for k in want)
    assert (tmp_path / "corrupt-step-000000006-0" / bad.name).is_file()  # kept, never loaded
    manager.close()


def test_bad_manifest_and_load_path(tmp_path):
    trained_manager(tmp_path)
    (tmp_path / "step-000000003" / "distckpt.json").write_text("{not json")
    manager, _ = manager_for(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="unreadable manifest"):
        manager.load()
    manager.close()
    manager, _ = manager_for(tmp_path, load=LoadConfig(path=str(tmp_path / "step-000000099")))
    with pytest.raises(CheckpointNotFoundError, match="step-000000099"):
        manager.load()


def test_newer_schema_is_refused(tmp_path):
    trained_manager(tmp_path)
    path = tmp_path / "step-000000003" / "distckpt.json"
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    manager, _ = manager_for(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="schema_version 99 is newer"):
        manager.load()


def test_stale_staging_removed_and_never_loaded(tmp_path):
    trained_manager(tmp_path)
    fake = tmp_path / ".pending-step-000000009-abcdef"
    fake.mkdir()
    (fake / "distckpt.json").write_text("{}")
    manager, _ = manager_for(tmp_path)
    assert manager.load().step == 3
    assert not fake.exists()


def test_empty_root_starts_fresh(tmp_path):
    manager, _ = manager_for(tmp_path / "new")
    assert manager.load() is None


def test_save_before_first_step_changes_nothing(tmp_path):
    # Reference: first update with no save.
    _, (m_ref, o_ref, s_ref, sc_ref, l_ref) = manager_for(tmp_path / "ref")
    train_steps(m_ref, o_ref, s_ref, sc_ref, l_ref, 1)
    manager, (model, opt, sched, scaler, loader) = manager_for(tmp_path / "a")
    manager.save(0)
    assert not opt.state  # DCP's dummy step was undone
    manager.close()
    train_steps(model, opt, sched, scaler, loader, 1)
    for a, b in zip(m_ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert [s["step"].item() for s in opt.state.values()] == [1.0] * len(opt.state)
    # ... and loading that step-0 checkpoint gives a stateless optimizer too.
    manager2, (model2, opt2, *_rest) = manager_for(
        tmp_path / "a", load=LoadConfig(path=str(tmp_path / "a" / "step-000000000"))
    )
    assert manager2.load().step == 0
    assert not opt2.state


def test_empty_param_group_saves_and_loads(tmp_path):
    def make():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [], "lr": 0.5}], lr=0.1)
        return model, opt

    model, opt = make()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.param_groups[1]["lr"] = 0.25
    CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=opt).save(1)
    model2, opt2 = make()
    CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model2, optimizer=opt2).load()
    assert [g["lr"] for g in opt2.param_groups] == [0.1, 0.25]
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("situation", ["grads_present", "frozen"])
def test_load_restores_exact_optimizer_state(tmp_path, situation):
    manager, (model, opt, *_r) = trained_manager(tmp_path)
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in zip(range(99), opt.state.values())}
    manager.close()
    manager2, (model2, opt2, sched2, scaler2, loader2) = manager_for(tmp_path)
    if situation == "grads_present":
        model2(torch.ones(2, 8)).sum().backward()
        grads = [p.grad.clone() for p in model2.parameters()]
    else:
        model2.hidden.weight.requires_grad_(False)
    manager2.load()
    loaded = {k: v for k, v in zip(range(99), opt2.state.values())}
    assert saved.keys() == loaded.keys()
    for k in saved:
        for n in saved[k]:
            assert torch.equal(saved[k][n], loaded[k][n]), (k, n)
    if situation == "grads_present":
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model2.parameters()))
    else:
        assert not model2.hidden.weight.requires_grad


def test_loading_twice_changes_nothing(tmp_path):
    trained_manager(tmp_path)
    manager, (model, opt, sched, scaler, loader) = manager_for(tmp_path)
    manager.load()
    snap = (
        scaler.state_dict(),
        sched.state_dict(),
        [p.clone() for p in model.parameters()],
        [{k: v.clone() for k, v in s.items()} for s in opt.state.values()],
        torch.get_rng_state(),
    )
    manager.load()
    assert scaler.state_dict() == snap[0] and sched.state_dict() == snap[1]
    assert all(torch.equal(a, b) for a, b in zip(snap[2], model.parameters()))
    for a, b in zip(snap[3], opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(snap[4], torch.get_rng_state())


def test_extra_state_plain_and_stateful(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": torch.tensor(self.n)}

        def load_state_dict(self, sd):
            self.n = int(sd["n"])

    c = Counter()
    c.n = 41
    model = Net()
    m = CheckpointManager(
        CheckpointConfig(root=str(tmp_path)),
        model=model,
        optimizer=None,
        extra_state={"counter": c, "note": {"tokens": [1, 2, 3], "name": "x"}},
    )
    m.save(5, loss=0.5, epoch=2, global_samples_seen=80)
    m.close()
    c2 = Counter()
    m2 = CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=Net(), optimizer=None, extra_state={"counter": c2, "note": None}
    )
    state = m2.load()
    assert c2.n == 41 and m2.extra_state["note"] == {"tokens": [1, 2, 3], "name": "x"}
    assert (state.step, state.epoch, state.global_samples_seen, state.loss_history) == (5, 2, 80, [(5, 0.5)])
    manifest = json.loads((tmp_path / "step-000000005" / "distckpt.json").read_text())
    assert manifest["loss"] == 0.5 and manifest["world_size"] == 1 and manifest["wrapper"] == "plain"
    files = {f["path"]: f["size_bytes"] for f in manifest["files"]}
    assert files == {
        p.name: p.stat().st_size for p in (tmp_path / "step-000000005").iterdir() if p.name != "distckpt.json"
    }


def test_plain_dcp_load_reads_the_model(tmp_path):
    import torch.distributed.checkpoint as dcp

    _, (model, *_r) = trained_manager(tmp_path)
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "step-000000003"), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v)


def test_unwritable_root_fails_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not a writable directory"):
        CheckpointManager(CheckpointConfig(root=str(blocker / "sub")), model=Net(), optimizer=None)


def _tree(root):
    """``{relative path: (kind, size, mtime_ns, mode)}`` of ``root`` and everything under it."""
    return {
        p.relative_to(root).as_posix() or ".": (
            p.is_dir(),
            p.stat().st_size if p.is_file() else 0,
            p.stat().st_mtime_ns,
            p.stat().st_mode,
        )
        for p in [root, *sorted(root.rglob("*"))]
    }


@contextlib.contextmanager
def _read_only_view(root, how):
    """``root`` made read-only: ``chmod -R a-w`` (as root, writes still succeed: only the tree
    comparison shows none happened) or a read-only bind mount (writes fail with EROFS)."""
    if how == "chmod":
        subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
        try:
            yield root
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(root)], check=True)
        return
    view = root.parent / "ro-view"
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(root), str(view)], capture_output=True).returncode != 0:
        pytest.skip("no bind mount here (needs root with CAP_SYS_ADMIN)")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True, capture_output=True)
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


@pytest.mark.parametrize("how", ["chmod", "read-only bind mount"])
def test_a_read_only_manager_loads_a_read_only_root_and_writes_nothing(tmp_path, how):
    # Issue 24 item 14: an evaluation of a read-only snapshot could not be built at all.
    import signal

    root = tmp_path / "ckpt"
    manager, objs = trained_manager(root, steps=(3,))
    at3 = {k: v.clone() for k, v in objs[0].state_dict().items()}
    train_steps(*objs, 3)
    manager.save(6)
    manager.close()
    at6 = {k: v.clone() for k, v in objs[0].state_dict().items()}
    (root / ".pending-step-000000009-abc123").mkdir()  # a crash leftover a writing manager removes
    before, handler = _tree(root), signal.getsignal(signal.SIGTERM)
    with _read_only_view(root, how) as view:
        if how != "chmod":
            with pytest.raises(ConfigError, match="not a writable directory"):
                manager_for(view)  # what an evaluation job got
        for load_step, want in ((None, at6), (3, at3)):  # step 3: no rollback, nothing set aside
            evaluation, (model, *_) = manager_for(
                view,
                save=SaveConfig(enabled=False),
                load=LoadConfig(step=load_step),
                async_save=AsyncSaveConfig(mode="thread"),
            )
            assert signal.getsignal(signal.SIGTERM) is handler and evaluation.lock is None
            assert evaluation.load().step == (load_step or 6)
            assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
            with pytest.raises(ConfigError, match="save.enabled=false: this manager only loads"):
                evaluation.maybe_save(7, last_step=True)
            with pytest.raises(ConfigError, match="save.enabled=false: this manager only loads"):
                evaluation.save(7)
            evaluation.close()
    assert _tree(root) == before  # no lock, token, probe file, leftover removal or latest repair
    with pytest.raises(ConfigError, match="save.enabled=false only loads: it needs load.enabled: true"):
        CheckpointConfig(root=str(root), save=SaveConfig(enabled=False), load=LoadConfig(enabled=False))


def test_unusable_event_log_fails_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="event_log"):
        CheckpointManager(
            CheckpointConfig(
                root=str(tmp_path / "root"), coordination=CoordinationConfig(event_log=str(blocker / "events.jsonl"))
            ),
            model=Net(),
            optimizer=None,
        )


def test_manifest_hashes_match_files_and_bitflip_is_caught(tmp_path):
    from distckpt._ondisk.integrity import hash_file

    trained_manager(tmp_path)
    ckpt = tmp_path / "step-000000003"
    manifest = json.loads((ckpt / "distckpt.json").read_text())
    assert manifest["hash_algorithm"] == "xxh3_128"
    for f in manifest["files"]:  # hashed while writing, equal to a fresh read
        assert f["hash"] == hash_file(ckpt / f["path"])[1], f["path"]
    data = sorted(ckpt.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different bytes
    data.write_bytes(bytes(raw))
    manager, _ = manager_for(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    assert str(data) in str(err.value) and "does not match the manifest" in str(err.value)
    assert err.value.path == str(data)


def test_schema_v1_manifest_is_migrated(tmp_path):
    trained_manager(tmp_path)
    path = tmp_path / "step-000000003" / "distckpt.json"
    data = json.loads(path.read_text())
    data["schema_version"] = 1  # the v1 form: no hashes
    del data["hash_algorithm"]
    for f in data["files"]:
        del f["hash"]
    path.write_text(json.dumps(data))
    manager, _ = manager_for(tmp_path)
    assert manager.load().step == 3


class _Payload:
    """Unpickling this runs code: it would create the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_metadata_pickle_is_refused_and_never_runs(tmp_path):
    import pickle

    from distckpt._ondisk.integrity import hash_file

    trained_manager(tmp_path / "root")
    ckpt = tmp_path / "root" / "step-000000003"
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    # An attacker who can write the directory can also make the manifest agree.
    manifest = json.loads((ckpt / "distckpt.json").read_text())
    for f in manifest["files"]:
        f["size_bytes"], f["hash"] = hash_file(ckpt / f["path"])
    (ckpt / "distckpt.json").write_text(json.dumps(manifest))
    manager, _ = manager_for(tmp_path / "root")
    with pytest.raises(CheckpointCorruptError, match="refusing to unpickle"):
        manager.load()
    assert not marker.exists()


def test_failure_in_finish_aborts_cleanly_and_next_save_works(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    from distckpt import CheckpointSaveError

    manager, objs = trained_manager(tmp_path)
    original = FileSystemWriter.finish

    def failing_finish(self, metadata, results):
        raise OSError(28, "No space left on device (injected in finish)")

    monkeypatch.setattr(FileSystemWriter, "finish", failing_finish)
    with pytest.raises(CheckpointSaveError, match="injected in finish"):
        manager.save(4)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == ["latest", "step-000000003"]
    monkeypatch.setattr(FileSystemWriter, "finish", original)
    train_steps(*objs, 1)
    manager.save(5)
    assert (tmp_path / "latest").read_text().strip() == "step-000000005"


def test_phase_events_are_logged_in_order(tmp_path):
    events = tmp_path / "events.jsonl"
    manager, objs = manager_for(
        tmp_path / "root",
        coordination=CoordinationConfig(event_log=str(events)),
        retention=RetentionConfig(keep_last=1),
    )
    train_steps(*objs, 1)
    manager.save(1)
    manager.save(2)
    phases = [(e["phase"], e["step"]) for e in map(json.loads, events.read_text().splitlines())]
    assert phases == [
        ("stage", 1),
        ("write", 1),
        ("manifest", 1),
        ("rename", 1),
        ("latest", 1),
        ("committed", 1),
        ("stage", 2),
        ("write", 2),
        ("manifest", 2),
        ("rename", 2),
        ("latest", 2),
        ("retention", 1),
        ("committed", 2),
    ]


def test_leftovers_of_interrupted_delete_and_latest_update_are_removed(tmp_path, caplog):
    trained_manager(tmp_path, steps=(3, 6))
    deleting = tmp_path / ".deleting-step-000000003-0a1b2c3d"
    (tmp_path / "step-000000003").rename(deleting)  # retention died after its rename
    no_manifest = tmp_path / "step-000000002"
    no_manifest.mkdir()
    (no_manifest / "__0_0.distcp").write_bytes(b"not distckpt's")
    (tmp_path / ".latest.tmp-4242").write_text("step-000000009\n")
    manager, _ = manager_for(tmp_path)
    with caplog.at_level("WARNING"):
        assert manager.load().step == 6
    assert not deleting.exists() and not (tmp_path / ".latest.tmp-4242").exists()
    assert (tmp_path / "step-000000006").exists()
    # Not provably distckpt's: kept, with a warning.
    assert (no_manifest / "__0_0.distcp").read_bytes() == b"not distckpt's"
    assert f"ignoring {no_manifest}" in caplog.text


def _truncate_data(checkpoint):
    data = max(checkpoint.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:10])


def test_restart_after_every_checkpoint_set_aside_as_corrupt_refuses(tmp_path):
    first, _ = trained_manager(tmp_path, steps=(3, 6))
    first.close()
    _truncate_data(tmp_path / "step-000000003")
    _truncate_data(tmp_path / "step-000000006")
    manager, _ = manager_for(tmp_path, load=LoadConfig(fallback_to_older=True))
    with pytest.raises(CheckpointCorruptError, match="is loadable"):
        manager.load()
    manager.close()
    assert sorted(p.name for p in tmp_path.glob("corrupt-*")) == [
        "corrupt-step-000000003-0",
        "corrupt-step-000000006-0",
    ]
    for kw in ({"load": LoadConfig(fallback_to_older=True)}, {}):  # the restart (same config) and one without fallback
        manager, _ = manager_for(tmp_path, **kw)
        with pytest.raises(CheckpointCorruptError, match="only checkpoints set aside as corrupt") as err:
            manager.load()  # never a fresh start into the run's root
        assert "corrupt-step-000000003-0, corrupt-step-000000006-0" in str(err.value)
        assert "load.path" in str(err.value) and "load.enabled: false" in str(err.value)
        manager.close()
    assert not list(tmp_path.glob("step-*"))  # nothing trained or committed


def test_rolled_back_or_archived_only_root_still_starts_fresh(tmp_path):
    first, _ = trained_manager(tmp_path, steps=(3,))
    first.close()
    (tmp_path / "step-000000003").rename(tmp_path / "archived-step-000000003-0")
    manager, _ = manager_for(tmp_path)
    assert manager.load() is None
    manager.close()


def test_a_reader_bug_is_not_taken_for_corruption(tmp_path, monkeypatch):
    """A failed invariant of the fast reader itself raises as it is: the checkpoint is not set
    aside and no older one is loaded in its place."""
    from distckpt import ReaderInvariantError
    from distckpt._engine.read import read_verify

    trained_manager(tmp_path, steps=(3, 6))

    def broken(self, off, data):
        raise ReaderInvariantError(f"{self.path}: hashed out of order at {off} (simulated)")

    monkeypatch.setattr(read_verify.WholeFileCheck, "update", broken)
    manager, _ = manager_for(tmp_path, load=LoadConfig(fast_reader=True, fallback_to_older=True))
    with pytest.raises(ReaderInvariantError, match="load.fast_reader: false"):
        manager.load()
    manager.close()
    assert (tmp_path / "step-000000006").is_dir() and not list(tmp_path.glob("corrupt-*"))


def test_the_model_layout_comes_from_the_first_saves_state_dict_not_an_extra_one_at_construction(tmp_path, monkeypatch):
    from distckpt._adapters import model_optim, tensor_specs

    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters())
    calls = []
    real = model_optim.get_model_state_dict
    monkeypatch.setattr(model_optim, "get_model_state_dict", lambda m: calls.append(m) or real(m))
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=optimizer) as manager:
        manager.save(1)
    assert calls == []  # neither construction nor the save built a state_dict of its own for the layout
    manifest = json.loads((tmp_path / "step-000000001" / "distckpt.json").read_text())
    assert manifest["model"] == {k: {"shape": v.shape, "dtype": v.dtype} for k, v in tensor_specs(model).items()}
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=optimizer) as manager:
        assert manager.load().step == 1
    assert len(calls) == 1  # tensor_specs above; the load checks the fit from its own target
