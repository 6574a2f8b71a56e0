"""Multi-node facts: ranks per node from LOCAL_WORLD_SIZE; a root that is not shared storage
(node-local disks, simulated by giving the ranks different roots) is refused at construction."""

from __future__ import annotations

import os
from typing import Any

import pytest

from distckpt import CheckpointConfig, CheckpointManager, ConfigError
from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import Net


def _construct(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    if opts.get("local_world_size"):
        os.environ["LOCAL_WORLD_SIZE"] = opts["local_world_size"]
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
        assert "is not the same storage on every node: rank(s) 1 (host" in r["error"]
        assert "use a shared file system" in r["error"]
    assert out[0]["files"] == []  # rank 0's probe removed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, expected", [(None, 2), ("1", 1)], ids=["by_host", "LOCAL_WORLD_SIZE"])
def test_ranks_per_node_from_local_world_size(tmp_path, env, expected) -> None:
    root = str(tmp_path / "ckpt")
    out = values(run_ranks(_construct, 2, {"roots": [root, root], "local_world_size": env}, timeout_s=90))
    assert [r["local_world_size"] for r in out] == [expected, expected]
    assert all(not any(f.startswith(".shared-probe-") for f in r["files"]) for r in out)
