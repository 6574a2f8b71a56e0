"""Resume of the data position through CheckpointManager in one process (issue 12, items 4-6, 9).

The uninterrupted reference and the interrupted run are both README-style loops
(``tests.distributed.trainer.train``: ``for batch in loader`` inside ``while step < until``,
plain ``nn.Dropout``, a save every 3 steps). 96 samples, global batch 8: an epoch is 12 steps,
so a checkpoint at step 12 is taken exactly at the last step of an epoch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from distckpt import CheckpointConfig, CheckpointManager, ConfigError, IncompatibleCheckpointError, ScheduleConfig
from distckpt._ondisk.manifest import Manifest
from tests.distributed.trainer import Net, build, release_workers, train, train_steps

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

UNTIL = 18


@pytest.fixture(autouse=True)
def _release_loader_workers():
    """Shut down the workers of every loader a test left behind (see ``release_workers``)."""
    yield
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, StatefulDataLoader):
            release_workers(obj)


def _run(root, **opts):
    return train(0, 1, {"root": str(root), "until": UNTIL, "interval_steps": 3, **opts})


def _assert_same_tail(full, resumed, first_step):
    steps = list(range(first_step, UNTIL + 1))
    assert [resumed["ids"][s] for s in steps] == [full["ids"][s] for s in steps]
    # Bitwise: dropout masks come from the global torch RNG, restored by the resume.
    assert [resumed["losses"][s] for s in steps] == [full["losses"][s] for s in steps]
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name


# ------------------------------------------------------------------ item 4
@pytest.mark.multiprocess
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("crash_at", [9, 12], ids=["mid_epoch", "epoch_end"])
def test_resume_is_bitwise_equal_mid_epoch_and_at_epoch_end(tmp_path, num_workers, crash_at):
    full = _run(tmp_path / "full", num_workers=num_workers)
    _run(tmp_path / "cut", num_workers=num_workers, crash_at=crash_at)
    resumed = _run(tmp_path / "cut", num_workers=num_workers)
    assert resumed["resumed_from"] == crash_at
    _assert_same_tail(full, resumed, crash_at + 1)


# ------------------------------------------------------------------ item 9
@pytest.mark.multiprocess
@pytest.mark.parametrize("saved_workers,resumed_workers", [(2, 0), (2, 4), (0, 2)])
@pytest.mark.parametrize("crash_at", [9, 12], ids=["mid_epoch", "epoch_end"])
def test_num_workers_change_resumes_exactly(tmp_path, saved_workers, resumed_workers, crash_at):
    full = _run(tmp_path / "full", num_workers=saved_workers)
    _run(tmp_path / "cut", num_workers=saved_workers, crash_at=crash_at)
    resumed = _run(tmp_path / "cut", num_workers=resumed_workers)
    assert resumed["resumed_from"] == crash_at
    _assert_same_tail(full, resumed, crash_at + 1)


class _Points(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((8,), float(i))


def _plain_loader_manager(root, num_workers):
    torch.manual_seed(0)
    model = Net()
    loader = StatefulDataLoader(_Points(), batch_size=4, num_workers=num_workers)
    manager = CheckpointManager(
        CheckpointConfig(root=str(root), schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=None,
        dataloader=loader,
    )
    return manager, loader


def test_num_workers_change_without_reshardable_sampler_raises(tmp_path):
    manager, loader = _plain_loader_manager(tmp_path, num_workers=2)
    it = iter(loader)
    next(it), next(it)
    manager.save(2)
    manager.close()
    manager, _ = _plain_loader_manager(tmp_path, num_workers=0)
    with pytest.raises(IncompatibleCheckpointError, match="num_workers=2.*num_workers=0.*ReshardableSampler"):
        manager.load()
    manager.close()


# ------------------------------------------------------------------ item 5
class _Counting(IterableDataset):
    """An IterableDataset with its own state: yields 0, 1, 2, ... from ``self.pos``."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        while self.pos < 1000:
            self.pos += 1
            yield torch.tensor([self.pos - 1])

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def _iterable_manager(root, num_workers):
    torch.manual_seed(0)
    loader = StatefulDataLoader(_Counting(), batch_size=2, num_workers=num_workers)
    manager = CheckpointManager(
        CheckpointConfig(root=str(root), schedule=ScheduleConfig(interval_steps=None)),
        model=Net(),
        optimizer=None,
        dataloader=loader,
    )
    return manager, loader


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_iterator_created_before_load_is_refused(tmp_path, num_workers, kind):
    if kind == "map":
        model, optimizer, scheduler, scaler, loader = build(0, 1, {"num_workers": num_workers})
        manager = CheckpointManager(
            CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)),
            model=model,
            optimizer=optimizer,
            dataloader=loader,
        )
        train_steps(model, optimizer, scheduler, scaler, loader, 5)
    else:
        manager, loader = _iterable_manager(tmp_path, num_workers)
        it = iter(loader)
        for _ in range(5):
            next(it)
    manager.save(5)
    manager.close()
    release_workers(loader)

    if kind == "map":
        model, optimizer, scheduler, scaler, loader = build(0, 1, {"num_workers": num_workers})
        manager = CheckpointManager(
            CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)),
            model=model,
            optimizer=optimizer,
            dataloader=loader,
        )
    else:
        manager, loader = _iterable_manager(tmp_path, num_workers)
    early = iter(loader)  # before load(): it would yield from epoch 0, batch 0
    with pytest.raises(ConfigError, match=r"iter\(loader\).*before.*load\(\).*after"):
        manager.load()
    del early
    manager.close()
    release_workers(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterator_made_by_state_dict_before_load_is_fine(tmp_path, num_workers):
    manager, loader = _iterable_manager(tmp_path, num_workers)
    it = iter(loader)
    for _ in range(5):
        next(it)
    manager.save(5)
    expected = next(it)
    del it
    manager.close()
    manager, loader = _iterable_manager(tmp_path, num_workers)
    loader.state_dict()  # makes an iterator that is not handed out: load() replaces it
    manager.load()
    assert torch.equal(next(iter(loader)), expected)
    manager.close()


# ------------------------------------------------------------------ item 6
def test_counters_are_derived_from_the_sampler(tmp_path):
    _run(tmp_path, until=15, interval_steps=5)  # saves at 5, 10, 15; epochs of 12 steps
    m = Manifest.read(tmp_path / "step-000000015")
    assert (m.epoch, m.global_samples_seen) == (1, 15 * 8)
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    manager = CheckpointManager(
        CheckpointConfig(root=str(tmp_path)), model=model, optimizer=optimizer, dataloader=loader
    )
    state = manager.load()
    assert (state.step, state.epoch, state.batch_in_epoch, state.global_samples_seen) == (15, 1, 3, 120)
    manager.close()


def test_counters_passed_by_the_caller_win(tmp_path):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    manager = CheckpointManager(
        CheckpointConfig(root=str(tmp_path), schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=optimizer,
        dataloader=loader,
    )
    train_steps(model, optimizer, scheduler, scaler, loader, 12)  # one epoch
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    manager.maybe_save(14, epoch=7, global_tokens_seen=99)
    manager.save(14)
    ts = manager.train_state
    # epoch and tokens from the caller; batch in epoch and samples from the sampler
    assert (ts.epoch, ts.batch_in_epoch, ts.global_samples_seen, ts.global_tokens_seen) == (7, 2, 14 * 8, 99)
    assert Manifest.read(tmp_path / "step-000000014").epoch == 7
    manager.close()
