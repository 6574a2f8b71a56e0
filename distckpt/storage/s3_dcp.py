"""DCP ``StorageWriter`` / ``StorageReader`` for S3 data prefixes, on boto3.

The writer is distckpt's :class:`~distckpt.engine.writer.CheckedFileSystemWriter` (hash while
writing, every writer thread's failure raised, write deadline) over an object "file system":
each DCP file is spooled locally as it is written and uploaded when closed (multipart above
64 MiB). The reader downloads each file it needs once (parallel ranged GETs), checks its size
and xxh3-128 against the manifest from the downloaded bytes (no second read), then serves
DCP's item reads from memory. ``.metadata`` is unpickled with the allow-list.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from ..engine.safe_io import SafeFileSystemReader, parse_dcp_metadata
from ..engine.writer import CheckedFileSystemWriter, GuardedFileSystem
from ..errors import CheckpointCorruptError
from ..integrity import HASH_ALGORITHM, new_hasher
from .s3_client import S3Objects, split_url

__all__ = ["S3ObjectFileSystem", "S3Writer", "S3Reader"]

_SPOOL_BYTES = 64 << 20  # files up to this size never touch the local disk


class _KeepOpen:
    """The spool as DCP's writer sees it: its ``close()`` (DCP closes what it wrote) leaves the
    spool open for the upload that follows."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def close(self) -> None:
        self._raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class S3ObjectFileSystem(FileSystem):
    """DCP ``FileSystem`` whose paths are ``s3://bucket/key`` strings.

    Args:
        endpoint_url, region: as :func:`~distckpt.storage.s3_client.get_client`.
        expected: ``{file name: (size_bytes, digest)}`` to verify reads against (``None``: no check).
    """

    def configure(self, endpoint_url: str | None, region: str | None,
                  expected: dict[str, tuple[int, str | None]] | None = None) -> None:
        self.endpoint_url, self.region, self.expected = endpoint_url, region, expected

    def _objects(self, path: str | os.PathLike) -> tuple[S3Objects, str]:
        bucket, key = split_url(os.fspath(path))
        return S3Objects(bucket, endpoint_url=self.endpoint_url, region=self.region), key

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        objects, key = self._objects(path)
        if "w" in mode:
            with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
                yield _KeepOpen(spool)
                spool.seek(0)
                objects.upload(spool, key)  # only when the body wrote everything
            return
        buf = io.BytesIO()
        objects.download(key, buf)
        self._check(os.fspath(path), buf.getbuffer())
        buf.seek(0)
        yield buf

    def _check(self, url: str, data: memoryview) -> None:
        if self.expected is None:
            return
        name = url.rsplit("/", 1)[-1]
        if name not in self.expected:
            raise CheckpointCorruptError(f"{url}: DCP metadata refers to an object the manifest does not list",
                                         path=url)
        size, digest = self.expected[name]
        if len(data) != size:
            raise CheckpointCorruptError(f"{url}: size {len(data)} bytes, manifest expects {size} bytes "
                                         "(truncated?)", path=url)
        if digest is not None:
            hasher = new_hasher()
            hasher.update(data)
            if hasher.hexdigest() != digest:
                raise CheckpointCorruptError(
                    f"{url}: {HASH_ALGORITHM} {hasher.hexdigest()} does not match the manifest's {digest} "
                    "(bytes changed after the commit)", path=url)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP renames .metadata.tmp -> .metadata; the commit record is the manifest, not this.
        objects, src = self._objects(path)
        dst = self._objects(new_path)[1]
        objects.copy(src, dst)
        objects.delete([src])

    def mkdir(self, path: str | os.PathLike) -> None:
        pass  # prefixes need no creation

    def exists(self, path: str | os.PathLike) -> bool:
        objects, key = self._objects(path)
        return bool(objects.list_objects(key))

    def rm_file(self, path: str | os.PathLike) -> None:
        objects, key = self._objects(path)
        objects.delete([key])

    def ls(self, path: str | os.PathLike) -> list[str]:
        objects, key = self._objects(path)
        return [objects.url(k) for k in objects.list_objects(key.rstrip("/") + "/")]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.fspath(checkpoint_id).startswith("s3://")


class _S3GuardedFileSystem(GuardedFileSystem, S3ObjectFileSystem):
    """Hashing + failure recording + deadline (GuardedFileSystem) over S3 objects."""

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__(), endpoint_url=self.endpoint_url, region=self.region)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.configure(state.get("endpoint_url"), state.get("region"))


class S3Writer(CheckedFileSystemWriter):
    """:class:`~distckpt.engine.writer.CheckedFileSystemWriter` into the data prefix ``url``;
    ``fs.written`` maps each uploaded file to ``(size_bytes, xxh3_128)``.

    Args:
        url: ``s3://bucket/prefix`` of this save's data (unique per save, never overwritten).
        thread_count, write_timeout_s: as ``CheckedFileSystemWriter``.
        endpoint_url, region: S3 client settings.
    """

    def __init__(self, url: str, *, thread_count: int, write_timeout_s: float | None,
                 endpoint_url: str | None, region: str | None) -> None:
        super().__init__(url, thread_count=thread_count, write_timeout_s=write_timeout_s)
        fs = _S3GuardedFileSystem()
        fs.configure(endpoint_url, region)
        self.fs = fs
        self.path = url
        self.sync_files = False  # an uploaded object is durable; there is no fd to fsync


class S3Reader(SafeFileSystemReader):
    """DCP reader of the data prefix ``url`` that verifies every file it reads (size + hash)
    against ``expected_files`` from the downloaded bytes.

    Args:
        url: ``s3://bucket/prefix`` of a committed checkpoint's data.
        expected_files: ``{file name: (size_bytes, digest)}`` from the manifest, or ``None``.
        endpoint_url, region: S3 client settings.
    """

    def __init__(self, url: str, *, expected_files: dict[str, tuple[int, str | None]] | None,
                 endpoint_url: str | None, region: str | None) -> None:
        super().__init__(url, expected_files=expected_files)
        fs = S3ObjectFileSystem()
        fs.configure(endpoint_url, region, expected_files)
        self.fs = fs
        self.path = url

    def read_data(self, plan: Any, planner: Any) -> Any:
        return FileSystemReader.read_data(self, plan, planner)  # the fs verifies each download

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        url = f"{os.fspath(self.path).rstrip('/')}/.metadata"
        with self.fs.create_stream(url, "rb") as f:
            metadata = parse_dcp_metadata(f, url)
        storage_meta = metadata.storage_meta
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata
