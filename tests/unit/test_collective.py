"""distckpt/_coord/collective.py on its own: agree() in one process and on two gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from distckpt import _errors as errors
from distckpt._coord.collective import Collective
from tests.distributed.harness import run_ranks, values


@pytest.fixture
def single(monkeypatch) -> Collective:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return Collective(None, timeout_s=10)


def test_single_process_collectives_are_the_identity(single: Collective) -> None:
    assert (single.enabled, single.group, single.rank, single.world_size) == (False, None, 0, 1)
    assert single.all_gather({"a": 1}) == [{"a": 1}]
    assert single.broadcast(("x", 2)) == ("x", 2)
    single.barrier()
    single.arrive("save(step=1)", timeout_s=0.1)  # nothing to wait for
    assert single.agree(lambda: 42, what="probe") == 42


def test_single_process_agree_converts_foreign_errors_and_keeps_distckpt_types(single: Collective) -> None:
    def boom() -> None:
        raise OSError("disk gone")

    with pytest.raises(errors.CheckpointNotFoundError) as e:
        single.agree(boom, what="reading the root", error_type=errors.CheckpointNotFoundError)
    assert str(e.value) == "reading the root failed on rank 0: OSError: disk gone"
    assert isinstance(e.value.__cause__, OSError)
    with pytest.raises(errors.DistCkptError) as e:  # the default error type
        single.agree(boom, what="probe")
    assert type(e.value) is errors.DistCkptError

    original = errors.CheckpointCorruptError("f.distcp: bad hash", path="f.distcp")

    def corrupt() -> None:
        raise original

    with pytest.raises(errors.CheckpointCorruptError) as e:
        single.agree(corrupt, what="loading", error_type=errors.ConfigError)
    assert e.value is original and e.value.path == "f.distcp"  # one rank: the error itself


def test_without_a_process_group_a_torchrun_rank_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(errors.ConfigError, match="WORLD_SIZE=4 in the environment \\(rank 2"):
        Collective(None, timeout_s=10)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(errors.ConfigError, match="a process_group was passed"):
        Collective(object(), timeout_s=10)  # type: ignore[arg-type]


CASES = {
    "none": None,
    "foreign": ("IncompatibleCheckpointError", "planning the load failed on rank 1: KeyError: 'shard 7'"),
    "distckpt": (
        "CheckpointCorruptError",
        "planning the load failed on rank 1: CheckpointCorruptError: x.distcp: size 1, expected 2",
    ),
    "both": (
        "IncompatibleCheckpointError",
        "planning the load failed on rank 0 (failed on ranks [0, 1]): RuntimeError: rank 0 broke",
    ),
    "misfit": (
        "IncompatibleCheckpointError",
        "planning the load failed on rank 1: IncompatibleCheckpointError: 1 key missing",
    ),
}
ATTRIBUTES = {  # a DistCkptError's attributes reach every rank
    "foreign": {"missing": [], "unexpected": [], "mismatched": []},
    "distckpt": {"path": "x.distcp"},
    "misfit": {"missing": ["head.weight"], "unexpected": ["lm_head.weight"], "mismatched": []},
}


def _agree_on_two(rank: int, world_size: int) -> dict[str, Any]:
    collective = Collective(None, timeout_s=30)
    out: dict[str, Any] = {
        "gathered": collective.all_gather(rank * 10),
        "told": collective.broadcast(f"from rank {rank}"),
    }
    for case in CASES:  # the ranks stay in step after a failed agree: the next one works

        def step(case: str = case) -> str:
            if case == "foreign" and rank == 1:
                raise KeyError("shard 7")
            if case == "distckpt" and rank == 1:
                raise errors.CheckpointCorruptError("x.distcp: size 1, expected 2", path="x.distcp")
            if case == "both":
                raise RuntimeError(f"rank {rank} broke")
            if case == "misfit" and rank == 1:
                raise errors.IncompatibleCheckpointError(
                    "1 key missing", missing=["head.weight"], unexpected=["lm_head.weight"]
                )
            return f"ok {rank}"

        try:
            out[case] = collective.agree(step, what="planning the load", error_type=errors.IncompatibleCheckpointError)
        except errors.DistCkptError as e:
            out[case] = (type(e).__name__, str(e))
            out[f"{case} attributes"] = vars(e)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_agree_on_two_ranks_raises_the_same_error_everywhere() -> None:
    """A failure on one rank raises on every rank: the same type (a DistCkptError keeps its
    own, anything else becomes error_type) and a message naming the failing rank(s)."""
    r0, r1 = values(run_ranks(_agree_on_two, 2, timeout_s=90))
    assert r0["gathered"] == r1["gathered"] == [0, 10]
    assert r0["told"] == r1["told"] == "from rank 0"
    assert (r0["none"], r1["none"]) == ("ok 0", "ok 1")
    for case, expect in CASES.items():
        if expect is not None:
            assert r0[case] == r1[case] == expect, case
    for case, attributes in ATTRIBUTES.items():
        assert r0[f"{case} attributes"] == r1[f"{case} attributes"] == attributes, case


def _lead_on_two(rank: int, world_size: int) -> dict[str, Any]:
    collective = Collective(None, timeout_s=30)
    calls: list[str] = []

    def read() -> str:
        calls.append("read")
        return f"read by rank {rank}"

    def corrupt() -> str:
        calls.append("corrupt")
        raise errors.CheckpointCorruptError("x/.metadata: unreadable", path="x/.metadata")

    out: dict[str, Any] = {"value": collective.lead(read, what="reading x")}
    try:
        collective.lead(corrupt, what="reading x", error_type=errors.CheckpointCorruptError)
    except errors.CheckpointCorruptError as e:
        out["error"] = (type(e).__name__, str(e), e.path)
    out["calls"] = calls
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_lead_runs_on_rank_0_only_and_its_result_or_error_reaches_every_rank() -> None:
    r0, r1 = values(run_ranks(_lead_on_two, 2, timeout_s=90))
    assert r0["value"] == r1["value"] == "read by rank 0"
    expect = ("CheckpointCorruptError", "reading x failed on rank 0: CheckpointCorruptError: x/.metadata: unreadable")
    assert r0["error"] == r1["error"] == (*expect, "x/.metadata")
    assert r0["calls"] == ["read", "corrupt"] and r1["calls"] == []
