"""A rank that is gone before a save is named in seconds; one that is only slow is waited for.

The manager's entry check (``Collective.arrive``) waited ``coordination.arrival_timeout_s``
(600 s by default) for a rank whose node was lost just before a save (seen once in the chaos
run's node loss). Each rank now bumps a heartbeat counter on the store (``_coord/liveness.py``);
a missing rank whose counter stands still for ``coordination.liveness_timeout_s`` is named in a
``RankLostError`` on every waiting rank.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.distributed.harness import run_ranks, values

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

LIVENESS_S = 3.0


def _manager(root: str, liveness_s: float | None = LIVENESS_S):
    from distckpt import CheckpointConfig, CheckpointManager, CoordinationConfig, ScheduleConfig
    from tests.distributed.trainer import Net

    config = CheckpointConfig(
        root=root,
        schedule=ScheduleConfig(interval_steps=None),
        coordination=CoordinationConfig(liveness_timeout_s=liveness_s),  # timeout_s: the default 600 s
    )
    return CheckpointManager(config, model=Net(), optimizer=None)


def killed_before_save(rank, world_size, opts):
    """The last rank SIGKILLs itself (its process gone at once, as on a node loss) before save(1)."""
    import torch.distributed as dist

    from distckpt import RankLostError

    manager = _manager(opts["root"])
    # Every rank past construction (its process groups connected) before the kill: a rank still
    # connecting a group to the killed one fails there instead (gloo: "connection closed by peer").
    dist.barrier()
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        manager.save(1)
        return {"outcome": "saved", "seconds": time.monotonic() - t0}
    except RankLostError as e:
        return {
            "outcome": type(e).__name__,
            "lost": e.lost_ranks,
            "missing": e.missing_ranks,
            "message": str(e),
            "seconds": time.monotonic() - t0,
        }


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_killed_before_a_save_is_named_lost_within_seconds(tmp_path, world_size):
    # Before the heartbeat the survivors waited arrival_timeout_s = 600 s: run_ranks' 90 s
    # timeout failed this test.
    results = run_ranks(
        killed_before_save,
        world_size,
        {"root": str(tmp_path)},
        timeout_s=90,
        expect_death=True,
        keep_survivors=True,
    )
    assert results[-1] is None  # the killed rank
    survivors = values(results[:-1])
    lost = world_size - 1
    for out in survivors:
        assert out["outcome"] == "RankLostError", out
        assert out["lost"] == [lost] and out["missing"] == [lost]
        assert f"rank(s) [{lost}] are lost" in out["message"]
        assert "coordination.liveness_timeout_s=3 s" in out["message"]
        assert "restart" in out["message"]
        # liveness_timeout_s after the watch starts (at the first poll: 1 s into the wait on a TCPStore,
        # 2 s on the FileStore here), to the poll: measured 6.0 s; far below arrival_timeout_s, 600 s.
        assert LIVENESS_S < out["seconds"] < LIVENESS_S + 10, out["seconds"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("step-")]  # nothing committed


def slow_but_alive(rank, world_size, opts):
    """Rank 1 computes (pure Python, the GIL taken and given back) for 3x liveness_timeout_s
    before save(1), then sleeps as long before load(): both are waited for."""
    manager = _manager(opts["root"])
    out = {}
    for name, call in (("save", lambda: manager.save(1)), ("load", manager.load)):
        if rank == 1:
            end = time.monotonic() + 3 * LIVENESS_S
            if name == "save":
                while time.monotonic() < end:
                    sum(i * i for i in range(10_000))
            else:
                time.sleep(3 * LIVENESS_S)
        t0 = time.monotonic()
        call()
        out[f"{name}_s"] = time.monotonic() - t0
    manager.close()
    return out


def test_a_slow_rank_whose_heartbeat_goes_on_is_waited_for(tmp_path):
    r0, r1 = values(run_ranks(slow_but_alive, 2, {"root": str(tmp_path)}, timeout_s=120))
    assert r0["save_s"] > 3 * LIVENESS_S - 0.5 and r0["load_s"] > 3 * LIVENESS_S - 0.5  # waited, then saved
    assert r1["save_s"] < 3 * LIVENESS_S  # rank 1 came last: no wait
    assert (tmp_path / "step-000000001").is_dir()


def heartbeat_stopped_or_absent(rank, world_size, opts):
    """Collective level. ``stopped``: rank 1 stops its heartbeat (a manager left by an exception
    does) and arrives 3x liveness_s late, after rank 0 gave up on it. ``absent``: rank 1 runs no
    heartbeat (an older distckpt) and never arrives: rank 0 falls back to its arrival timeout."""
    from distckpt import CollectiveMismatchError
    from distckpt._coord.collective import Collective

    case = opts["case"]
    collective = Collective(None, timeout_s=60, liveness_s=None if (case, rank) == ("absent", 1) else LIVENESS_S)
    out = {"heartbeat": collective.heartbeat is not None}
    if rank == 1:
        collective.stop_heartbeat()
        time.sleep(3 * LIVENESS_S if case == "stopped" else opts["arrival_s"] + 3)
        if case == "absent":
            return out
    t0 = time.monotonic()
    try:
        collective.arrive("save(step=1)", timeout_s=opts["arrival_s"])
        out["outcome"] = "arrived"
    except CollectiveMismatchError as e:
        out.update(outcome=type(e).__name__, message=str(e), lost=getattr(e, "lost_ranks", None))
    out["seconds"] = time.monotonic() - t0
    collective.stop_heartbeat()
    return out


def test_a_stopped_heartbeat_is_lost_and_the_late_rank_told_so(tmp_path):
    r0, r1 = values(run_ranks(heartbeat_stopped_or_absent, 2, {"case": "stopped", "arrival_s": 30}, timeout_s=90))
    assert r0["heartbeat"] and r1["heartbeat"]
    assert r0["outcome"] == "RankLostError" and r0["lost"] == [1], r0
    assert LIVENESS_S < r0["seconds"] < LIVENESS_S + 10
    assert r1["outcome"] == "RankLostError" and r1["lost"] == [1], r1  # it arrived after rank 0 gave up
    assert "after the other ranks had taken it for lost" in r1["message"]
    assert r1["seconds"] < 2  # at once


def test_a_rank_without_a_heartbeat_falls_back_to_the_arrival_timeout(tmp_path):
    arrival_s = 3 * LIVENESS_S
    r0, r1 = values(run_ranks(heartbeat_stopped_or_absent, 2, {"case": "absent", "arrival_s": arrival_s}, timeout_s=90))
    assert r0["heartbeat"] and not r1["heartbeat"]
    assert r0["outcome"] == "CollectiveMismatchError", r0  # not RankLostError: nothing to tell
    assert f"within coordination.arrival_timeout_s={arrival_s:g} s" in r0["message"]
    assert arrival_s - 0.5 < r0["seconds"] < arrival_s + 5
