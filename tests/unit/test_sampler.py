"""ReshardableSampler: layout, exactly-once, StatefulDataLoader resume, world-size change."""

from __future__ import annotations

from typing import Iterator, List

import pytest
import torch
from torch.utils.data import Dataset

from distckpt._data import (
    ReshardableSampler,
    check_world_size,
    global_state_from_loader_state,
    make_stateful_dataloader,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")

SEED = 7


class _Ids(Dataset):
    """Sample ``i`` is ``tensor([i, 2*i])`` so every batch carries its sample ids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, 2 * i])


def _ref_global_batches(n: int, g: int, epochs: int) -> List[List[int]]:
    """Global batches straight from the documented formula, independent of the sampler."""
    out = []
    for e in range(epochs):
        gen = torch.Generator()
        gen.manual_seed((SEED * 1_000_003 + e) % 2**63)
        perm = torch.randperm(n, generator=gen).tolist()
        out += [perm[k * g : (k + 1) * g] for k in range(n // g)]
    return out


def _sampler(n: int, g: int, rank: int, world: int) -> ReshardableSampler:
    return ReshardableSampler(n, global_batch_size=g, rank=rank, world_size=world, seed=SEED)


def _stream(loader) -> Iterator[torch.Tensor]:
    """Batches across epochs: a new pass over the loader whenever one ends."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        assert yielded, "an epoch yielded no batch"


def _take(it: Iterator[torch.Tensor], k: int) -> List[torch.Tensor]:
    return [next(it) for _ in range(k)]


def _ids(batch: torch.Tensor) -> List[int]:
    assert torch.equal(batch[:, 1], 2 * batch[:, 0])
    return batch[:, 0].tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rank_slices_concatenate_to_global_batch(world):
    n, g = 24 * 5 + 7, 24  # 7 tail samples dropped per epoch
    b = g // world
    one = _sampler(n, g, 0, 1)
    ranks = [_sampler(n, g, r, world) for r in range(world)]
    ref = _ref_global_batches(n, g, epochs=2)
    for epoch in range(2):
        w1 = list(one)
        per_rank = [list(s) for s in ranks]
        assert all(len(p) == len(s) == 5 * b for p, s in zip(per_rank, ranks))
        for k in range(5):
            glob = sum((p[k * b : (k + 1) * b] for p in per_rank), [])
            assert glob == w1[k * g : (k + 1) * g] == ref[epoch * 5 + k]


def test_exactly_once_per_epoch_and_new_permutation():
    n, g, world = 96, 24, 4
    ranks = [_sampler(n, g, r, world) for r in range(world)]
    epochs = []
    for epoch in range(3):
        seen = [i for s in ranks for i in s]
        assert sorted(seen) == list(range(n))
        assert all(s.state_dict()["epoch"] == epoch + 1 for s in ranks)
        epochs.append(seen)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_dropped_tail_and_len():
    n, g, world = 100, 24, 4
    s = _sampler(n, g, 1, world)
    assert len(s) == 4 * 6
    assert len(make_stateful_dataloader(_Ids(n), s)) == 4
    seen = [i for r in range(world) for i in _sampler(n, g, r, world)]
    assert len(seen) == len(set(seen)) == 96


def test_state_epoch_end_and_set_epoch():
    s = _sampler(48, 8, 1, 2)
    it = iter(s)
    _take(it, 4 * 2 + 1)  # two global batches and one index of the third
    sd = s.state_dict()
    assert sd == {
        "seed": SEED,
        "epoch": 0,
        "samples_consumed": 16,
        "global_batch_size": 8,
        "dataset_len": 48,
        "batch_offset": 0,
        "samples_before_epoch": 0,
    }
    s.set_epoch(0)  # same epoch: keep the position
    assert s.state_dict()["samples_consumed"] == 16
    rest = list(iter(s))  # restarts at the last whole global batch
    assert rest == sum((x[4:8] for x in _ref_global_batches(48, 8, 1)[2:]), [])
    assert (s.epoch, s.samples_consumed) == (1, 0)  # exhausted -> next epoch
    s.set_epoch(3)
    assert (s.epoch, s.samples_consumed) == (3, 0)


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("consumed", [3, 5, 7, 10], ids=["mid-e0", "end-e0", "mid-e1", "end-e1"])
def test_loader_resume_matches_uninterrupted(num_workers, consumed):
    n, g, world, rank = 44, 8, 2, 1  # 5 global batches per epoch, 4 tail samples
    ref = _ref_global_batches(n, g, epochs=5)
    loader = make_stateful_dataloader(_Ids(n), _sampler(n, g, rank, world), num_workers=num_workers)
    it = _stream(loader)
    _take(it, consumed)
    sd = loader.state_dict()
    gold = _take(it, 8)
    del it, loader

    fresh = make_stateful_dataloader(_Ids(n), _sampler(n, g, rank, world), num_workers=num_workers)
    fresh.load_state_dict(sd)
    got = _take(_stream(fresh), 8)
    assert len(got) == len(gold) == 8
    for a, b in zip(gold, got):
        assert a.shape == (4, 2) and torch.equal(a, b)
    # Both equal the documented order, so they can't agree on a wrong continuation.
    assert [_ids(b) for b in got] == [x[4:8] for x in ref[consumed : consumed + 8]]


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_later_epoch_restores_that_epochs_permutation(num_workers):
    n, g = 40, 8
    ref = _ref_global_batches(n, g, epochs=3)

    def run(loader, sampler, start_epoch, stop_after=None):
        out = []
        for epoch in range(start_epoch, 3):
            sampler.set_epoch(epoch)  # the usual call must not rewind a resumed epoch
            for batch in loader:
                out.append(batch)
                if len(out) == stop_after:
                    return out, loader.state_dict()
        return out, None

    s = _sampler(n, g, 0, 2)
    head, sd = run(make_stateful_dataloader(_Ids(n), s, num_workers=num_workers), s, 0, stop_after=7)
    assert sd is not None
    assert global_state_from_loader_state(sd)["epoch"] == 1  # s itself may have run ahead
    s_full = _sampler(n, g, 0, 2)
    full, _ = run(make_stateful_dataloader(_Ids(n), s_full, num_workers=num_workers), s_full, 0)

    s2 = _sampler(n, g, 0, 2)
    loader2 = make_stateful_dataloader(_Ids(n), s2, num_workers=num_workers)
    loader2.load_state_dict(sd)
    tail, _ = run(loader2, s2, start_epoch=1)
    assert len(tail) == len(full) - 7 == 8
    assert all(torch.equal(a, b) for a, b in zip(full[7:], tail))
    assert [_ids(b) for b in tail] == [x[:4] for x in ref[7:]]
    # epoch 0's permutation at the same offset differs, so the check above is meaningful
    assert [_ids(b) for b in tail[:3]] != [x[:4] for x in ref[2:5]]


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("old_world,new_world", [(2, 4), (4, 2)])
def test_world_size_change_from_global_state(num_workers, old_world, new_world):
    n, g = 60, 8  # 7 global batches per epoch
    consumed = 10  # epoch 1, global batch 3
    ref = _ref_global_batches(n, g, epochs=4)
    w1 = make_stateful_dataloader(_Ids(n), _sampler(n, g, 0, 1))
    w1_batches = _take(_stream(w1), consumed + 8)

    samplers = [_sampler(n, g, r, old_world) for r in range(old_world)]
    loaders = [make_stateful_dataloader(_Ids(n), s, num_workers=num_workers) for s in samplers]
    its = [_stream(ld) for ld in loaders]
    for it in its:
        _take(it, consumed)
    gstates = [global_state_from_loader_state(ld.state_dict()) for ld in loaders]
    assert all(gs == gstates[0] for gs in gstates)
    assert (gstates[0]["epoch"], gstates[0]["samples_consumed"]) == (1, 3 * g)
    if num_workers:  # prefetch ran the live sampler ahead; the loader snapshot did not
        assert samplers[0].global_state() != gstates[0]
    else:
        assert samplers[0].global_state() == gstates[0]
    del its, loaders

    new = []
    for r in range(new_world):
        s = _sampler(n, g, r, new_world)
        s.load_state_dict(gstates[0])
        new.append(_stream(make_stateful_dataloader(_Ids(n), s, num_workers=num_workers)))
    for step in range(8):  # crosses into epoch 2 after 4 steps
        parts = [next(it) for it in new]
        assert all(p.shape == (g // new_world, 2) for p in parts)
        glob = torch.cat(parts)
        assert torch.equal(glob, w1_batches[consumed + step])
        assert _ids(glob) == ref[consumed + step]


@pytest.mark.timeout(60)
def test_global_state_with_sparse_loader_snapshots():
    n, g = 60, 8
    s = _sampler(n, g, 1, 2)
    loader = make_stateful_dataloader(_Ids(n), s, num_workers=2, snapshot_every_n_steps=3)
    it = iter(loader)
    _take(it, 4)
    sd = loader.state_dict()
    assert sd["_steps_since_snapshot"] == 1  # the steps-since-snapshot path is exercised
    assert global_state_from_loader_state(sd)["samples_consumed"] == 4 * g
    _take(it, 3)  # the epoch's last batch
    gs = global_state_from_loader_state(loader.state_dict())
    assert (gs["epoch"], gs["samples_consumed"]) == (1, 0)


def test_world_size_not_dividing_batch_raises():
    with pytest.raises(ValueError) as err:
        check_world_size(24, 5)
    msg = str(err.value)
    assert "24" in msg and "world_size=5" in msg and "[1, 2, 3, 4, 6, 8, 12, 24]" in msg
    with pytest.raises(ValueError, match=r"\[1, 2, 3, 4, 6, 8, 12, 24\]"):
        ReshardableSampler(100, global_batch_size=24, rank=0, world_size=5)
    assert check_world_size(24, 3) == 8
    with pytest.raises(ValueError, match="rank"):
        ReshardableSampler(100, global_batch_size=24, rank=4, world_size=4)
    with pytest.raises(ValueError, match="dataset_len"):
        ReshardableSampler(10, global_batch_size=24, rank=0, world_size=4)


def test_load_state_dict_validates():
    s = _sampler(100, 24, 0, 3)
    good = _sampler(100, 24, 1, 4).state_dict()
    with pytest.raises(ValueError, match="global_batch_size"):
        s.load_state_dict({**good, "global_batch_size": 12})
    with pytest.raises(ValueError, match="dataset_len"):
        s.load_state_dict({**good, "dataset_len": 99})
    with pytest.raises(ValueError, match="samples_consumed=12"):
        s.load_state_dict({**good, "samples_consumed": 12})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 0})
    s.load_state_dict({**good, "epoch": 2, "samples_consumed": 48})
    assert (s.epoch, s.samples_consumed) == (2, 48)
    s.load_state_dict({**good, "epoch": 2, "samples_consumed": 96})  # the epoch's end
    assert (s.epoch, s.samples_consumed) == (3, 0)


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_new_iterator_goes_on_from_the_last_batch_returned(num_workers, persistent):
    """A peek (``next(iter(loader))``) or a ``break``, then a new iterator: it starts after the
    last batch returned, not where the workers' prefetch had moved the sampler (issue 24, item 1)."""
    n, g = 128, 8
    sampler = ReshardableSampler(n, global_batch_size=g, rank=0, world_size=1, seed=SEED)
    loader = make_stateful_dataloader(_Ids(n), sampler, num_workers=num_workers, persistent_workers=persistent)
    ref = _ref_global_batches(n, g, 2)
    ids = lambda batch: batch[:, 0].tolist()  # noqa: E731
    it = iter(loader)
    assert ids(next(it)) == ref[0]
    del it
    got = []
    for batch in loader:
        got.append(ids(batch))
        if len(got) == 3:
            break
    got += [ids(batch) for batch in loader]  # the rest of the epoch, after a break
    assert got == ref[1 : n // g]
    assert sampler.state_dict()["epoch"] == 1 and sampler.samples_seen == n
    assert [ids(batch) for batch in loader] == ref[n // g :]  # the next epoch is untouched


def test_make_stateful_dataloader_hides_torchdatas_own_deprecation_warning():
    """torchdata 0.11 calls torch's deprecated ``set_vital`` in its constructor: a warning at every
    run that the user can do nothing about."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loader = make_stateful_dataloader(
            list(range(8)), ReshardableSampler(8, global_batch_size=4, rank=0, world_size=1)
        )
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(8))  # a working loader
    assert not [w for w in seen if "set_vital" in str(w.message)], [str(w.message) for w in seen]
