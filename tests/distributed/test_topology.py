"""Multi-node facts: ranks per node from the one node definition (``DISTCKPT_NODE_ID``, else the
host name); a root that is not shared storage (node-local disks, simulated by giving the ranks
different roots) is refused at construction; the construction's collectives (one setup exchange)."""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
import torch.distributed as dist

from distckpt import CheckpointConfig, CheckpointManager, ConfigError
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import Net


def _construct(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # a count, not an identity: distckpt's nodes ignore it
    if opts.get("nodes"):
        os.environ["DISTCKPT_NODE_ID"] = opts["nodes"][rank]
    root = opts["roots"][rank]
    try:
        manager = CheckpointManager(CheckpointConfig(root=root), model=Net(), optimizer=None)
    except ConfigError as e:
        return {"error": str(e), "files": sorted(os.listdir(root)) if os.path.isdir(root) else None}
    out = {"local_world_size": manager.local_world_size, "files": sorted(os.listdir(root))}
    manager.close()
    return out


@pytest.mark.timeout(120)
def test_node_local_root_is_refused_on_every_rank(tmp_path) -> None:
    roots = [str(tmp_path / "node0" / "ckpt"), str(tmp_path / "node1" / "ckpt")]
    out = values(run_ranks(_construct, 2, {"roots": roots}, timeout_s=90))
    for r in out:
        assert "error" in r, r
        assert "is not the same storage on every node: rank(s) 1 (node " in r["error"]
        assert "use a shared file system" in r["error"]
    assert out[0]["files"] == []  # rank 0's probe removed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes, expected", [(None, 2), (["a", "b"], 1)], ids=["by_host", "DISTCKPT_NODE_ID"])
def test_ranks_per_node_from_the_node_id(tmp_path, nodes, expected) -> None:
    root = str(tmp_path / "ckpt")
    out = values(run_ranks(_construct, 2, {"roots": [root, root], "nodes": nodes}, timeout_s=90))
    assert [r["local_world_size"] for r in out] == [expected, expected]
    assert all(not any(f.startswith(".shared-probe-") for f in r["files"]) for r in out)


COUNTED = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "barrier"]
COUNTED += ["all_reduce", "broadcast", "all_gather", "new_group"]


def _count_setup(rank: int, world_size: int, root: str, mem: str) -> dict[str, int]:
    """The torch.distributed calls of one construction with every setup part on (lock, memory tier
    with a replica on the other node, preemption): counted by wrapping ``torch.distributed``'s functions."""
    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    counts: collections.Counter = collections.Counter()

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(dist, name, counting(name, getattr(dist, name)))
    memory = {"enabled": True, "dir": os.path.join(mem, "{node}"), "replicas": 1}
    config = CheckpointConfig(root=root, memory=memory, preemption={"enabled": True}, async_save={"mode": "off"})
    manager = CheckpointManager(config, model=Net(), optimizer=None)
    built = dict(counts)
    manager.close()
    return built


@pytest.mark.timeout(120)
def test_construction_is_one_setup_exchange(tmp_path) -> None:
    root, mem = str(tmp_path / "ckpt"), str(tmp_path / "mem")
    out = values(run_ranks(_count_setup, 2, root, mem, timeout_s=90))
    # One group each for the manager, the step vote and the replicas; the setup exchange, the shared
    # root's flag and the memory tier's capacity check (main: 15 calls, 3 broadcasts of random ids).
    assert out == [{"new_group": 3, "all_gather_object": 3}] * 2
