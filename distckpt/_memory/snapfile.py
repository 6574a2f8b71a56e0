"""One rank's snapshot as a file in node-local shared memory (docs/memory.md, "How it works").

A snapshot file holds the items of one rank's DCP save plan for one step::

    [preamble: 64 bytes][item data, each item 64-byte aligned][header: JSON]

The preamble is ``magic, header offset, header length, xxh3-64 of the header``; the header
names the job, the generation (one start of the workers), step, rank, world size, the xxh3-64 of
the data region and each item (DCP fqn, kind, chunk offsets and sizes, global size, dtype, byte
offset, length). A file is written under a ``.partial`` name and renamed to its final name
(:func:`snapshot_name`) only after the header and its hashes: the rename is the mark of a
complete snapshot. A reused slot is renamed back to ``.partial`` before it is overwritten.

Space is reserved with ``posix_fallocate`` before anything is written, so a full tmpfs is an
``OSError`` (ENOSPC) here, never a ``SIGBUS`` on a later write through the mapping.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .._errors import CheckpointCorruptError

__all__ = [
    "ALIGN",
    "PREAMBLE",
    "SlotFile",
    "SnapshotHeader",
    "file_gen",
    "parse_name",
    "read_header",
    "snapshot_name",
]

MAGIC = b"DCKMEM01"
PREAMBLE = 64
ALIGN = 64
_PREAMBLE = struct.Struct("<8sQQQ")  # magic, header offset, header length, xxh3-64 of the header
_NAME = re.compile(r"^step-(\d+)\.rank-(\d+)-of-(\d+)\.([0-9a-f]+)\.snap$")
_SLOT = re.compile(r"^slot-(?:own|replica)-\d+-[01]\.([0-9a-f]+)\.partial$")  # a slot being written


def snapshot_name(step: int, rank: int, world_size: int, gen: str) -> str:
    """``step-<step>.rank-<rank>-of-<world size>.<gen>.snap``: the name of a complete snapshot."""
    return f"step-{step:09d}.rank-{rank:05d}-of-{world_size}.{gen}.snap"


def parse_name(name: str) -> tuple[int, int, int, str] | None:
    """``(step, rank, world size, gen)`` of a complete snapshot's file name, else ``None``."""
    m = _NAME.match(name)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]), m[4])


def file_gen(name: str) -> str | None:
    """The generation in ``name`` when it is one of the memory tier's own file names (a complete
    snapshot or a slot being written), else ``None``: the only files distckpt ever deletes there."""
    parsed, slot = parse_name(name), _SLOT.match(name)
    return parsed[3] if parsed else (slot[1] if slot else None)


@dataclass
class SnapshotHeader:
    """What a snapshot file says about itself.

    Attributes:
        job, gen: the job's key (from the root) and the generation of workers that wrote it (the first
            12 hex of the manager's start id, :class:`~distckpt._coord.topology.JobSetup`).
        step, rank, world_size: of the training job at the snapshot.
        wrapper: the model's wrapper kind (``ddp``, ``fsdp2``, ...).
        data_bytes: length of the data region (bytes, from offset :data:`PREAMBLE`).
        data_hash: xxh3-64 of the data region, hex.
        items: ``[fqn, kind ("tensor" | "shard" | "bytes"), chunk offsets, chunk sizes, global
            size, dtype name, byte offset, length]`` per item (offsets/sizes ``None`` for bytes).
        run: the launch id (``$TORCHELASTIC_RUN_ID``, torchrun's ``--rdzv-id``; empty without one).
        paths: ``{fqn: path in the nested state_dict}`` of the items (DCP's flattening mapping, its
            ``Metadata.planner_data``): a restore completes its target with the saved keys that a
            fresh one lacks (LBFGS's history), as a load from the durable tier does.
    """

    job: str
    gen: str
    step: int
    rank: int
    world_size: int
    wrapper: str
    data_bytes: int
    data_hash: str
    items: list[list[Any]]
    run: str = ""
    paths: dict[str, list[Any]] = field(default_factory=dict)


def data_hash(view: memoryview | bytes) -> str:
    """xxh3-64 (hex) of ``view``: the hash of a snapshot's data region."""
    return xxhash.xxh3_64_hexdigest(view)


class SlotFile:
    """A file in the memory directory, mapped writable and grown (never shrunk) on demand.

    Args:
        path: its current path (a ``.partial`` name while being written).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.size = 0
        self.mm: mmap.mmap | None = None

    def reserve(self, nbytes: int) -> None:
        """Make the file at least ``nbytes`` long, its pages allocated.

        Raises:
            OSError: ENOSPC when the file system cannot hold it (nothing is mapped past it).
        """
        if nbytes <= self.size:
            return
        nbytes += nbytes // 16  # slack: a snapshot that grows a little (loss history) keeps its mapping
        os.posix_fallocate(self.fd, 0, nbytes)
        if self.mm is not None:
            self.mm.close()
        self.mm = mmap.mmap(self.fd, nbytes)
        self.size = nbytes

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` sharing the file's memory at ``offset``."""
        assert self.mm is not None and offset + nbytes <= self.size
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A memoryview of ``nbytes`` at ``offset`` (release it before the next :meth:`reserve`)."""
        assert self.mm is not None
        return memoryview(self.mm)[offset : offset + nbytes]

    def seal(self, header: SnapshotHeader, final_path: str) -> None:
        """Write the header after the data and the preamble, then rename to ``final_path``:
        the snapshot is complete from that instant (and not before)."""
        blob = json.dumps(header.__dict__, separators=(",", ":")).encode()
        offset = PREAMBLE + header.data_bytes
        self.reserve(offset + len(blob))
        assert self.mm is not None
        self.mm[offset : offset + len(blob)] = blob
        self.mm[:PREAMBLE] = _PREAMBLE.pack(MAGIC, offset, len(blob), xxhash.xxh3_64_intdigest(blob)).ljust(
            PREAMBLE, b"\0"
        )
        self.rename(final_path)

    def rename(self, path: str) -> None:
        """Rename the file (atomic within the directory)."""
        if path != self.path:
            os.rename(self.path, path)
            self.path = path

    def close(self, *, delete: bool) -> None:
        """Unmap and close; with ``delete``, remove the file (its memory is then freed)."""
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        os.close(self.fd)
        if delete:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def read_header(path: str, *, verify: bool) -> SnapshotHeader:
    """The header of the snapshot file ``path``; with ``verify``, also hash its data region.

    Raises:
        CheckpointCorruptError: bad magic, a header or data hash mismatch, or a short file (names it).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < PREAMBLE:
                raise CheckpointCorruptError(
                    f"memory snapshot {path}: {size} bytes, shorter than its preamble", path=path
                )
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
                magic, offset, length, digest = _PREAMBLE.unpack(mm[: _PREAMBLE.size])
                blob = mm[offset : offset + length]
                if magic != MAGIC or len(blob) != length or xxhash.xxh3_64_intdigest(blob) != digest:
                    raise CheckpointCorruptError(f"memory snapshot {path}: bad preamble or header hash", path=path)
                header = SnapshotHeader(**json.loads(blob))
                if offset != PREAMBLE + header.data_bytes:
                    raise CheckpointCorruptError(
                        f"memory snapshot {path}: header at {offset}, expected after the data", path=path
                    )
                if verify:
                    view = memoryview(mm)[PREAMBLE:offset]
                    try:
                        actual = data_hash(view)
                    finally:
                        view.release()
                    if actual != header.data_hash:
                        raise CheckpointCorruptError(
                            f"memory snapshot {path}: data hash {actual} != recorded {header.data_hash}", path=path
                        )
                return header
    except CheckpointCorruptError:
        raise
    except (OSError, ValueError, TypeError, struct.error) as e:
        raise CheckpointCorruptError(f"memory snapshot {path}: unreadable ({e})", path=path) from e
