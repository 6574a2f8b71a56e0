"""DCP's ``FileSystemWriter``, made to fail loudly and in time.

Two gaps of torch's ``FileSystemWriter`` (checked in torch 2.13) are closed here:

* With ``thread_count > 1`` an exception raised in a writer thread other than the caller's is
  only printed by ``threading.excepthook``: ``write_data`` returns the other threads' results,
  rank 0 writes a ``.metadata`` without the failed file's items and ``dcp.save`` returns as if
  the save had worked (the load fails later with missing keys). Every failure is recorded
  here and raised from ``write_data``, so DCP reports it to every rank.
* A slow disk keeps one rank inside ``write_data`` while the others wait in DCP's gather;
  past the process group's timeout the gather fails and leaves the group unusable. With a
  write deadline the slow rank gives up by itself (checked before every chunk of at most
  64 MiB), reaches the gather in time, and every rank gets the same clean error.

Two costs are removed. Each tensor item is written as ``torch.save``'s bytes from a per-layout
template instead of a ``torch.save`` call per item, small records gathered into few writes
(:mod:`distckpt._engine.torch_format.record_writer`; DCP's own writer still runs for stream transforms and
safetensors). And DCP serialises each tensor with ``torch.save``, whose zip writer computes a
CRC-32 of every record (about 6 GiB/s on one core, in series with the file write). distckpt
already hashes every file with xxh3 while writing (``integrity.py``), so the zip CRC is switched
off while each file is written (``torch.serialization.set_crc32_options``, per thread); ``torch.load``
and plain ``dcp.load`` read such files (torch documents that only external unzip tools complain).
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from typing_extensions import override

from .._ondisk.integrity import HashingFileSystem
from .torch_format.internals import format_tested
from .torch_format.record_writer import TEMPLATES, parallel_pays, write_files, zip_crc32_off

__all__ = ["CheckedFileSystemWriter", "WriteDeadlineExceeded"]

_CHUNK = 64 << 20


class WriteDeadlineExceeded(TimeoutError):
    """This rank's write phase ran past ``write_timeout_s`` (storage slower than allowed)."""


class _Cancelled(Exception):
    """Another writer thread of this rank already failed; stop early, report that failure."""


class _DeadlineStream:
    """Write-through proxy that checks the deadline before each chunk of at most 64 MiB."""

    def __init__(self, raw: Any, fs: "GuardedFileSystem", path: str) -> None:
        self._raw, self._fs, self._path = raw, fs, path

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, max(len(view), 1), _CHUNK):
                self._fs.check(self._path)
                self._raw.write(view[start : start + _CHUNK])
        except BaseException as e:
            # Record it here: torch.save's zip writer masks it with "unexpected pos" on exit.
            self._fs.record(e)
            raise
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class GuardedFileSystem(HashingFileSystem):
    """``HashingFileSystem`` that records every write failure and enforces a deadline.

    Thread-safe; :meth:`begin` arms it for one ``write_data`` call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.begin(None)

    def begin(self, timeout_s: float | None) -> None:
        """Start a write phase that must end within ``timeout_s`` seconds (``None``: no limit)."""
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.errors: list[BaseException] = []

    def check(self, path: str) -> None:
        """Raise if another thread failed, or if the deadline passed.

        Raises:
            WriteDeadlineExceeded: the write phase is older than ``timeout_s``.
        """
        if self.errors:
            raise _Cancelled(path)
        elapsed = time.monotonic() - self.started
        if self.timeout_s is not None and elapsed > self.timeout_s:
            raise WriteDeadlineExceeded(
                f"{path}: still writing {elapsed:.1f} s after this rank's write started, past "
                f"write_timeout_s={self.timeout_s:g} (storage too slow); giving up on this save. "
                "Raise CheckpointConfig.coordination.write_timeout_s (and timeout_s) if the storage is "
                "known to be this slow"
            )

    def record(self, error: BaseException) -> None:
        """Keep ``error`` (the first recorded one is raised); cancellations are not errors."""
        if not isinstance(error, _Cancelled):
            with self._lock:
                self.errors.append(error)

    def raise_first_error(self) -> None:
        if self.errors:
            raise self.errors[0]

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        writing = "w" in mode
        try:
            if writing:
                self.check(os.fspath(path))
            with super().create_stream(path, mode) as stream:
                if writing:
                    with zip_crc32_off():  # DCP torch.saves this file's items in this thread
                        yield _DeadlineStream(stream, self, os.fspath(path))
                    self.check(os.fspath(path))  # a file of few large writes: its last one was late
                else:
                    yield stream
        except BaseException as e:
            if writing:
                self.record(e)
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.begin(None)


class CheckedFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` (fsync per file) that hashes while writing, raises any writer
    thread's failure, gives up past ``write_timeout_s`` and skips the zip CRC-32 (see the module
    docstring).

    After a successful ``write_data``, ``self.fs.written`` maps each written file name to
    ``(size_bytes, xxh3_128 hex)``.

    Args:
        path: the checkpoint (pending) directory.
        thread_count: writer threads (and files) of this rank.
        write_timeout_s: deadline of this rank's ``write_data`` (seconds from its start);
            ``None`` for none.

    Raises:
        WriteDeadlineExceeded: from ``write_data``, past the deadline.
        OSError: from ``write_data``, the first failure of any writer thread.
    """

    fs: GuardedFileSystem  # FileSystemWriter declares the plain FileSystem it creates

    def __init__(self, path: str | os.PathLike, *, thread_count: int, write_timeout_s: float | None = None) -> None:
        super().__init__(os.fspath(path), sync_files=True, thread_count=thread_count)
        self.fs = GuardedFileSystem()
        self.write_timeout_s = write_timeout_s

    @override
    def write_data(self, plan: Any, planner: Any) -> Any:
        self.fs.begin(self.write_timeout_s)
        threads = self.thread_count  # DCP splits the items into this many files
        if not parallel_pays(plan.items):
            self.thread_count = 1
        try:
            future = super().write_data(plan, planner)
        except BaseException:
            self.fs.raise_first_error()  # the root cause, not a cancellation or a masking error
            raise
        finally:
            self.thread_count = threads
        self.fs.raise_first_error()
        return future

    def _write_data(self, planner: Any, file_queue: queue.Queue) -> Any:
        """Write the files ``FileSystemWriter.write_data`` queued (names and item split are
        DCP's) with :func:`~distckpt._engine.torch_format.record_writer.write_files`. Overrides torch 2.13's
        private step under ``write_data``; were it renamed, DCP's own writer would run: slower,
        the same files. DCP's writer still runs for stream transforms and safetensors."""
        if (
            getattr(self.transforms, "extensions", ())
            or getattr(self.serialization_format, "name", "") != "TORCH_SAVE"
            or not format_tested()  # another torch's save format: DCP's own writer
        ):
            return super()._write_data(planner, file_queue)
        jobs = []
        while not file_queue.empty():
            jobs.append(file_queue.get_nowait())
        results = write_files(
            jobs, planner, create_stream=self.fs.create_stream, sync_files=self.sync_files, templates=TEMPLATES
        )
        future: Future = Future()
        future.set_result(results)
        return future
