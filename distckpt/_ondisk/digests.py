"""Per-rank digest files ``.digests-rank-NNNNN.json``: the block digests of the files one rank
wrote, kept out of the manifest so that it stays small as the job grows (docs/format.md).

Each rank writes its own into the pending directory after its write; the manifest lists it like a
data file, with its size and xxh3-128, so a changed byte in it is found like one in any other file.
A reader (load, ``distckpt verify``) reads them and looks the blocks up by file
(:func:`read_blocks`). The block digests of a file are cut where
:class:`~distckpt._ondisk.integrity.BlockHasher` cuts them.

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
from collections.abc import Iterator, Mapping
from typing import Callable

from .._errors import CheckpointCorruptError
from .integrity import BlockDigests, new_hasher
from .manifest import DIGESTS_FORMAT, Manifest, encode_digests, holds_blocks

__all__ = [
    "DIGESTS_FORMAT",
    "digests_name",
    "is_digests_name",
    "holds_blocks",
    "encode_digests",
    "read_blocks",
    "DigestIndex",
]

_NAME_RE = re.compile(r"^\.digests-rank-\d{5,}\.json$")
_DATA_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __{rank}_{index}.distcp


def digests_name(rank: int) -> str:
    """File name of rank ``rank``'s digest file (``.digests-rank-00003.json``)."""
    return f".digests-rank-{rank:05d}.json"


def is_digests_name(path: str) -> bool:
    """Whether the last component of ``path`` names a digest file."""
    return bool(_NAME_RE.match(path.rsplit("/", 1)[-1]))


def read_blocks(manifest: Manifest, read: Callable[[str], bytes], *, location: str) -> dict[str, BlockDigests]:
    """The block digests of all of ``manifest``'s files: those its entries hold (schemas 4-6) and
    those of every digest file it lists (the manifest is not changed). ``distckpt verify`` and the
    commit check use it; a load looks up only the files it reads (:class:`DigestIndex`).

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
    index = DigestIndex(manifest, read, location=location)
    index.read_all()
    return index.found


class DigestIndex(Mapping[str, BlockDigests]):
    """The block digests of a checkpoint's files, each digest file read and checked (as
    :func:`read_blocks` checks it) the first time one of the files it covers is looked up: a rank
    that reads a few files reads a few digest files, not every rank's.

    A data file ``[dir/]__R_K.distcp`` (DCP's name for rank ``R``'s ``K``-th file) is looked up in
    ``[dir/]`` + :func:`digests_name` ``(R)``, the file its writer wrote; any other name, or one that
    file does not cover, in all of them. Not thread-safe: the fast reader looks files up while it
    plans, on one thread.

    Args:
        manifest, read, location: as :func:`read_blocks`.
    """

    def __init__(self, manifest: Manifest, read: Callable[[str], bytes], *, location: str) -> None:
        self.manifest, self.read, self.location = manifest, read, location
        self.by_path = {f.path: f for f in manifest.files}
        self.found = {f.path: b for f in manifest.files if (b := f.blocks()) is not None}
        self.unread = {f.path for f in manifest.files if is_digests_name(f.path)}

    def __getitem__(self, path: str) -> BlockDigests:
        """The block digests of ``path`` (relative to the checkpoint); ``KeyError`` when no digest
        file covers it (``.get`` gives ``None``).

        Raises:
            CheckpointCorruptError: a digest file read for it is missing, changed or malformed.
        """
        if path in self.found or not self.unread:
            return self.found[path]
        prefix, _, name = path.rpartition("/")
        m = _DATA_RE.match(name)
        if m is not None:
            own = f"{prefix}/{digests_name(int(m.group(1)))}" if prefix else digests_name(int(m.group(1)))
            if own in self.unread:
                self._read(own)
                if path in self.found:
                    return self.found[path]
        self.read_all()
        return self.found[path]

    def __iter__(self) -> Iterator[str]:
        self.read_all()
        return iter(self.found)

    def __len__(self) -> int:
        self.read_all()
        return len(self.found)

    def read_all(self) -> None:
        """Read every digest file not read yet."""
        for digest_path in sorted(self.unread):
            self._read(digest_path)

    def _read(self, digest_path: str) -> None:
        self.unread.discard(digest_path)
        entry = self.by_path[digest_path]
        where = f"{self.location}/{digest_path}"
        try:
            data = self.read(digest_path)
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
        prefix = digest_path.rpartition("/")[0]
        try:
            files = json.loads(data)["files"]
            for name, b in files.items():
                target = self.by_path.get(f"{prefix}/{name}" if prefix else name)
                if target is None:  # an earlier checkpoint's file this one does not refer to
                    continue
                blocks = BlockDigests(tuple(b["block_ends"]), tuple(b["block_hashes"]))
                if not blocks.valid_for(target.size_bytes):
                    raise ValueError(f"the blocks of {name} do not tile its {target.size_bytes} bytes")
                self.found[target.path] = blocks
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where}: malformed digest file ({e})", path=where) from e
