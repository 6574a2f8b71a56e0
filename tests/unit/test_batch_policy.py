"""batch_policy keep_local_batch and step_rule (issue 16 item 1): the sampler carries its position
over in samples to another global batch, exactly once per epoch; the step rule moves step and LR."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import Dataset

from distckpt import CheckpointConfig, ConfigError, ElasticConfig, IncompatibleCheckpointError
from distckpt._data import ReshardableSampler, global_state_from_loader_state, make_stateful_dataloader
from distckpt._data.reshard import DataLoaderState
from distckpt._state.rebatch import apply_step_rule, move_scheduler
from distckpt._state.train_state import TrainState

pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")

SEED = 3


class _Ids(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _perm(n: int, epoch: int) -> List[int]:
    """The documented order, independent of the sampler."""
    g = torch.Generator()
    g.manual_seed((SEED * 1_000_003 + epoch) % 2**63)
    return torch.randperm(n, generator=g).tolist()


def _samplers(n: int, g: int, world: int) -> List[ReshardableSampler]:
    return [ReshardableSampler(n, global_batch_size=g, rank=r, world_size=world, seed=SEED) for r in range(world)]


def _global_batches(samplers: List[ReshardableSampler], steps: int) -> List[List[int]]:
    """``steps`` global batches (rank slices concatenated) from the samplers' current position,
    starting a new epoch's pass whenever one ends, as a training loop does."""
    b = samplers[0].local_batch_size
    its = [iter(s) for s in samplers]
    out: List[List[int]] = []
    while len(out) < steps:
        parts = []
        for k, s in enumerate(samplers):
            part = [i for _, i in zip(range(b), its[k])]
            if not part:  # epoch over: next pass
                its[k] = iter(s)
                part = [i for _, i in zip(range(b), its[k])]
            parts.append(part)
        out.append([i for p in parts for i in p])
    return out


def _epoch_of_each(batches: List[List[int]], n: int, first_epoch: int = 0, pos: int = 0) -> Dict[int, List[int]]:
    """Ids per epoch: a batch that no longer fits after ``pos`` samples opens the next epoch."""
    per: Dict[int, List[int]] = {}
    epoch = first_epoch
    for ids in batches:
        if pos + len(ids) > n:
            epoch, pos = epoch + 1, 0
        per.setdefault(epoch, []).extend(ids)
        pos += len(ids)
    return per


@pytest.mark.parametrize("consumed_batches", [3, 4], ids=["off-grid", "on-grid"])
def test_keep_local_batch_2_to_4_every_sample_once(consumed_batches: int) -> None:
    n = 100  # 2 ranks x 4 = G 8 -> 4 ranks x 4 = G 16
    old = _samplers(n, 8, 2)
    before = _global_batches(old, consumed_batches)  # 24 (not a multiple of 16) or 32 samples
    state = old[0].state_dict()
    c = consumed_batches * 8
    assert state["samples_consumed"] == c

    new = _samplers(n, 16, 4)
    for s in new:
        s.load_state_dict(state, batch_policy="keep_local_batch")
    after = _global_batches(new, 12)
    assert all(len(ids) == 16 for ids in after)  # whole global batches, b per rank
    # The resumed epoch: perm[:c] before, then perm[c:] in batches of 16 while one fits.
    k = (n - c) // 16
    epoch0 = [i for ids in before for i in ids] + [i for ids in after[:k] for i in ids]
    assert epoch0 == _perm(n, 0)[: c + k * 16]  # in order, nothing rounded away
    assert len(set(epoch0)) == len(epoch0)  # each sample once
    assert n - len(epoch0) < 16  # only the epoch's tail of < G is left out
    # Epoch 1 is an ordinary epoch at G = 16.
    assert [i for ids in after[k : k + 6] for i in ids] == _perm(n, 1)[:96]
    assert new[0].samples_seen == c + k * 16 + (len(after) - k) * 16
    assert new[0].state_dict()["samples_before_epoch"] == c + k * 16 + 96  # epochs 0 and 1 ended


def test_keep_local_batch_4_to_2() -> None:
    n = 100
    old = _samplers(n, 16, 4)
    before = _global_batches(old, 3)
    new = _samplers(n, 8, 2)
    for s in new:
        s.load_state_dict(old[1].state_dict(), batch_policy="keep_local_batch")
    after = _global_batches(new, 9)  # 48 + 9 * 8 = 120: into epoch 1
    per = _epoch_of_each(before + after, n)
    assert per[0] == _perm(n, 0)[:96] and per[1] == _perm(n, 1)[: len(per[1])]
    assert all(max(Counter(ids).values()) == 1 for ids in per.values())


def test_off_grid_position_survives_a_further_save_and_resume() -> None:
    """After an off-grid resume the grid starts at batch_offset: a later same-G resume (torchdata's
    own state, num_workers 0 and 2) and a resume back to the old G continue exactly."""
    n = 100
    old = _samplers(n, 8, 2)
    _global_batches(old, 3)  # 24 samples
    state = old[0].state_dict()
    ref_new = _samplers(n, 16, 4)
    for s in ref_new:
        s.load_state_dict(state, batch_policy="keep_local_batch")
    ref = _global_batches(ref_new, 6)  # 4 batches to the epoch end, then epoch 1
    for workers in (0, 2):
        loaders = []
        for r in range(4):
            s = ReshardableSampler(n, global_batch_size=16, rank=r, world_size=4, seed=SEED)
            s.load_state_dict(state, batch_policy="keep_local_batch")
            loaders.append(make_stateful_dataloader(_Ids(n), s, num_workers=workers))
        its = [iter(ld) for ld in loaders]
        first = [[i for it in its for i in next(it).tolist()] for _ in range(2)]
        assert first == ref[:2]
        local = [ld.state_dict() for ld in loaders]
        gstate = global_state_from_loader_state(local[0])
        assert (gstate["samples_consumed"], gstate["batch_offset"]) == (24 + 32, 8)
        del its
        resumed = []
        for r in range(4):
            s = ReshardableSampler(n, global_batch_size=16, rank=r, world_size=4, seed=SEED)
            ld = make_stateful_dataloader(_Ids(n), s, num_workers=workers)
            ld.load_state_dict(local[r])
            resumed.append(ld)
        rest = [[i for ld_batch in parts for i in ld_batch.tolist()] for parts in zip(*resumed)]
        assert rest == ref[2:4]  # the rest of the off-grid epoch, then it ends
    back = _samplers(n, 8, 2)  # and back to G = 8 from 56 samples
    for s in back:
        s.load_state_dict(gstate, batch_policy="keep_local_batch")
    tail = _global_batches(back, 5)
    assert [i for ids in tail for i in ids] == _perm(n, 0)[56:96]


def test_keep_global_batch_refuses_a_changed_global_batch() -> None:
    state = _samplers(100, 8, 2)[0].state_dict()
    s = _samplers(100, 16, 4)[0]
    with pytest.raises(ValueError, match="global_batch_size=8.*keep_local_batch"):
        s.load_state_dict(state)
    with pytest.raises(ValueError, match="batch_offset"):  # an off-grid position needs its offset
        s.load_state_dict({**state, "global_batch_size": 16, "samples_consumed": 24})

    class Loader:
        sampler = s

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, sd: dict) -> None:
            pass

    with pytest.raises(IncompatibleCheckpointError, match="global batch 8 .* global batch 16.*keep_local_batch"):
        DataLoaderState(Loader()).restore(None, state, rank=0, world_size=4, saved_world_size=2)


def test_config_validates_policy_and_rule(tmp_path: Any) -> None:
    cfg = CheckpointConfig(root=str(tmp_path))
    assert (cfg.elastic.batch_policy, cfg.elastic.step_rule) == ("keep_global_batch", "keep")
    with pytest.raises(ConfigError, match="batch_policy='keep_local'"):
        CheckpointConfig(root=str(tmp_path), elastic=ElasticConfig(batch_policy="keep_local"))
    with pytest.raises(ConfigError, match="step_rule='floor'"):
        CheckpointConfig(root=str(tmp_path), elastic=ElasticConfig(batch_policy="keep_local_batch", step_rule="floor"))
    with pytest.raises(ConfigError, match="needs batch_policy='keep_local_batch'"):
        CheckpointConfig(root=str(tmp_path), elastic=ElasticConfig(step_rule="rescale"))


def _lambda_scheduler(total: int = 100) -> torch.optim.lr_scheduler.LambdaLR:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / total)


def _stepped(make, steps: int):
    sched = make()
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
    return sched


@pytest.mark.parametrize(
    "make",
    [
        _lambda_scheduler,
        lambda: torch.optim.lr_scheduler.ExponentialLR(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 0.9
        ),
        lambda: torch.optim.lr_scheduler.CosineAnnealingLR(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), T_max=30
        ),
    ],
    ids=["lambda", "exponential", "cosine"],
)
@pytest.mark.parametrize("saved,now", [(20, 10), (10, 20)], ids=["back", "forward"])
def test_move_scheduler_equals_uninterrupted_at_the_new_step(make, saved: int, now: int) -> None:
    sched = make()
    sched.load_state_dict(_stepped(make, saved).state_dict())
    sched.optimizer.param_groups[0]["lr"] = _stepped(make, saved).optimizer.param_groups[0]["lr"]
    move_scheduler(sched, now - saved)
    ref = _stepped(make, now)
    assert sched.last_epoch == ref.last_epoch == now
    assert sched.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(ref.optimizer.param_groups[0]["lr"], rel=1e-12)


def test_move_scheduler_back_refuses_what_it_cannot_replay() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(IncompatibleCheckpointError, match="ReduceLROnPlateau"):
        move_scheduler(plateau, -3)


@pytest.mark.parametrize("rule", ["keep", "rescale"])
def test_apply_step_rule(rule: str) -> None:
    ts = TrainState(step=10, global_samples_seen=168)  # 10 steps of 16 + 8 seen before: not a multiple of 32
    sched = _stepped(_lambda_scheduler, 10)
    record = apply_step_rule(
        ts, sched, global_batch=(16, 32), world_size=(2, 4), batch_policy="keep_local_batch", step_rule=rule, rank=0
    )
    want = 168 // 32 if rule == "rescale" else 10
    assert ts.step == record["step_after"] == want == sched.last_epoch
    assert sched.get_last_lr()[0] == pytest.approx(1.0 - want / 100)
    assert record == {
        "batch_policy": "keep_local_batch",
        "step_rule": rule,
        "global_batch_before": 16,
        "global_batch_after": 32,
        "world_size_before": 2,
        "world_size_after": 4,
        "step_before": 10,
        "step_after": want,
        "global_samples_seen": 168,
    }


def test_state_saved_before_the_new_keys_loads_at_another_global_batch() -> None:
    """A sampler state of an earlier distckpt (no batch_offset / samples_before_epoch): earlier
    epochs count as whole epochs of the saved G."""
    old = {"seed": SEED, "epoch": 2, "samples_consumed": 24, "global_batch_size": 8, "dataset_len": 100}
    s = _samplers(100, 16, 4)[0]
    s.load_state_dict(old, batch_policy="keep_local_batch")
    assert (s.epoch, s.samples_consumed, s.samples_seen) == (2, 24, 2 * 96 + 24)
    assert s.state_dict()["batch_offset"] == 8
    assert s.rank_indices_from(2, 24)[:4] == _perm(100, 2)[24:28]
