"""The storage seam (docs/design.md, "Storage seam"): everything distckpt keeps in a checkpoint
root -- committed checkpoints and their manifests, saves in progress, ``latest``, the lock --
goes through one :class:`~distckpt._storage.base.CheckpointStore`.

A root is a URL: a plain path (or ``file://``) is :class:`~distckpt._storage.posix.PosixStore`
(rename-based commit, today's on-disk layout), ``s3://bucket/prefix`` is
:class:`~distckpt._storage.s3.S3Store` (manifest-last commit, no rename).
"""

from __future__ import annotations

import os
from typing import Any

from .._ondisk.layout import check_root_scheme
from .base import CheckpointStore, Others, is_s3_url, split_location
from .generic import check_file, digest_index, find_committed, read_dcp_metadata, step_of

__all__ = [
    "CheckpointStore",
    "Others",
    "digest_index",
    "check_file",
    "find_committed",
    "read_dcp_metadata",
    "step_of",
    "is_s3_url",
    "open_store",
    "open_config_store",
    "open_location",
    "split_location",
    "store_of",
]


def open_store(
    root: str | os.PathLike, *, endpoint_url: str | None = None, region: str | None = None
) -> CheckpointStore:
    """The store of checkpoint root ``root``.

    Args:
        root: a directory path, or ``s3://bucket/prefix``.
        endpoint_url, region: S3 only; default ``$AWS_ENDPOINT_URL`` / ``$AWS_DEFAULT_REGION``.

    Raises:
        ConfigError: a malformed ``s3://`` URL (credentials are never named), or a URL of
            another scheme (``gs://``, ``S3://``, ``s3a://``).
    """
    text = os.fspath(root)
    check_root_scheme(text)
    if is_s3_url(text):
        from .s3 import S3Store  # boto3 is only needed for s3:// roots

        return S3Store(text, endpoint_url=endpoint_url, region=region)
    from .posix import PosixStore

    return PosixStore(text[len("file://") :] if text.startswith("file://") else text)


def open_config_store(config: Any) -> CheckpointStore:
    """The store of a :class:`~distckpt._config.CheckpointConfig`'s root (its S3 endpoint and region)."""
    return open_store(config.root, endpoint_url=config.storage.s3_endpoint_url, region=config.storage.s3_region)


def open_location(
    path: str | os.PathLike, *, endpoint_url: str | None = None, region: str | None = None
) -> tuple[CheckpointStore, str | None]:
    """``(store, checkpoint location or None)`` of a path an operator gave a tool: one checkpoint
    (a directory holding a manifest or ``.metadata`` or named ``step-N``; an S3 data prefix
    ``<root>/data/step-N-<id>``), whose store is its root's, or else a root.

    Raises:
        ConfigError: as :func:`open_store`.
    """
    text = os.fspath(path)
    if is_s3_url(text):
        root, location = split_location(text)
        return open_store(text if location is None else root, endpoint_url=endpoint_url, region=region), location
    from .posix import PosixStore

    local = text[len("file://") :] if text.startswith("file://") else text
    if PosixStore.is_checkpoint_dir(local):
        return open_store(os.path.dirname(os.path.abspath(local))), os.path.abspath(local)
    return open_store(local), None


def store_of(location: str, like: CheckpointStore) -> CheckpointStore:
    """The store that holds checkpoint ``location``: ``like`` itself, or for an ``s3://``
    checkpoint of another root (a ``load_path`` elsewhere) that root's store, with ``like``'s
    endpoint and region. A POSIX store reads any directory path."""
    if not is_s3_url(location) or like.kind != "s3":
        return like
    root = split_location(location)[0]
    if root == like.root:
        return like
    return open_store(root, endpoint_url=getattr(like, "endpoint_url", None), region=getattr(like, "region", None))
