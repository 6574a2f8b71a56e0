"""The hash sidecar of a plain DCP checkpoint written through :mod:`distckpt.dcp`.

A directory written by ``dcp.save(..., storage_writer=distckpt.dcp.FileSystemWriter(path))``
holds DCP's own files, unchanged, plus one JSON file next to ``.metadata``:
``.metadata.xxh3.json`` (``__<rank>.metadata.xxh3.json`` for a save without rank coordination,
next to ``__<rank>.metadata``). It lists every data file of the save and the ``.metadata`` file
itself with its size, xxh3-128 digest and, for files over 1 MiB written to POSIX storage, the
block digests of :mod:`distckpt._ondisk.integrity`. Stock DCP readers never open it (they read
``.metadata`` and the files it names); distckpt's reader verifies every file it reads against it.

Schema (version 1)::

    {"format": "distckpt-dcp-hashes", "version": 1, "algorithm": "xxh3_128",
     "files": {"__0_0.distcp": {"size_bytes": 123, "digest": "<32 hex>",
                                "block_ends": [...], "block_hashes": [...]},   # optional pair
               ".metadata": {"size_bytes": 456, "digest": "<32 hex>"}}}

It is written after ``.metadata`` (temporary name, then a rename), so a crash in between leaves
a directory that reads as a stock, unverified one.
"""

from __future__ import annotations

import json
from typing import Any

from .._errors import CheckpointCorruptError
from .integrity import HASH_ALGORITHM, BlockDigests

__all__ = ["FORMAT", "SUFFIX", "FileHash", "decode", "encode", "sidecar_name"]

FORMAT = "distckpt-dcp-hashes"
SUFFIX = ".xxh3.json"
_VERSION = 1

# ``{file name: (size_bytes, digest, block digests or None)}``
FileHash = tuple[int, str, BlockDigests | None]


def sidecar_name(metadata_name: str) -> str:
    """The sidecar's file name next to DCP's metadata file ``metadata_name`` (``.metadata``)."""
    return metadata_name + SUFFIX


def encode(files: dict[str, FileHash]) -> bytes:
    """The sidecar's bytes (UTF-8 JSON, keys sorted) for ``files``."""
    out: dict[str, Any] = {}
    for name, (size, digest, blocks) in sorted(files.items()):
        entry: dict[str, Any] = {"size_bytes": int(size), "digest": digest}
        if blocks is not None and blocks.valid_for(size):
            entry["block_ends"], entry["block_hashes"] = list(blocks.ends), list(blocks.hashes)
        out[name] = entry
    doc = {"format": FORMAT, "version": _VERSION, "algorithm": HASH_ALGORITHM, "files": out}
    return json.dumps(doc, sort_keys=True).encode()


def decode(data: bytes, where: str) -> dict[str, FileHash]:
    """Parse a sidecar's bytes.

    Args:
        data: the file's bytes.
        where: the sidecar's path or URL, for messages.

    Returns:
        ``{file name: (size_bytes, xxh3-128 hex digest, BlockDigests or None)}``.

    Raises:
        CheckpointCorruptError: not JSON, another format, a newer version, another hash
            algorithm, or a malformed entry (naming ``where``; delete the sidecar to read the
            directory unverified, as a stock reader does).
    """

    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{where}: {why}; this file records the hashes of the DCP files next to it. Restore it, or "
            "delete it to read the directory unverified (as a stock DCP reader does)",
            path=where,
        )

    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} file")
    if doc.get("version") != _VERSION:
        raise bad(f"version {doc.get('version')!r}, this distckpt reads version {_VERSION} (upgrade distckpt)")
    if doc.get("algorithm") != HASH_ALGORITHM:
        raise bad(f"hash algorithm {doc.get('algorithm')!r}, expected {HASH_ALGORITHM!r}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise bad("no 'files' table")
    out: dict[str, FileHash] = {}
    for name, entry in files.items():
        try:
            size, digest = int(entry["size_bytes"]), str(entry["digest"])
            blocks = None
            if "block_ends" in entry:
                blocks = BlockDigests(tuple(int(e) for e in entry["block_ends"]), tuple(entry["block_hashes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"malformed entry for {name!r} ({type(e).__name__}: {e})") from e
        if size < 0 or len(digest) != 32 or (blocks is not None and not blocks.valid_for(size)):
            raise bad(f"malformed entry for {name!r}")
        out[name] = (size, digest, blocks)
    return out
