"""Per-rank digest files ``.digests-rank-NNNNN.json``: the block digests of the files one rank
wrote, kept out of the manifest so that it stays small as the job grows (docs/format.md).

Each rank writes its own into the pending directory after its write; the manifest lists it like a
data file, with its size and xxh3-128, so a changed byte in it is found like one in any other file.
A reader (load, ``distckpt verify``) reads them and looks the blocks up by file
(:func:`read_blocks`). The block digests of a file are cut where
:class:`~distckpt.ondisk.integrity.BlockHasher` cuts them.

Content (JSON)::

    {"format": 1, "rank": 3,
     "files": {"__3_0.distcp": {"block_ends": [...], "block_hashes": [...]}, ...}}

Names in ``files`` are relative to the directory holding the digest file; an incremental
checkpoint lists an earlier checkpoint's digest file as ``../step-N/.digests-rank-NNNNN.json``,
and its blocks then describe that checkpoint's files (``../step-N/<name>``).
"""

from __future__ import annotations

import json
import re
from typing import Callable

from ..errors import CheckpointCorruptError
from .integrity import BlockDigests, new_hasher
from .manifest import Manifest

__all__ = ["DIGESTS_FORMAT", "digests_name", "is_digests_name", "encode_digests", "read_blocks"]

DIGESTS_FORMAT = 1
_NAME_RE = re.compile(r"^\.digests-rank-\d{5,}\.json$")


def digests_name(rank: int) -> str:
    """File name of rank ``rank``'s digest file (``.digests-rank-00003.json``)."""
    return f".digests-rank-{rank:05d}.json"


def is_digests_name(path: str) -> bool:
    """Whether the last component of ``path`` names a digest file."""
    return bool(_NAME_RE.match(path.rsplit("/", 1)[-1]))


def encode_digests(rank: int, blocks: dict[str, BlockDigests]) -> tuple[bytes, str]:
    """``(file content, its xxh3-128 hex digest)`` of rank ``rank``'s digest file.

    Args:
        blocks: ``{file name relative to the checkpoint: its block digests}``.
    """
    files = {name: {"block_ends": list(b.ends), "block_hashes": list(b.hashes)} for name, b in sorted(blocks.items())}
    data = json.dumps({"format": DIGESTS_FORMAT, "rank": rank, "files": files}, sort_keys=True).encode()
    hasher = new_hasher()
    hasher.update(data)
    return data, hasher.hexdigest()


def read_blocks(manifest: Manifest, read: Callable[[str], bytes], *, location: str) -> dict[str, BlockDigests]:
    """The block digests of ``manifest``'s files: those its entries hold (schemas 4-6) and those
    of the digest files it lists (the manifest is not changed).

    Every digest file is checked against its manifest entry (size and xxh3-128) before it is used.

    Args:
        manifest: a parsed manifest.
        read: ``read(relative path)`` -> the file's bytes (``OSError`` when unreadable).
        location: the checkpoint, for messages.

    Returns:
        ``{relative path: BlockDigests}`` of every listed file whose blocks are known.

    Raises:
        CheckpointCorruptError: a digest file is missing, unreadable, changed after the commit
            (size or hash), malformed, or its blocks do not tile a file the manifest lists.
    """
    by_path = {f.path: f for f in manifest.files}
    found = {f.path: b for f in manifest.files if (b := f.blocks()) is not None}
    for entry in manifest.files:
        if not is_digests_name(entry.path):
            continue
        where = f"{location}/{entry.path}"
        try:
            data = read(entry.path)
        except OSError as e:
            raise CheckpointCorruptError(
                f"{where}: digest file listed in the manifest is unreadable ({e})", path=where
            ) from e
        hasher = new_hasher()
        hasher.update(data)
        if len(data) != entry.size_bytes or (entry.hash is not None and hasher.hexdigest() != entry.hash):
            raise CheckpointCorruptError(
                f"{where}: {len(data)} bytes with xxh3_128 {hasher.hexdigest()}, the manifest expects "
                f"{entry.size_bytes} bytes with {entry.hash} (changed after the commit)",
                path=where,
            )
        prefix = entry.path.rpartition("/")[0]
        try:
            files = json.loads(data)["files"]
            for name, b in files.items():
                target = by_path.get(f"{prefix}/{name}" if prefix else name)
                if target is None:  # an earlier checkpoint's file this one does not refer to
                    continue
                blocks = BlockDigests(tuple(b["block_ends"]), tuple(b["block_hashes"]))
                if not blocks.valid_for(target.size_bytes):
                    raise ValueError(f"the blocks of {name} do not tile its {target.size_bytes} bytes")
                found[target.path] = blocks
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where}: malformed digest file ({e})", path=where) from e
    return found
