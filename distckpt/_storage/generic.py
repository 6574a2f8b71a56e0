"""What every store gets from the runtime contract (:class:`~distckpt._storage.base.CheckpointStore`):
queries written once over its methods, so a backend implements none of them."""

from __future__ import annotations

import io
import os
import re
from typing import Any

from .._engine.safe_io import parse_dcp_metadata
from .._errors import CheckpointCorruptError
from .._ondisk.digests import DigestIndex
from .._ondisk.integrity import HASH_ALGORITHM, new_hasher
from .._ondisk.manifest import Manifest
from .base import CheckpointStore, is_s3_url

__all__ = ["check_file", "digest_index", "find_committed", "read_dcp_metadata", "step_of"]

_STEP_NAME = re.compile(r"^step-(\d{9,})(-[0-9a-f]+)?$")


def find_committed(store: CheckpointStore) -> list[tuple[int, str, Manifest | CheckpointCorruptError]]:
    """Every checkpoint with a manifest (:meth:`~CheckpointStore.committed_steps`), newest first,
    with its validated manifest or why it is invalid (one :meth:`~CheckpointStore.validate` each)."""
    out: list[tuple[int, str, Manifest | CheckpointCorruptError]] = []
    for step in reversed(store.committed_steps()):
        location = store.location_of(step)
        try:
            out.append((step, location, store.validate(location)))
        except CheckpointCorruptError as e:
            out.append((step, location, e))
    return out


def _same(a: str, b: str) -> bool:
    if is_s3_url(a) or is_s3_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def step_of(store: CheckpointStore, location: str) -> int | None:
    """The step of ``location`` when it is the location of ``store``'s checkpoint of that step
    (its last component ``step-N[-<id>]``); ``None``: another root's, or not a checkpoint's."""
    found = _STEP_NAME.match(os.fspath(location).rstrip("/").rsplit("/", 1)[-1])
    if found is None:
        return None
    step = int(found.group(1))
    return step if _same(store.location_of(step), os.fspath(location)) else None


def _where(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


def read_dcp_metadata(store: CheckpointStore, location: str) -> Any:
    """The checkpoint's DCP ``Metadata``, unpickled with the allow-list.

    Raises:
        CheckpointCorruptError: ``.metadata`` missing, unreadable, a disallowed type, or not DCP metadata.
    """
    where = _where(location, ".metadata")
    try:
        data = store.read_file(location, ".metadata")
    except FileNotFoundError as e:
        raise CheckpointCorruptError(f"{where}: DCP metadata file missing", path=where) from e
    except OSError as e:
        raise CheckpointCorruptError(f"{where}: unreadable DCP metadata ({type(e).__name__}: {e})", path=where) from e
    return parse_dcp_metadata(io.BytesIO(data), where)


def digest_index(store: CheckpointStore, location: str, manifest: Manifest) -> DigestIndex:
    """The block digests of a committed checkpoint's files, each digest file read (and checked)
    on its first lookup (:class:`~distckpt._ondisk.digests.DigestIndex`)."""
    return DigestIndex(manifest, lambda name: store.read_file(location, name), location=location)


def check_file(store: CheckpointStore, location: str, name: str, *, size_bytes: int, digest: str | None) -> None:
    """Check a small file of a checkpoint (``.metadata``; it is read whole) against its
    manifest entry: size in bytes, then the xxh3-128 ``digest`` when given.

    Raises:
        CheckpointCorruptError: missing, unreadable, another size or another hash.
    """
    where = _where(location, name)
    try:
        data = store.read_file(location, name)
    except OSError as e:
        raise CheckpointCorruptError(f"{where}: file listed in the manifest is missing ({e})", path=where) from e
    if len(data) != size_bytes:
        raise CheckpointCorruptError(
            f"{where}: size {len(data)} bytes, manifest expects {size_bytes} bytes (truncated?)", path=where
        )
    hasher = new_hasher()
    hasher.update(data)
    if digest is not None and hasher.hexdigest() != digest:
        raise CheckpointCorruptError(
            f"{where}: {HASH_ALGORITHM} {hasher.hexdigest()} does not match the manifest's {digest} "
            "(bytes changed after the commit)",
            path=where,
        )
