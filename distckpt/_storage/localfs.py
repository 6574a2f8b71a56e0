"""Durable writes on a local file system: the two primitives of the POSIX commit protocol, also
used for files outside a checkpoint root (a release directory's config and model card)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: tmp file, fsync, ``os.replace``, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
