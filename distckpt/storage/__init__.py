"""The storage seam (docs/design.md, "Storage seam"): everything distckpt keeps in a checkpoint
root -- committed checkpoints and their manifests, saves in progress, ``latest``, the lock --
goes through one :class:`~distckpt.storage.base.CheckpointStore`.

A root is a URL: a plain path (or ``file://``) is :class:`~distckpt.storage.posix.PosixStore`
(rename-based commit, today's on-disk layout), ``s3://bucket/prefix`` is
:class:`~distckpt.storage.s3.S3Store` (manifest-last commit, no rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import CheckpointStore, is_s3_url

__all__ = ["CheckpointStore", "is_s3_url", "open_store", "open_config_store"]


def open_store(root: str | os.PathLike, *, endpoint_url: str | None = None,
               region: str | None = None) -> CheckpointStore:
    """The store of checkpoint root ``root``.

    Args:
        root: a directory path, or ``s3://bucket/prefix``.
        endpoint_url, region: S3 only; default ``$AWS_ENDPOINT_URL`` / ``$AWS_DEFAULT_REGION``.

    Raises:
        ConfigError: a malformed ``s3://`` URL (credentials are never named).
    """
    text = os.fspath(root)
    if is_s3_url(text):
        from .s3 import S3Store  # boto3 is only needed for s3:// roots

        return S3Store(text, endpoint_url=endpoint_url, region=region)
    from .posix import PosixStore

    return PosixStore(text[len("file://"):] if text.startswith("file://") else text)


def open_config_store(config: Any) -> tuple[CheckpointStore, Path | str]:
    """``(store, root)`` of a :class:`~distckpt.config.CheckpointConfig`: the root as a ``Path``
    on POSIX (as the manager always had it), the URL string on S3."""
    store = open_store(config.root, endpoint_url=config.s3_endpoint_url, region=config.s3_region)
    return store, (Path(store.root) if store.kind == "posix" else store.root)
