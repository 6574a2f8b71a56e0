"""The data position is what the loader returned, never what its workers prefetched (issue 24,
item 1): a discarded iterator (a peek for shapes) skips nothing, and the checkpoint's counters
and resume agree with the batches the loop got."""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from distckpt import CheckpointConfig, CheckpointManager, ReshardableSampler, RetentionConfig, ScheduleConfig
from tests.distributed.harness import run_ranks, values

N, G, WORLD_SIZE, SEED = 256, 16, 2, 3


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _phase(rank: int, world_size: int, root: str, num_workers: int, *, load: bool, peek: bool, until: int) -> dict:
    """One run: a plain StatefulDataLoader passed to the manager, an optional peek
    (``it = iter(loader); next(it); del it``), then ``for batch in loader`` up to ``until``."""
    sampler = ReshardableSampler(N, global_batch_size=G, rank=rank, world_size=world_size, seed=SEED)
    # fork, as under torchrun (a spawned rank would spawn its workers: seconds of imports each)
    context = "fork" if num_workers else None
    loader = StatefulDataLoader(
        Ids(), batch_size=G // world_size, sampler=sampler, num_workers=num_workers, multiprocessing_context=context
    )
    manager = CheckpointManager(
        CheckpointConfig(root=root, schedule=ScheduleConfig(interval_steps=4), retention=RetentionConfig(keep_last=5)),
        model=torch.nn.Linear(1, 1),
        optimizer=None,
        dataloader=loader,
    )
    state = manager.load() if load else None
    step = state.step if state else 0
    peeked = None
    if peek:
        it = iter(loader)
        peeked = next(it).tolist()
        del it
    trained = {}
    for batch in loader:
        step += 1
        trained[step] = batch.tolist()
        manager.maybe_save(step)
        if step == until:
            break
    manager.close()
    loaded = None if state is None else (state.step, state.batch_in_epoch, state.global_samples_seen)
    return {"loaded": loaded, "peeked": peeked, "trained": trained}


def _three_runs(rank: int, world_size: int, root: str, num_workers: int) -> list[dict]:
    return [
        _phase(rank, world_size, root, num_workers, load=False, peek=True, until=6),  # fresh; saves step 4
        _phase(rank, world_size, root, num_workers, load=True, peek=True, until=8),  # resume; saves step 8
        _phase(rank, world_size, root, num_workers, load=True, peek=False, until=10),  # resume from step 8
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_discarded_iterator_skips_nothing_and_the_checkpoint_counts_what_was_returned(tmp_path, num_workers):
    results = values(run_ranks(_three_runs, WORLD_SIZE, str(tmp_path / "ckpt"), num_workers, timeout_s=150))
    for rank, (fresh, resumed, again) in enumerate(results):
        order = ReshardableSampler(N, global_batch_size=G, rank=rank, world_size=WORLD_SIZE, seed=SEED).rank_indices(0)
        batch = [order[k * G // WORLD_SIZE : (k + 1) * G // WORLD_SIZE] for k in range(N // G)]  # global batch k
        # Fresh start (no load()): the peek got batch 0, the loop batches 1, 2, ... (none prefetched skipped).
        assert fresh["peeked"] == batch[0]
        assert fresh["trained"] == {s: batch[s] for s in range(1, 7)}
        # The step-4 checkpoint counts the 5 batches returned (peek included): 80 samples, not more.
        assert resumed["loaded"] == (4, 5, 5 * G)
        assert resumed["peeked"] == batch[5]
        assert resumed["trained"] == {s: batch[s + 1] for s in range(5, 9)}
        # The step-8 checkpoint: 10 batches returned; its resume goes on with batch 10 exactly.
        assert again["loaded"] == (8, 10, 10 * G)
        assert again["trained"] == {9: batch[10], 10: batch[11]}
