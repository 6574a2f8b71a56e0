"""Blocking DCP save/load that raise distckpt errors instead of DCP's ``BaseException``."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..errors import CheckpointCorruptError
from .safe_io import SafeFileSystemReader, SafeLoadPlanner

__all__ = ["dcp_save", "dcp_load", "describe_exception"]


def describe_exception(exc: BaseException) -> str:
    """One line ``Type: message``; DCP's ``CheckpointException`` is unwrapped to the original
    exception of each failed rank (``DCP rank r: OSError: ...``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            inner = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"DCP rank {rank}: {describe_exception(inner)}")
        return "; ".join(parts)[:1000]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def dcp_save(
    state_dict: dict[str, Any],
    directory: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None,
    thread_count: int = 1,
) -> None:
    """``dcp.save`` into ``directory`` with per-file fsync. All ranks call it.

    Raises:
        BaseException: whatever DCP raises on this rank; the caller gathers outcomes across
            ranks before deciding (see ``CheckpointManager.save``).
    """
    writer = FileSystemWriter(os.fspath(directory), sync_files=True, thread_count=thread_count)
    dcp.save(state_dict, storage_writer=writer, process_group=process_group)


def dcp_load(
    state_dict: dict[str, Any],
    directory: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None,
) -> None:
    """``dcp.load`` in place into ``state_dict``, reading metadata and non-tensor items safely.

    Raises:
        CheckpointCorruptError: unreadable/unsafe files or a missing key; names the directory.
    """
    reader = SafeFileSystemReader(os.fspath(directory))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group)
    except CheckpointCorruptError:
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointCorruptError(
            f"{directory}: DCP load failed ({describe_exception(e)})", path=os.fspath(directory)
        ) from e
