"""The storage behind :mod:`distckpt.dcp`'s drop-in writer and reader: one DCP checkpoint
directory (a path, ``file://`` path or ``s3://bucket/prefix`` URL) without a checkpoint root.

This is the only place that picks POSIX or S3 for them: a path gets distckpt's POSIX file
system and readers (:mod:`distckpt._engine`), an ``s3://`` URL the object-store ones
(:mod:`distckpt._storage.s3_dcp`; boto3 is imported only then).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._engine.safe_io import SafeFileSystemReader
from .._engine.torch_format.internals import format_tested
from .._engine.writer import GuardedFileSystem
from .._ondisk.integrity import BlockDigests
from .base import is_s3_url

__all__ = ["dcp_file_system", "dcp_reader", "local_path", "read_bytes", "valid_location"]


def local_path(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` without a ``file://`` prefix; any other path or URL as it is."""
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else path


def valid_location(path: str | os.PathLike) -> bool:
    """Whether the drop-in classes take ``path``: an ``s3://`` URL, or what DCP's
    ``FileSystem.validate_checkpoint_id`` accepts (a path with a writable existing parent)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    text = os.fspath(path)
    return is_s3_url(text) or FileSystem.validate_checkpoint_id(local_path(path))


def dcp_file_system(path: str | os.PathLike, *, endpoint_url: str | None, region: str | None) -> GuardedFileSystem:
    """A DCP ``FileSystem`` for writing under ``path`` that hashes every file it writes
    (``written``: ``{file name: WrittenFile}``), records every writer thread's failure and
    enforces a write deadline; over S3 objects for an ``s3://`` URL (``endpoint_url``,
    ``region``: the client's, default ``$AWS_ENDPOINT_URL`` / ``$AWS_DEFAULT_REGION``)."""
    if is_s3_url(os.fspath(path)):
        from .s3_dcp import guarded_s3_file_system

        return guarded_s3_file_system(endpoint_url, region)
    return GuardedFileSystem()


def dcp_reader(
    path: str | os.PathLike,
    *,
    expected_files: dict[str, tuple[int, str | None]] | None,
    block_digests: Mapping[str, BlockDigests] | None,
    fast: bool,
    thread_count: int,
    endpoint_url: str | None,
    region: str | None,
    expected_source: str = "manifest",
) -> SafeFileSystemReader:
    """A DCP ``StorageReader`` of the checkpoint at ``path`` that unpickles ``.metadata`` with
    the allow-list and checks each file it reads against ``expected_files`` (size, xxh3-128).

    POSIX: the fast reader (``fast``; ``thread_count`` streams, verified ranged reads with
    ``block_digests``) or DCP's item-by-item reader after a whole-file check. S3: each object
    downloaded once and verified from the downloaded bytes (``fast`` does not apply).
    ``expected_source`` names the record ``expected_files`` comes from in error messages.
    """
    reader: SafeFileSystemReader
    if is_s3_url(os.fspath(path)):
        from .s3_dcp import S3Reader

        return S3Reader(
            os.fspath(path),
            expected_files=expected_files,
            endpoint_url=endpoint_url,
            region=region,
            expected_source=expected_source,
        )
    if fast and format_tested():
        from .._engine.read.fast_reader import FastFileSystemReader

        reader = FastFileSystemReader(
            local_path(path), expected_files=expected_files, thread_count=thread_count, block_digests=block_digests
        )
    else:
        reader = SafeFileSystemReader(local_path(path), expected_files=expected_files)
    reader.expected_source = expected_source
    return reader


def read_bytes(reader: Any, name: str) -> bytes | None:
    """The bytes of file ``name`` of ``reader``'s checkpoint (through its ``fs``), or ``None``
    when it does not exist."""
    where = reader.fs.concat_path(reader.path, name)
    if not reader.fs.exists(where):
        return None
    with reader.fs.create_stream(where, "rb") as f:
        return f.read()
