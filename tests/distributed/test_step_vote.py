"""The step vote (issue 34, item 1): a step with nothing due never waits for the other ranks, a
SIGTERM on one rank still makes every rank save the same step, and the preemption exit never
barriers the (possibly NCCL) default group."""

import os
import signal
import time

import pytest

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(180)

LATE_S = 1.0


def late_peer(rank, world_size, opts):
    import torch.distributed as dist

    from distckpt import CheckpointConfig, CheckpointManager, PreemptionConfig, ScheduleConfig
    from tests.distributed.trainer import build

    model, optimizer, *_ = build(rank, world_size, {"wrapper": "ddp"})
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=100, interval_s=3600.0),  # a clock to vote on too
        preemption=PreemptionConfig(exit=False),
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    dist.barrier()
    if rank == 1:  # rank 1's step 1 runs LATE_S longer (a straggler, a slow data batch)
        time.sleep(LATE_S)
    t0 = time.perf_counter()
    manager.maybe_save(1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    manager.maybe_save(2)  # reads step 1's vote: rank 0 waits here for rank 1's step 1 to end
    second = time.perf_counter() - t0
    manager.close()
    return {"first": first, "second": second}


def test_a_step_with_nothing_due_does_not_wait_for_a_late_rank(tmp_path):
    """Before the vote, every ``maybe_save`` all-reduced the SIGTERM flag: rank 0's step 1 waited
    ``LATE_S`` for rank 1. Now a step only starts the vote; the wait, if any, is for the previous
    step's vote, which a late rank makes late only by the time it is behind."""
    out = values(run_ranks(late_peer, 2, {"root": str(tmp_path)}, timeout_s=120))
    assert out[0]["first"] < LATE_S / 4, out
    assert out[0]["second"] > LATE_S / 2, out  # the vote is still a collective: step 2 finds rank 1 late


def sigterm_one_rank(rank, world_size, opts):
    from distckpt import CheckpointConfig, CheckpointManager, PreemptionConfig, ScheduleConfig
    from tests.distributed.trainer import build

    model, optimizer, *_ = build(rank, world_size, {"wrapper": "ddp"})
    config = CheckpointConfig(
        root=opts["root"], schedule=ScheduleConfig(interval_steps=None), preemption=PreemptionConfig(exit=False)
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    saved = []
    for step in range(1, 10):
        if step == opts["signal_at"] and rank == opts["victim"]:
            os.kill(os.getpid(), signal.SIGTERM)
        if manager.maybe_save(step):
            saved.append(step)
        if manager.preempted:
            break
    manager.close()
    return {"saved": saved, "stopped": step}


@pytest.mark.parametrize("world_size, victim", [(2, 1), (4, 0)])
def test_sigterm_on_one_rank_saves_the_next_step_on_every_rank(tmp_path, world_size, victim):
    out = values(run_ranks(sigterm_one_rank, world_size, {"root": str(tmp_path), "signal_at": 4, "victim": victim}))
    assert out == [{"saved": [5], "stopped": 5}] * world_size
    assert (tmp_path / "latest").read_text().strip() == "step-000000005"


def tear_down(rank, world_size, opts):
    import torch.distributed as dist

    from distckpt._coord.collective import Collective

    collective = Collective(None, timeout_s=60.0)
    groups, real = [], dist.barrier

    def recording_barrier(group=None, **kw):
        groups.append(group)
        return real(group=group, **kw)

    dist.barrier = recording_barrier
    try:
        collective.tear_down_for_exit()
    finally:
        dist.barrier = real
    return {"barriers": len(groups), "default_group": sum(g is None or g is dist.group.WORLD for g in groups)}


def test_the_preemption_exit_barriers_only_distckpts_gloo_group(tmp_path):
    out = values(run_ranks(tear_down, 2, {}))
    assert out == [{"barriers": 1, "default_group": 0}] * 2
