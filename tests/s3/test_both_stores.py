"""The storage seam (issue 25 item 1): one discovery over ``CheckpointStore`` makes the same
decisions with the same messages on a POSIX root and an S3 root (a real SeaweedFS server):
refusal of a used root, archive, rollback, fallback from a corrupt newest checkpoint, a missing
``load.step``, and the refusal to start fresh over checkpoints set aside as corrupt.

Messages are compared with the root and the checkpoint locations replaced by placeholders, so a
difference in wording between the stores fails here.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

from distckpt import CheckpointConfig, CheckpointCorruptError, CheckpointManager, CheckpointNotFoundError, ConfigError
from distckpt._storage import open_store
from tests.distributed.trainer import build, full_params, train_steps

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]


@pytest.fixture(params=["posix", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "posix":
        return str(tmp_path / "root")
    return request.getfixturevalue("s3_root")


def manager_for(root: str, **kw):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    cfg = CheckpointConfig(root=root, schedule={"interval_steps": None}, retention={"keep_last": None}, **kw)
    return (
        CheckpointManager(
            cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
        ),
        (model, optimizer, scheduler, scaler, loader),
    )


def saved_run(root: str, steps: tuple[int, ...]) -> tuple[dict[int, str], dict[int, dict[str, torch.Tensor]]]:
    """Save ``steps`` in one run; ``({step: location}, {step: parameters})``."""
    manager, objs = manager_for(root)
    locations, params, done = {}, {}, 0
    for step in steps:
        train_steps(*objs, step - done)
        done = step
        locations[step] = manager.save(step)
        params[step] = {k: v.clone() for k, v in full_params(objs[0]).items()}
    manager.close()
    return locations, params


def generic(text: str, root: str, locations: dict[int, str]) -> str:
    """``text`` with the root and each location replaced (POSIX and S3 name them differently)."""
    for step, loc in locations.items():
        text = text.replace(loc, f"<step {step}>")
    return text.replace(root, "<root>")


def break_newest(root: str, location: str) -> None:
    """Remove one data file of the checkpoint at ``location`` (after its commit)."""
    store = open_store(root)
    name = next(n for n in store.object_sizes(location) if n.endswith(".distcp"))
    if location.startswith("s3://"):
        store.objects.delete([store.key(store._rel(location)) + "/" + name])  # noqa: SLF001 - test damage
    else:
        os.remove(os.path.join(location, name))


def test_locations_are_strings_and_a_used_root_is_refused_with_one_message(root):
    locations, _ = saved_run(root, (2,))
    assert all(isinstance(loc, str) for loc in locations.values())
    with pytest.raises(ConfigError) as err:
        manager_for(root, load={"enabled": False})
    assert generic(str(err.value), root, locations) == (
        "CheckpointConfig.root='<root>' already holds 1 checkpoint(s), newest step-000000002, and this run does "
        "not resume from them (load.enabled: false; none was committed with this config's load options, which would "
        "make this start a restart). Choose: resume them (load.enabled: true, with no load.path or one naming a "
        "checkpoint of the root); load.on_existing: archive to set them aside as archived-step-N-<n> (nothing is "
        "deleted); or "
        "another root."
    )


def test_archive_sets_them_aside_and_the_run_starts_fresh(root):
    saved_run(root, (2, 4))
    manager, _ = manager_for(root, load={"enabled": False, "on_existing": "archive"})
    assert manager.load() is None
    manager.save(1)
    manager.close()
    store = open_store(root)
    assert store.committed_steps() == [1]
    assert [n.rsplit("/", 1)[-1] for n in store.others().set_aside] == [
        "archived-step-000000002-0",
        "archived-step-000000004-0",
    ]
    assert store.others().latest == "step-000000001"


def test_rollback_sets_aside_the_newer_checkpoints_at_the_first_save(root, caplog):
    locations, params = saved_run(root, (2, 4, 6))
    manager, (model, *_) = manager_for(root, load={"path": locations[2]})
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        state = manager.load()
    assert state is not None and state.step == 2 and state.checkpoint_path == locations[2]
    assert all(torch.equal(v, params[2][k]) for k, v in full_params(model).items())
    store = open_store(root)
    assert store.committed_steps() == [2, 4, 6]  # nothing set aside by a load alone
    warned = [
        generic(r.getMessage(), root, locations)
        for r in caplog.records
        if r.name.startswith("distckpt") and r.levelno == logging.WARNING and "rollback" in r.getMessage()
    ]
    assert warned == [
        "rollback to load.path='<step 2>': the root's 2 newer checkpoint(s) (step-000000004, "
        "step-000000006) will be renamed rolledback-step-M-<n> at this run's first save (kept, "
        "never loaded or deleted)"
    ]
    manager.save(3)
    manager.close()
    assert store.committed_steps() == [2, 3]
    assert [n.rsplit("/", 1)[-1] for n in store.others().set_aside] == [
        "rolledback-step-000000004-0",
        "rolledback-step-000000006-0",
    ]
    assert store.others().latest == "step-000000003"


def test_a_corrupt_newest_is_refused_then_passed_over_with_fallback(root):
    locations, params = saved_run(root, (2, 4))
    break_newest(root, locations[4])
    manager, _ = manager_for(root)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    manager.close()
    message = generic(str(err.value), root, locations)
    assert re.fullmatch(
        r"<step 4>/__0_\d\.distcp: .* -- the newest checkpoint <step 4> is not loadable\. Set "
        r"load.fallback_to_older: true to resume from the previous committed checkpoint, or remove "
        r"<step 4>\.",
        message,
    ), message
    manager, (model, *_) = manager_for(root, load={"fallback_to_older": True})
    state = manager.load()
    manager.close()
    assert state is not None and state.step == 2
    assert all(torch.equal(v, params[2][k]) for k, v in full_params(model).items())
    store = open_store(root)
    assert store.committed_steps() == [2]
    assert [n.rsplit("/", 1)[-1] for n in store.others().set_aside] == ["corrupt-step-000000004-0"]


def test_only_corrupt_checkpoints_left_refuses_a_fresh_start(root):
    locations, _ = saved_run(root, (2,))
    break_newest(root, locations[2])
    manager, _ = manager_for(root, load={"fallback_to_older": True})
    with pytest.raises(CheckpointCorruptError, match="no committed checkpoint in .* is loadable"):
        manager.load()
    manager.close()
    manager, _ = manager_for(root)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()
    manager.close()
    assert generic(str(err.value), root, locations).replace("manifests/", "") == (
        "no committed checkpoint in <root>: it holds only checkpoints set aside as corrupt "
        "(corrupt-step-000000002-0). Restore one (rename it back to step-N after repairing its files), point "
        "load.path at a good copy, or move the root away (or set load.enabled: false) to start fresh deliberately."
    )


def test_a_missing_load_step_names_the_steps_there(root):
    saved_run(root, (2, 4))
    manager, _ = manager_for(root, load={"step": 3})
    with pytest.raises(CheckpointNotFoundError) as err:
        manager.load()
    manager.close()
    assert generic(str(err.value), root, {}) == (
        "CheckpointConfig.load.step=3: no step-000000003 in <root> (its checkpoints: steps [2, 4]; "
        "`distckpt ls <root>` lists them)"
    )


def test_a_newest_checkpoint_that_lost_its_manifest_is_damaged_on_both_stores(root, capsys):
    # The rule of docs/format.md "Layout" on both stores: the checkpoint `latest` names, without its
    # manifest, is "no manifest (uncommitted or damaged)" for load, ls and verify; never removed as a
    # leftover; load.fallback_to_older sets it aside (its data kept) and loads the previous one.
    from distckpt._cli import main

    locations, _ = saved_run(root, (2, 4))
    store = open_store(root)
    if root.startswith("s3://"):
        store.objects.delete([store._manifest_key(4)])  # noqa: SLF001 - test damage
    else:
        os.remove(os.path.join(locations[4], "distckpt.json"))
    assert store.others().damaged == [locations[4]] and store.others().unmanaged == []
    words = f"{locations[4]}: no manifest (uncommitted or damaged)"
    manager, _ = manager_for(root)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load()  # rank 0 removes leftovers first: not this one
    manager.close()
    assert words in str(err.value) and "fallback_to_older" in str(err.value)
    assert store.object_sizes(locations[4])  # kept
    assert main(["ls", root, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert (
        rows[4]["status"] == "no manifest" and rows[4]["reason"].startswith(words) and rows[2]["status"] == "committed"
    )
    assert main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert words in out and "manifest missing" not in out
    manager, _ = manager_for(root, load={"fallback_to_older": True})
    assert manager.load().step == 2
    manager.close()
    kept = locations[4] if root.startswith("s3://") else os.path.join(root, "corrupt-step-000000004-0")
    assert store.others().damaged == [] and store.object_sizes(kept)  # set aside, its data kept
    assert [n.rsplit("/", 1)[-1] for n in store.others().set_aside] == ["corrupt-step-000000004-0"]
    assert store.others().latest == "step-000000002"
    manager, _ = manager_for(root)
    assert manager.load().step == 2 and store.object_sizes(kept)  # never a leftover
    manager.close()
