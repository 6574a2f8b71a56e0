"""The storage seam (docs/design.md, "Storage seam"): everything distckpt keeps in a checkpoint
root -- committed checkpoints and their manifests, saves in progress, ``latest``, the lock --
goes through one :class:`~distckpt.storage.base.CheckpointStore`.

A root is a URL: a plain path (or ``file://``) is :class:`~distckpt.storage.posix.PosixStore`
(rename-based commit, today's on-disk layout), ``s3://bucket/prefix`` is
:class:`~distckpt.storage.s3.S3Store` (manifest-last commit, no rename).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..ondisk.layout import check_root_scheme
from .base import CheckpointStore, is_s3_url

__all__ = ["CheckpointStore", "is_s3_url", "open_store", "open_config_store", "split_location", "store_of"]


def open_store(root: str | os.PathLike, *, endpoint_url: str | None = None,
               region: str | None = None) -> CheckpointStore:
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

    return PosixStore(text[len("file://"):] if text.startswith("file://") else text)


def open_config_store(config: Any) -> tuple[CheckpointStore, Path | str]:
    """``(store, root)`` of a :class:`~distckpt.config.CheckpointConfig`: the root as a ``Path``
    on POSIX (as the manager always had it), the URL string on S3."""
    store = open_store(config.root, endpoint_url=config.storage.s3_endpoint_url, region=config.storage.s3_region)
    return store, (Path(store.root) if store.kind == "posix" else store.root)


def split_location(url: str) -> tuple[str, str | None]:
    """``(root, checkpoint location or None)`` of an ``s3://`` URL: a save's data prefix
    ``<root>/data/step-N-<id>`` names one checkpoint; anything else is taken as a root."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if parent.endswith("/data") and re.match(r"^step-\d{9,}-[0-9a-f]+$", name):
        return parent[: -len("/data")], url.rstrip("/")
    return url.rstrip("/"), None


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
