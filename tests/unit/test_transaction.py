"""distckpt/_save/transaction.py's SaveTransaction in one process (the real Collective, no process
group: world size 1): phase order, manifest content, abort on a failed write or commit,
retention."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt._save.transaction as tx_mod
from distckpt import RetentionConfig, SaveConfig, __version__
from distckpt._coord.collective import Collective
from distckpt._coord.events import EventLog
from distckpt._errors import CheckpointSaveError
from distckpt._ondisk.integrity import hash_file
from distckpt._ondisk.layout import LATEST, MANIFEST, checkpoint_name
from distckpt._ondisk.manifest import Manifest, TensorSpec, model_fingerprint
from distckpt._save.transaction import PHASES, Rollback, SaveContext, SaveTransaction
from distckpt._state.train_state import TrainState
from distckpt._storage import open_store
from distckpt._storage.commit import validate

SPECS = {"model.w": TensorSpec(shape=[4, 3], dtype="torch.float32")}


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("DISTCKPT_EVENT_LOG", raising=False)


def _ctx(root: Path, calls: list, keep_last: int | None = None) -> SaveContext:
    root.mkdir(parents=True, exist_ok=True)
    return SaveContext(
        store=open_store(str(root)),
        rank=0,
        world_size=1,
        wrapper="plain",
        model_specs=lambda: SPECS,
        events=EventLog(None, 0),
        on_phase=lambda p, s, r: calls.append((p, s, r)),
        retention=RetentionConfig(keep_last=keep_last),
        save=SaveConfig(thread_count=1),
        write_timeout_s=60.0,
    )


def _save(ctx: SaveContext, step: int, value: float = 1.0, **kw: Any) -> SaveTransaction:
    ts = TrainState(step=step, epoch=step // 10, global_samples_seen=8 * step, loss_history=[(step, 0.5 * step)])
    tx = SaveTransaction(
        ctx, step=step, save_id=f"{step:04x}", train_state=ts, full=False, rollback_from=kw.get("rollback_from")
    )
    collective = Collective(None, timeout_s=30)
    state = {"model.w": torch.full((4, 3), value), "extra": torch.arange(5)}
    tx.finish(collective, tx.write(kw.get("build", lambda: state), collective))
    return tx


def test_phases_in_order_and_the_manifest_describes_the_files(tmp_path: Path) -> None:
    calls: list = []
    root = tmp_path / "ckpt"
    tx = _save(_ctx(root, calls), 7, value=3.0)
    assert calls == [(p, 7, 0) for p in PHASES if p != "retention"]  # nothing to delete yet
    assert (root / LATEST).read_text() == "step-000000007\n"
    assert sorted(os.listdir(root)) == [LATEST, "step-000000007"]  # staging renamed away
    m = validate(tx.final, check_hashes=True)
    assert (m.step, m.epoch, m.global_samples_seen, m.world_size, m.wrapper, m.state_dict_type, m.loss) == (
        7,
        0,
        56,
        1,
        "plain",
        "sharded",
        3.5,
    )
    assert (m.distckpt_version, m.torch_version, m.hash_algorithm) == (__version__, torch.__version__, "xxh3_128")
    assert m.model == SPECS and m.model_fingerprint == model_fingerprint(SPECS)
    on_disk = sorted(p.name for p in Path(tx.final).iterdir() if p.name != MANIFEST)
    assert [f.path for f in m.files] == on_disk and ".metadata" in on_disk
    assert all((f.size_bytes, f.hash) == hash_file(Path(tx.final) / f.path) for f in m.files)
    assert set(m.timings_s) == {"stage", "write", "commit"}


def test_retention_deletes_only_older_checkpoints(tmp_path: Path) -> None:
    calls: list = []
    root = tmp_path / "ckpt"
    ctx = _ctx(root, calls, keep_last=2)
    for step in (2, 4):
        _save(ctx, step)
    newer = _save(_ctx(root, []), 50)  # another run's newer checkpoint: never retention's
    calls.clear()
    _save(ctx, 6)
    retention = [c for c in calls if c[0] == "retention"]
    assert retention == [("retention", 2, 0)]  # keep_last=2 among steps <= 6: 4 and 6 stay
    assert [p for p, _, _ in calls] == list(PHASES)  # retention between latest and committed
    assert sorted(p for p in os.listdir(root) if p.startswith("step-")) == [
        "step-000000004",
        "step-000000006",
        Path(newer.final).name,
    ]
    ctx.purger.join()  # the files of a deleted checkpoint are removed in the background
    assert not [p for p in os.listdir(root) if p.startswith(".")]  # no .deleting- left
    assert validate(newer.final, check_hashes=True).step == 50


def test_a_failed_write_aborts_naming_rank_0_and_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    calls: list = []
    root = tmp_path / "ckpt"
    ctx = _ctx(root, calls, keep_last=1)
    previous = _save(ctx, 10)
    before = {f.path: f.hash for f in Manifest.read(previous.final).files}

    def failing_write(sd: dict, directory: Path, **kw: Any) -> dict:
        (Path(directory) / "__0_0.distcp").write_bytes(b"half a file")  # a partial write on disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tx_mod, "dcp_save", failing_write)
    calls.clear()
    with pytest.raises(CheckpointSaveError) as e:
        _save(ctx, 20)
    assert e.value.failures.keys() == {0} and "No space left on device" in e.value.failures[0]
    assert "save of step 20 failed on rank(s) [0]" in str(e.value) and "intact" in str(e.value)
    assert calls == [("stage", 20, 0), ("write", 20, 0)]  # nothing of the commit ran
    assert sorted(os.listdir(root)) == [LATEST, "step-000000010"]  # staging removed
    assert (root / LATEST).read_text() == "step-000000010\n"
    assert {f.path: f.hash for f in validate(previous.final, check_hashes=True).files} == before


def test_a_failed_commit_aborts_and_leaves_a_foreign_directory_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ctx = _ctx(root, [])
    _save(ctx, 10)
    foreign = root / checkpoint_name(20)  # e.g. a plain dcp.save, no manifest
    foreign.mkdir()
    (foreign / "theirs.bin").write_bytes(b"not ours")
    with pytest.raises(CheckpointSaveError, match="rank 0: commit: FileExistsError") as e:
        _save(ctx, 20)
    assert e.value.failures.keys() == {0}
    assert os.listdir(foreign) == ["theirs.bin"]
    assert sorted(os.listdir(root)) == [LATEST, "step-000000010", "step-000000020"]  # staging removed
    assert (root / LATEST).read_text() == "step-000000010\n"


def test_a_rollback_given_as_data_sets_the_newer_checkpoints_aside_at_the_first_commit_only(tmp_path, caplog) -> None:
    """Rollback is data the transaction is given (issue 36): no callback into the manager."""
    root, calls = tmp_path / "ckpt", []
    ctx = _ctx(root, calls)
    for step in (1, 2, 3, 4):
        _save(ctx, step)
    rollback = Rollback(2, by_load_path=True)
    with caplog.at_level("WARNING", logger="distckpt"):
        _save(ctx, 3, value=5.0, rollback_from=rollback)  # the rolled-back run's first commit
    assert rollback.done
    kept = sorted(n for n in os.listdir(root) if n.startswith("rolledback-"))
    assert [n.rsplit("-", 1)[0] for n in kept] == ["rolledback-step-000000003", "rolledback-step-000000004"]
    assert "set aside 2 newer checkpoint(s)" in caplog.text and "a restart with the same config" in caplog.text
    _save(ctx, 4, value=6.0, rollback_from=rollback)  # later commits leave the root alone
    names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    assert (
        names == [checkpoint_name(s) for s in (1, 2, 3, 4)]
        and sorted(n for n in os.listdir(root) if n.startswith("rolledback-")) == kept
    )
    assert (root / LATEST).read_text() == "step-000000004\n"
    old_3 = Manifest.read(str(root / kept[0]))
    assert validate(str(root / checkpoint_name(3)), check_hashes=True).wall_time > old_3.wall_time  # this run's
