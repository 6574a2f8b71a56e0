"""Where the memory tier keeps what: node identity, the memory directory, replica peers, and which
rank stores each replicated tensor (docs/memory.md, "How it works").

Node identity is distckpt's one definition (:func:`distckpt._coord.topology.node_id`:
``$DISTCKPT_NODE_ID`` when the launcher sets it, else the host name). Replicas follow
a ring over the nodes, as nvidia-resiliency-ext's local checkpoints replicate across nodes: the
``k``-th copy of a rank's snapshot goes to the rank of the same local index ``k`` nodes further
along (the nodes ordered by their lowest rank).
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re

from .._coord.topology import NODE_ENV, node_id

__all__ = [
    "NODE_ENV",
    "NodeLayout",
    "assign_replicated",
    "file_system_type",
    "job_key",
    "launch_id",
    "memory_dir",
    "node_id",
]


def launch_id() -> str:
    """The launch id: torchrun's ``$TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``; a fresh uuid per
    ``--standalone`` launch), empty without one. It stays the same across the worker restarts and
    membership changes of one launch: a snapshot is restored only into the launch that wrote it."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def job_key(root: str) -> str:
    """``job-<16 hex>`` from the checkpoint root, resolved (a relative path, ``./`` or a symlink name
    the same root once): one job per root (the root's lock), the same key on every node and across
    restarts, and another job's key differs."""
    where = root if "://" in root else os.path.realpath(root)
    return "job-" + hashlib.sha256(where.rstrip("/").encode()).hexdigest()[:16]


def memory_dir(template: str, node: str, root: str) -> str:
    """``<template with {node} replaced>/<job key>``: the only directory this job writes in."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
    return os.path.join(template.replace("{node}", safe), job_key(root))


def file_system_type(path: str) -> str | None:
    """The type (``tmpfs``, ``ext4``, ...) of the file system holding ``path``, from the mount
    table (``/proc/self/mounts``: the longest mount point above ``path``); ``None`` without one."""
    where, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])  # a space is written \040
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


class NodeLayout:
    """The job's ranks grouped by node, indexed once so that every query below costs O(ranks of a
    node x replicas), not O(world size): at thousands of ranks each rank asks them at start-up.

    Args:
        nodes: the node id of each rank, indexed by rank.
    """

    def __init__(self, nodes: tuple[str, ...]) -> None:
        self.nodes = nodes
        self._ranks: dict[str, list[int]] = {}
        for r, n in enumerate(nodes):
            self._ranks.setdefault(n, []).append(r)
        self._order = list(self._ranks)  # by lowest rank: dicts keep insertion order
        self._position = {n: i for i, n in enumerate(self._order)}
        self._local = {r: i for ranks in self._ranks.values() for i, r in enumerate(ranks)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeLayout) and other.nodes == self.nodes

    def __hash__(self) -> int:
        return hash(self.nodes)

    def __repr__(self) -> str:
        return f"NodeLayout(nodes={self.nodes!r})"

    @property
    def order(self) -> list[str]:
        """Node ids ordered by their lowest rank."""
        return list(self._order)

    def ranks_on(self, node: str) -> list[int]:
        """The ranks on ``node``, ascending (empty for a node without ranks)."""
        return list(self._ranks.get(node, ()))

    def _node_at(self, node: str, k: int) -> str:
        """The node ``k`` places after ``node`` on the ring (negative: before)."""
        return self._order[(self._position[node] + k) % len(self._order)]

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep copies of ``rank``'s snapshot: one on each of the ``replicas`` next
        nodes of the ring (fewer when the job has fewer other nodes), at the same local index
        modulo that node's rank count."""
        node, local, count = self.nodes[rank], self._local[rank], len(self._ranks)
        out = []
        for k in range(1, min(replicas, count - 1) + 1):
            peers = self._ranks[self._node_at(node, k)]
            out.append(peers[local % len(peers)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose snapshots ``rank`` keeps a copy of (the inverse of :meth:`targets`),
        ascending: of the node ``k`` places back on the ring, the ranks whose local index is
        ``rank``'s modulo the rank count of ``rank``'s node."""
        node, local, count = self.nodes[rank], self._local[rank], len(self._ranks)
        mine = len(self._ranks[node])
        out: set[int] = set()
        for k in range(1, min(replicas, count - 1) + 1):
            out.update(s for s in self._ranks[self._node_at(node, -k)] if self._local[s] % mine == local)
        return sorted(out)


def assign_replicated(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """``{fqn: rank}`` storing each replicated tensor once per job: largest first to the rank with
    the fewest bytes so far (ties: the lower rank). Every rank computes the same answer from the
    same ``sizes`` (bytes), as DCP's ``dedup_save_plans`` balances its writers. A heap of
    ``(bytes so far, rank)`` makes it O(T log W) for T tensors and W ranks."""
    heap = [(0, r) for r in range(world_size)]  # already a heap: sorted
    out = {}
    for fqn in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, rank = heap[0]
        out[fqn] = rank
        heapq.heapreplace(heap, (load + sizes[fqn], rank))
    return out
