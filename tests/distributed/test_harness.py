"""The rank harness itself: ranks forked from one warm zygote per session are still fresh
processes per call, see the caller's environment, working directory and output capture, report a
raising rank's traceback, and a hang fails in seconds without breaking the next call."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(120)

_PROBE = "DISTCKPT_HARNESS_PROBE"
_MARK: list[int] = []  # appended to by one call; a fresh process starts with it empty


def _facts(rank: int, world_size: int, tag: str) -> dict[str, Any]:
    import torch.distributed as dist

    seen = list(_MARK)
    _MARK.append(rank)
    os.environ["DISTCKPT_HARNESS_LEFTOVER"] = "1"  # must not reach the next call
    print(f"rank {rank} says {tag}", file=sys.stderr, flush=True)
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "probe": os.environ.get(_PROBE),
        "cwd": os.getcwd(),
        "world": (dist.get_rank(), dist.get_world_size()),
        "mark_before": seen,
    }


def _check_leftover(rank: int, world_size: int) -> dict[str, Any]:
    return {"env": os.environ.get("DISTCKPT_HARNESS_LEFTOVER"), "mark": list(_MARK)}


def test_ranks_are_fresh_forks_of_one_zygote_with_the_callers_env_cwd_and_capture(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(_PROBE, "first")
    monkeypatch.chdir(tmp_path)
    first = values(run_ranks(_facts, 2, "hello"))
    monkeypatch.setenv(_PROBE, "second")
    second = values(run_ranks(_facts, 2, "again"))
    for call, probe in ((first, "first"), (second, "second")):
        assert [r["world"] for r in call] == [(0, 2), (1, 2)]
        assert all(r["probe"] == probe and r["cwd"] == str(tmp_path) for r in call), call
        assert all(r["mark_before"] == [] for r in call)  # nothing a previous call did is left
    zygotes = {r["ppid"] for r in first + second}
    assert len(zygotes) == 1 and os.getpid() not in zygotes  # one zygote, not this process
    assert len({r["pid"] for r in first + second}) == 4  # a new process per rank and call
    assert values(run_ranks(_check_leftover, 2)) == [{"env": None, "mark": []}] * 2
    err = capfd.readouterr().err  # the ranks wrote into this test's capture
    assert "rank 0 says hello" in err and "rank 1 says again" in err


def test_fresh_spawns_a_new_interpreter(monkeypatch):
    monkeypatch.setenv(_PROBE, "spawned")
    out = values(run_ranks(_facts, 1, "fresh", fresh=True))
    assert out[0]["ppid"] == os.getpid() and out[0]["probe"] == "spawned"


def _raise_on_rank_1(rank: int, world_size: int) -> str:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return "fine"


def test_a_raising_rank_reports_its_traceback():
    results = run_ranks(_raise_on_rank_1, 2)
    assert results[0] == {"ok": True, "value": "fine"}
    assert not results[1]["ok"] and results[1]["type"] == "ValueError"
    assert results[1]["error"] == "ValueError: rank 1 refuses"
    assert "_raise_on_rank_1" in results[1]["traceback"]
    with pytest.raises(AssertionError, match="rank 1 refuses"):
        values(results)


def _hang_on_rank_0(rank: int, world_size: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_hang_times_out_in_seconds_kills_the_ranks_and_the_next_call_works(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="ranks still running after 3"):
        run_ranks(_hang_on_rank_0, 2, str(tmp_path), timeout_s=3)
    assert time.monotonic() - t0 < 30
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    assert not any(_alive(p) for p in pids), pids
    assert values(run_ranks(_raise_on_rank_1, 1)) == ["fine"]
