"""Retention's file removal runs on a background thread (distckpt/_save/purge.py): a blocking save
returns once the deleted checkpoint is renamed ``.deleting-*``; ``wait``/``close`` and the next
save join the removal; a failed removal is a warning, never a lost checkpoint."""

import threading
from pathlib import Path

import pytest
import torch

import distckpt._save.purge as purge_mod
from distckpt import RetentionConfig, SaveConfig
from distckpt._coord.collective import Collective
from distckpt._coord.events import EventLog
from distckpt._ondisk.layout import is_deleting
from distckpt._save.transaction import SaveContext, SaveTransaction
from distckpt._state.train_state import TrainState
from distckpt._storage import open_store
from distckpt._storage.commit import validate
from tests.unit.test_manager_single import manager_for, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class BlockedRemoval:
    """Replaces ``purge.remove_tree``: each removal waits for ``release`` (set by the test)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.removed: list[Path] = []
        self.original = purge_mod.remove_tree

    def __call__(self, path) -> None:
        self.started.set()
        assert self.release.wait(60), "the test never released the removal"
        self.original(path)
        self.removed.append(Path(path))


def deleting(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if is_deleting(p.name))


def steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


@pytest.mark.parametrize("join", ["wait", "close"])
def test_blocking_save_returns_before_the_removal_and_wait_or_close_joins_it(tmp_path, monkeypatch, join):
    blocked = BlockedRemoval()
    monkeypatch.setattr(purge_mod, "remove_tree", blocked)
    manager, objs = manager_for(tmp_path, retention=RetentionConfig(keep_last=1))
    train_steps(*objs, 1)
    manager.save(1)
    train_steps(*objs, 1)
    expected = {k: v.clone() for k, v in objs[0].state_dict().items()}
    manager.save(2)  # returns while step 1's files are still being removed
    assert blocked.started.wait(60)
    doomed = deleting(tmp_path)
    assert len(doomed) == 1 and doomed[0].startswith(".deleting-step-000000001-")
    assert list((tmp_path / doomed[0]).iterdir())  # its files are still there: removal not done
    assert steps(tmp_path) == ["step-000000002"]  # the decision is made and durable
    assert validate(tmp_path / "step-000000002", check_hashes=True).step == 2
    assert blocked.removed == []
    blocked.release.set()
    getattr(manager, join)()
    assert [p.name for p in blocked.removed] == doomed  # joined: the removal finished before wait/close returned
    assert deleting(tmp_path) == [] and steps(tmp_path) == ["step-000000002"]
    manager.close()  # after wait(): the root is this manager's until it is closed
    fresh, fresh_objs = manager_for(tmp_path)
    assert fresh.load().step == 2
    for k, v in fresh_objs[0].state_dict().items():
        assert torch.equal(v, expected[k]), k
    fresh.close()


def test_retention_joins_the_previous_removal_before_it_reads_the_root(tmp_path, monkeypatch):
    blocked = BlockedRemoval()
    monkeypatch.setattr(purge_mod, "remove_tree", blocked)

    class SpyPurger(purge_mod.Purger):
        def join(self):
            if self.pending():
                blocked.release.set()  # only a join of a pending removal lets it finish
            return super().join()

    seen: dict[int, list[Path]] = {}

    def on_phase(phase: str, step: int, rank: int) -> None:
        if phase == "retention":
            seen[step] = list(blocked.removed)

    root = tmp_path / "ckpt"
    root.mkdir()
    ctx = SaveContext(
        store=open_store(str(root)),
        rank=0,
        world_size=1,
        wrapper="plain",
        model_specs=dict,
        events=EventLog(None, 0),
        on_phase=on_phase,
        retention=RetentionConfig(keep_last=1),
        save=SaveConfig(thread_count=1),
        write_timeout_s=60.0,
        purger=SpyPurger(),
    )
    collective = Collective(None, timeout_s=30)
    try:
        for step in (1, 2, 3):
            tx = SaveTransaction(ctx, step=step, save_id=f"{step:04x}", train_state=TrainState(step=step), full=False)
            tx.finish(collective, tx.write(lambda s=step: {"w": torch.full((64,), float(s))}, collective))
            if step == 2:  # returned with step 1's removal blocked (no join ran that could release it)
                assert blocked.started.wait(60) and blocked.removed == [] and not blocked.release.is_set()
    finally:
        blocked.release.set()
    assert [p.name.split("-")[2] for p in seen[2]] == ["000000001"]  # step 3's retention joined step 1's removal
    ctx.purger.join()
    assert [p.name.split("-")[2] for p in blocked.removed] == ["000000001", "000000002"]
    assert deleting(root) == [] and steps(root) == ["step-000000003"]


def test_a_failed_removal_is_a_warning_and_loses_nothing(tmp_path, monkeypatch, caplog):
    def failing(path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(purge_mod, "remove_tree", failing)
    manager, objs = manager_for(tmp_path, retention=RetentionConfig(keep_last=1))
    for step in (1, 2):
        train_steps(*objs, 1)
        manager.save(step)  # never raises for a failed removal
    with caplog.at_level("WARNING", logger="distckpt"):
        manager.wait()
    doomed = deleting(tmp_path)
    assert len(doomed) == 1 and f"could not remove all of {tmp_path / doomed[0]}" in caplog.text
    assert "Permission denied" in caplog.text and "the next start removes what is left" in caplog.text
    manager.close()
    assert steps(tmp_path) == ["step-000000002"]
    monkeypatch.undo()
    fresh, _ = manager_for(tmp_path)  # the next start removes the leftover
    assert fresh.load().step == 2 and deleting(tmp_path) == []
    fresh.close()


@pytest.mark.timeout(60)
def test_purger_removes_in_submission_order_on_one_thread_past_any_failure(tmp_path, monkeypatch):
    threads, order = set(), []

    def remove(path) -> None:
        threads.add(threading.get_ident())
        order.append(Path(path).name)
        if Path(path).name == "b":
            raise RuntimeError("not an OSError")  # still reported, and the next one still removed

    monkeypatch.setattr(purge_mod, "remove_tree", remove)
    purger = purge_mod.Purger()
    assert purger.join() == [] and purger.pending() == 0  # nothing submitted: no thread
    for name in ("a", "b", "c"):
        purger.submit(tmp_path / name)
    failures = purger.join()
    assert [(p.name, str(e)) for p, e in failures] == [("b", "not an OSError")]
    assert order == ["a", "b", "c"] and len(threads) == 1 and threading.get_ident() not in threads
    assert purger.pending() == 0 and purger.join() == []


def test_no_thread_to_be_had_removes_on_the_callers_thread(tmp_path, monkeypatch):
    doomed = tmp_path / ".deleting-step-000000001-0a1b2c3d"
    doomed.mkdir()
    (doomed / "__0_0.distcp").write_bytes(b"x" * 10)

    def refuse(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    purger = purge_mod.Purger()
    purger.submit(doomed)  # never raises: a commit's retention must not fail on rank 0 alone
    assert not doomed.exists() and purger.pending() == 0 and purger.join() == []
