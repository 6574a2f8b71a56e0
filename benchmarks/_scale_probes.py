"""Single-process probes of the pure pieces of distckpt whose cost grows with the world size W,
for ``bench_scale``: replica placement (``distckpt.memory.placement``) and the manifest a save at
W ranks commits (``distckpt.ondisk.manifest``), at W far beyond what this machine can fork.

These probes import the modules under test directly (not only the public API): they time pure
functions on synthetic inputs, no process group, no disk beyond sparse files. Each probe is one
small function so that a change of the module's shape (another manifest layout, per-rank digest
files) touches one place here.
"""

from __future__ import annotations

import functools
import os
import secrets
import tempfile
import time
from typing import Any, Callable

__all__ = ["manifest_probe", "placement_probe"]

RANKS_PER_NODE = 4


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def placement_probe(world_sizes: list[int], *, budget_s: float = 20.0, tensors: int = 256) -> list[dict[str, Any]]:
    """Per W: seconds one rank spends on its replica targets and sources (``NodeLayout``, one
    replica, nodes of 4 ranks) and on ``assign_replicated`` of ``tensors`` replicated tensors.

    A call is skipped (``None``) at every W after one that took longer than ``budget_s``: the
    quadratic ones would take minutes at W = 16,384.
    """
    from distckpt.memory.placement import NodeLayout, assign_replicated

    rows: list[dict[str, Any]] = []
    over: set[str] = set()
    sizes = {f"layer{i}.weight": 4096 * (1 + i % 7) for i in range(tensors)}
    for w in world_sizes:
        layout = NodeLayout(tuple(f"node{r // RANKS_PER_NODE}" for r in range(w)))
        rank = w - 1  # the last node: the ring's longest walk
        calls: dict[str, Callable[[], Any]] = {
            "targets_s": functools.partial(layout.targets, rank, 1),
            "sources_s": functools.partial(layout.sources, rank, 1),
            "assign_replicated_s": functools.partial(assign_replicated, sizes, w),
        }
        row: dict[str, Any] = {"world_size": w}
        for name, fn in calls.items():
            if name in over:
                row[name] = None
                continue
            row[name], _ = _timed(fn)
            if row[name] > budget_s:
                over.add(name)
        rows.append(row)
    return rows


def _rank_files(world_size: int, bytes_per_rank: int) -> dict[str, Any]:
    """What the ranks' writers report for a save of ``bytes_per_rank`` per rank, as DCP writes it
    with one writer thread: one data file per rank (``__<rank>_0.distcp``) with its block digests
    cut as ``BlockHasher`` cuts one large write, plus ``.metadata``."""
    from distckpt.ondisk.integrity import BLOCK_SPLIT, MAX_BLOCK_BYTES, MIN_BLOCK_BYTES, BlockDigests, WrittenFile

    block = min(max(-(-bytes_per_rank // BLOCK_SPLIT), MIN_BLOCK_BYTES), MAX_BLOCK_BYTES)
    ends = tuple(range(block, bytes_per_rank, block)) + (bytes_per_rank,)
    digest = secrets.token_hex(16)
    hashes = tuple(secrets.token_hex(16) for _ in ends)  # one set shared by every rank: only sizes matter
    files: dict[str, Any] = {
        f"__{r}_0.distcp": WrittenFile(bytes_per_rank, digest, BlockDigests(ends, hashes)) for r in range(world_size)
    }
    files[".metadata"] = WrittenFile(1024 * world_size, digest)
    return files


def _manifest(world_size: int, files: dict[str, Any], pending: str) -> Any:
    """The manifest rank 0 commits for ``files`` (the store's ``list_files``, as a save builds it)."""
    from distckpt import __version__
    from distckpt.ondisk.manifest import Manifest, TensorSpec, model_fingerprint
    from distckpt.storage import open_store

    store = open_store(os.path.dirname(pending))
    model = {f"layers.{i}.weight": TensorSpec(shape=[4096, 4096], dtype="torch.bfloat16") for i in range(64)}
    return Manifest(
        step=1000,
        world_size=world_size,
        wrapper="fsdp2",
        state_dict_type="sharded",
        torch_version="probe",
        distckpt_version=__version__,
        model=model,
        model_fingerprint=model_fingerprint(model),
        files=store.list_files(pending, files),
    )


def manifest_probe(world_sizes: list[int], *, bytes_per_rank: int = 8 << 30) -> list[dict[str, Any]]:
    """Per W: the size (bytes) of the manifest a save of ``bytes_per_rank`` per rank commits, and
    seconds to build and to serialise it. The data files are sparse (sizes only, no disk used)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-manifest-") as tmp:
        for w in world_sizes:
            pending = os.path.join(tmp, f"w{w}")
            os.makedirs(pending)
            files = _rank_files(w, bytes_per_rank)
            for name, entry in files.items():
                with open(os.path.join(pending, name), "wb") as f:
                    f.truncate(entry[0])
            build_s, manifest = _timed(functools.partial(_manifest, w, files, pending))
            json_s, text = _timed(manifest.to_json)
            rows.append(
                {
                    "world_size": w,
                    "bytes_per_rank": bytes_per_rank,
                    "manifest_bytes": len(text.encode()),
                    "build_s": build_s,
                    "to_json_s": json_s,
                }
            )
            for name in files:
                os.remove(os.path.join(pending, name))
    return rows
