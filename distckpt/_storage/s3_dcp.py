"""DCP ``StorageWriter`` / ``StorageReader`` for S3 data prefixes, on boto3.

The writer is distckpt's :class:`~distckpt._engine.writer.CheckedFileSystemWriter` (hash while
writing, every writer thread's failure raised, write deadline) over an object "file system":
each DCP file is uploaded while it is written (32 MiB multipart parts on background threads;
a small file is one PUT), never staged on the local disk. The reader downloads each file it
needs once (parallel ranged GETs), checks its size and xxh3-128 against the manifest from the
downloaded bytes (no second read), then serves DCP's item reads from memory. ``.metadata``
is unpickled with the allow-list.
"""

from __future__ import annotations

import contextlib
import io
import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta
from typing_extensions import override

from .._engine.safe_io import SafeFileSystemReader, parse_dcp_metadata
from .._engine.writer import CheckedFileSystemWriter, GuardedFileSystem
from .._errors import CheckpointCorruptError
from .._ondisk.integrity import HASH_ALGORITHM, new_hasher
from .s3_client import S3Objects, split_url

__all__ = ["S3ObjectFileSystem", "S3Writer", "S3Reader", "guarded_s3_file_system"]

PART_BYTES = 32 << 20  # multipart part size of the streaming upload
_IN_FLIGHT = 4  # parts buffered or uploading per file (memory: 4 x 32 MiB per writer thread)


class _StreamingUpload:
    """A write-only stream that uploads one object while DCP writes it: every ``PART_BYTES`` go
    up as a multipart part on a background thread (at most ``_IN_FLIGHT`` parts buffered), so
    the upload overlaps serialization and nothing touches the local disk; a file smaller than
    one part is a single PUT. ``tell()`` counts bytes written (DCP records item offsets with it);
    ``close()`` is a no-op (DCP closes what it wrote; :meth:`finish` ends the upload)."""

    def __init__(self, objects: S3Objects, key: str) -> None:
        self.objects, self.key = objects, key
        self._part = bytearray(PART_BYTES)  # filled in place: one copy of every byte written
        self._buffered = 0
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        start = 0
        while start < len(view):  # parts of exactly PART_BYTES (the last one of the file: less)
            take = min(len(view) - start, PART_BYTES - self._buffered)
            self._part[self._buffered : self._buffered + take] = view[start : start + take]
            self._buffered += take
            start += take
            if self._buffered == PART_BYTES:
                self._send_part()
        self._pos += len(view)
        return len(view)

    def _send_part(self) -> None:
        body = self._part if self._buffered == PART_BYTES else self._part[: self._buffered]
        self._part, self._buffered = bytearray(PART_BYTES), 0
        if self._upload_id is None:
            self._upload_id = self.objects.create_multipart(self.key)
            self._pool = ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="distckpt-s3-part")
        assert self._pool is not None
        while sum(not f.done() for f in self._parts) >= _IN_FLIGHT:  # bound the memory held
            wait(self._parts, return_when=FIRST_COMPLETED)
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        self._parts.append(
            self._pool.submit(self.objects.upload_part, self.key, self._upload_id, len(self._parts) + 1, body)
        )

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def seekable(self) -> bool:
        return False

    def finish(self) -> None:
        """Upload what is buffered and complete the object. Raises ``StorageError``."""
        try:
            if self._upload_id is None:
                self.objects.put(self.key, bytes(self._part[: self._buffered]))
                return
            if self._buffered or not self._parts:
                self._send_part()
            parts = [f.result() for f in self._parts]
            self.objects.complete_multipart(self.key, self._upload_id, parts)
        except BaseException:
            self.abort()
            raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Drop the upload (a failed write: the save is aborted, nothing is committed)."""
        if self._upload_id is not None:
            for f in self._parts:
                f.cancel()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self.objects.abort_multipart(self.key, self._upload_id)
            self._upload_id = None


class S3ObjectFileSystem(FileSystem):
    """DCP ``FileSystem`` whose paths are ``s3://bucket/key`` strings.

    Args:
        endpoint_url, region: as :func:`~distckpt._storage.s3_client.get_client`.
        expected: ``{file name: (size_bytes, digest)}`` to verify reads against (``None``: no check).
        source: the record ``expected`` comes from, in error messages (``"manifest"``, ``"hash sidecar"``).

    Attributes:
        fsync_applies: ``False``: an uploaded object is durable and has no descriptor to fsync.
    """

    fsync_applies = False

    source = "manifest"

    def configure(
        self,
        endpoint_url: str | None,
        region: str | None,
        expected: dict[str, tuple[int, str | None]] | None = None,
        source: str = "manifest",
    ) -> None:
        """Set what the class's Args name: DCP builds file systems without arguments, and an unpickled
        one gets its client settings back here."""
        self.endpoint_url, self.region, self.expected, self.source = endpoint_url, region, expected, source

    def _objects(self, path: str | os.PathLike) -> tuple[S3Objects, str]:
        bucket, key = split_url(os.fspath(path))
        return S3Objects(bucket, endpoint_url=self.endpoint_url, region=self.region), key

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        objects, key = self._objects(path)
        if "w" in mode:
            upload = _StreamingUpload(objects, key)
            try:
                yield upload
            except BaseException:
                upload.abort()
                raise
            upload.finish()  # only when the body wrote everything
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
            raise CheckpointCorruptError(
                f"{url}: DCP metadata refers to an object the {self.source} does not list", path=url
            )
        size, digest = self.expected[name]
        if len(data) != size:
            raise CheckpointCorruptError(
                f"{url}: size {len(data)} bytes, {self.source} expects {size} bytes (truncated?)", path=url
            )
        if digest is not None:
            hasher = new_hasher()
            hasher.update(data)
            if hasher.hexdigest() != digest:
                raise CheckpointCorruptError(
                    f"{url}: {HASH_ALGORITHM} {hasher.hexdigest()} does not match the {self.source}'s {digest} "
                    "(bytes changed after the commit)",
                    path=url,
                )

    @override
    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    @override
    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str:
        return os.fspath(path)

    @override
    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP renames .metadata.tmp -> .metadata; the commit record is the manifest, not this.
        objects, src = self._objects(path)
        dst = self._objects(new_path)[1]
        objects.copy(src, dst)
        objects.delete([src])

    @override
    def mkdir(self, path: str | os.PathLike) -> None:
        pass  # prefixes need no creation

    @override
    def exists(self, path: str | os.PathLike) -> bool:
        objects, key = self._objects(path)
        return bool(objects.list_objects(key))

    @override
    def rm_file(self, path: str | os.PathLike) -> None:
        objects, key = self._objects(path)
        objects.delete([key])

    @override
    def ls(self, path: str | os.PathLike) -> list[str]:
        objects, key = self._objects(path)
        return [objects.url(k) for k in objects.list_objects(key.rstrip("/") + "/")]

    @override
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


def guarded_s3_file_system(endpoint_url: str | None, region: str | None) -> GuardedFileSystem:
    """A DCP file system over S3 objects that hashes what it uploads (``written``), records every
    writer thread's failure and enforces a write deadline (:class:`~distckpt._engine.writer.GuardedFileSystem`)."""
    fs = _S3GuardedFileSystem()
    fs.configure(endpoint_url, region)
    return fs


class S3Writer(CheckedFileSystemWriter):
    """:class:`~distckpt._engine.writer.CheckedFileSystemWriter` into the data prefix ``url``;
    ``fs.written`` maps each uploaded file to ``(size_bytes, xxh3_128)``.

    Args:
        url: ``s3://bucket/prefix`` of this save's data (unique per save, never overwritten).
        thread_count, write_timeout_s: as ``CheckedFileSystemWriter``.
        endpoint_url, region: S3 client settings.
    """

    def __init__(
        self,
        url: str,
        *,
        thread_count: int,
        write_timeout_s: float | None,
        endpoint_url: str | None,
        region: str | None,
    ) -> None:
        super().__init__(url, thread_count=thread_count, write_timeout_s=write_timeout_s)
        self.fs = guarded_s3_file_system(endpoint_url, region)
        self.path = url
        self.sync_files = False  # an uploaded object is durable; there is no fd to fsync


class S3Reader(SafeFileSystemReader):
    """DCP reader of the data prefix ``url`` that verifies every file it reads (size + hash)
    against ``expected_files`` from the downloaded bytes.

    Args:
        url: ``s3://bucket/prefix`` of a committed checkpoint's data.
        expected_files: ``{file name: (size_bytes, digest)}`` from the manifest, or ``None``.
        endpoint_url, region: S3 client settings.
        expected_source: the record ``expected_files`` comes from, in error messages.
    """

    def __init__(
        self,
        url: str,
        *,
        expected_files: dict[str, tuple[int, str | None]] | None,
        endpoint_url: str | None,
        region: str | None,
        expected_source: str = "manifest",
    ) -> None:
        super().__init__(url, expected_files=expected_files)
        self.expected_source = expected_source
        fs = S3ObjectFileSystem()
        fs.configure(endpoint_url, region, expected_files, expected_source)
        self.fs = fs
        self.path = url

    @override
    def read_data(self, plan: Any, planner: Any) -> Any:
        return FileSystemReader.read_data(self, plan, planner)  # the fs verifies each download

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.known_metadata is not None:
            return super().read_metadata(*args, **kwargs)
        url = f"{os.fspath(self.path).rstrip('/')}/.metadata"
        with self.fs.create_stream(url, "rb") as f:
            metadata = parse_dcp_metadata(f, url)
        storage_meta = metadata.storage_meta
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata
