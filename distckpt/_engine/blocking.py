"""Blocking DCP save/load that raise distckpt errors instead of DCP's ``BaseException``."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .._errors import CheckpointCorruptError, DistCkptError, ReaderInvariantError, StorageError
from .incremental_writer import IncrementalFileSystemWriter, ReuseIndex
from .safe_io import SafeFileSystemReader, SafeLoadPlanner
from .save_planner import CachingSavePlanner
from .torch_format.internals import format_tested
from .writer import CheckedFileSystemWriter

__all__ = [
    "dcp_save",
    "dcp_load",
    "describe_exception",
    "GC_PAUSE",
    "gc_paused",
    "hashing_writer",
    "raise_as_corrupt",
    "run_load",
]


def _single_rank(process_group: dist.ProcessGroup | None) -> bool:
    """No process group, or one of one rank: DCP then needs no collectives (``no_dist``)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1


@contextlib.contextmanager
def _no_single_process_warning(action: str) -> Iterator[None]:
    """Silence DCP's "torch.distributed is disabled, unavailable or uninitialized, assuming the
    intent is to ``action`` in a single process" warning around a ``no_dist`` call distckpt
    makes on purpose (one process, or each rank planning alone); nothing else is filtered."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=f".*assuming the intent is to {action} in a single process", category=UserWarning
        )
        yield


class _GcPause:
    """Process-wide pause of the automatic (cyclic) GC, counted so that overlapping holders (a
    background save's write, a blocking load in the training thread) resume it only when the
    last one releases; it stays off if it was off before the first holder (a training loop
    that manages GC itself, as torchtitan's GC handler does). A ``gc.disable()`` while a
    holder is active is not seen (GC is already off) and is undone at the last release."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                gc.enable()


GC_PAUSE = _GcPause()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's automatic (cyclic) garbage collection for a DCP call (:data:`GC_PAUSE`).

    DCP's planning allocates many small containers (plans, metadata, pickled objects), which
    triggers generation-2 collections; each scans every object of the process (a large
    fraction of a fast load's time, see docs/benchmarks.md, "Load"; 0.2-0.5 s per collection in a
    background save), and in a multi-rank save or load the stalled rank holds up every other
    rank at the next collective. Nothing a save or load allocates needs the cycle collector;
    reference counting frees it. Same idea as torchtitan's GC handler, which disables automatic
    GC during training and collects at chosen steps.
    """
    GC_PAUSE.acquire()
    try:
        yield
    finally:
        GC_PAUSE.release()


def describe_exception(exc: BaseException, *, dcp_ranks: bool = True) -> str:
    """One line ``Type: message``; DCP's ``CheckpointException`` is unwrapped to the original
    exception of each failed rank (``DCP rank r: OSError: ...``; without the rank when
    ``dcp_ranks`` is false: a ``no_dist`` call numbers every process 0). Never raises."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            inner = pair[0] if isinstance(pair, tuple) else pair
            text = describe_exception(inner, dcp_ranks=dcp_ranks)
            parts.append(f"DCP rank {rank}: {text}" if dcp_ranks else text)
        return "; ".join(parts)[:1000]
    lines = _safe_str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still gets a line
        return "(its message could not be formatted)"


# Not a property of the checkpoint: raised as they are, never counted as corruption (which
# would make the manager set a good checkpoint aside and fall back).
_NOT_CORRUPTION = (KeyboardInterrupt, SystemExit, MemoryError, StorageError, ReaderInvariantError)


def _inner_failures(exc: BaseException) -> list[BaseException]:
    """``exc`` and, for DCP's ``CheckpointException``, each rank's original exception."""
    inner = [pair[0] if isinstance(pair, tuple) else pair for pair in (getattr(exc, "failures", None) or {}).values()]
    return [exc] + [e for e in inner if isinstance(e, BaseException)]


def hashing_writer(
    directory: str | os.PathLike,
    *,
    thread_count: int,
    write_timeout_s: float | None = None,
    reuse: ReuseIndex | Callable[[], ReuseIndex] | None = None,
) -> CheckedFileSystemWriter:
    """``FileSystemWriter`` with per-file fsync whose ``fs.written`` records each written file's
    ``(size_bytes, xxh3_128)``, hashed from the bytes as they are written; any writer thread's
    failure, or a write phase longer than ``write_timeout_s`` seconds, fails ``write_data``
    (see :mod:`distckpt._engine.writer`). With ``reuse``, an incremental save
    (:mod:`distckpt._engine.incremental_writer`)."""
    if reuse is not None:
        return IncrementalFileSystemWriter(
            directory, thread_count=thread_count, write_timeout_s=write_timeout_s, reuse=reuse
        )
    return CheckedFileSystemWriter(directory, thread_count=thread_count, write_timeout_s=write_timeout_s)


def dcp_save(
    state_dict: dict[str, Any],
    directory: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None,
    thread_count: int = 1,
    write_timeout_s: float | None = None,
    reuse: ReuseIndex | Callable[[], ReuseIndex] | None = None,
    writer: Any = None,
) -> dict[str, tuple[int, str]]:
    """``dcp.save`` into ``directory`` with per-file fsync. All ranks call it.

    Args:
        thread_count: writer threads (and files) of this rank.
        write_timeout_s: this rank gives up writing after this many seconds
            (``WriteDeadlineExceeded``), so a slow disk fails the save on every rank instead of
            timing out the process group; ``None`` for no deadline.
        reuse: write incrementally against this index, or a callable returning it (``None``:
            a plain save).
        writer: a ready writer with the same ``fs.written`` contract (an object store's);
            ``None``: :func:`hashing_writer` into ``directory``.

    Returns:
        ``{file name: (size_bytes, xxh3_128 hex)}`` of the files this rank wrote.

    Raises:
        BaseException: whatever DCP raises on this rank; the caller gathers outcomes across
            ranks before deciding (see ``CheckpointManager.save``).
    """
    if writer is None:
        writer = hashing_writer(directory, thread_count=thread_count, write_timeout_s=write_timeout_s, reuse=reuse)
    with gc_paused(), _no_single_process_warning("save"):
        dcp.save(
            state_dict,
            storage_writer=writer,
            process_group=process_group,
            no_dist=_single_rank(process_group),
            planner=CachingSavePlanner(),
        )
    return dict(writer.fs.written)


def dcp_load(
    state_dict: dict[str, Any],
    directory: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None,
    expected_files: dict[str, tuple[int, str | None]] | None = None,
    fast: bool = False,
    thread_count: int = 2,
) -> None:
    """``dcp.load`` in place into ``state_dict``, reading metadata and non-tensor items safely.

    Args:
        expected_files: ``{relative path: (size_bytes, digest)}`` from the manifest; each rank
            then checks the files it reads before reading them.
        fast: read with :class:`~distckpt._engine.read.fast_reader.FastFileSystemReader` (large
            parallel sequential reads straight into the destination tensors, hashes verified
            from the bytes read) instead of DCP's item-by-item reader.
        thread_count: parallel read streams per rank of the fast reader.

    Raises:
        CheckpointCorruptError: unreadable/unsafe/mismatching files or a missing key, naming
            the file (or the directory), on every rank.
    """
    reader: SafeFileSystemReader
    if fast and format_tested():
        from .read.fast_reader import FastFileSystemReader

        reader = FastFileSystemReader(os.fspath(directory), expected_files=expected_files, thread_count=thread_count)
    else:
        reader = SafeFileSystemReader(os.fspath(directory), expected_files=expected_files)
    run_load(state_dict, reader, process_group=process_group, directory=directory)


def run_load(
    state_dict: dict[str, Any], reader: Any, *, process_group: dist.ProcessGroup | None, directory: str | os.PathLike
) -> None:
    """``dcp.load`` through ``reader`` the way distckpt runs it: with :class:`SafeLoadPlanner`,
    the cyclic GC paused (:func:`gc_paused`), each rank planning and reading on its own, and one
    agreement on the outcome at the end.

    Why no plan exchange: DCP's load gathers every rank's pickled plan on the coordinator and
    scatters it back, but ``DefaultLoadPlanner``'s global step returns the local plans unchanged
    (``create_default_global_load_plan``: "no global coordination"), so each rank runs DCP's
    ``no_dist`` load and the ranks then exchange only the outcome -- one ``all_gather_object``
    instead of DCP's gather + scatter + final gather, whose cost grows with the world size on
    the coordinator.

    Raises:
        CheckpointCorruptError: on every rank when any rank's read failed, naming the first
            failing rank and its file (or ``directory``).
        KeyboardInterrupt, SystemExit, MemoryError: on the rank that got it (not counted as
            corruption); the other ranks then raise ``DistCkptError`` naming it.
    """
    local: BaseException | None = None
    try:
        with gc_paused(), _no_single_process_warning("load"):
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        local = _load_error(e, directory)
    if not _single_rank(process_group):
        rank = dist.get_rank(process_group)
        if isinstance(local, CheckpointCorruptError):
            local = CheckpointCorruptError(f"rank {rank}: {local}", path=local.path)
        mine = None if local is None else (type(local).__name__, _safe_str(local)[:4000], getattr(local, "path", None))
        outcomes: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(outcomes, mine, group=process_group)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if failed and local is None:
            r, (kind, message, path) = failed[0]
            if kind == CheckpointCorruptError.__name__:
                raise CheckpointCorruptError(message, path=path)
            raise DistCkptError(
                f"loading {directory} failed on rank {r}, not because of the checkpoint "
                f"({kind}: {message[:500]}); this rank stopped too"
            )
    if local is not None:
        raise local


def _load_error(exc: BaseException, directory: str | os.PathLike) -> BaseException:
    """What a failed ``dcp.load`` raises on this rank: an interrupt or ``MemoryError`` as it is
    (unwrapped from DCP), anything else as :class:`CheckpointCorruptError`. Never raises."""
    try:
        raise_as_corrupt(exc, directory, "DCP load failed", dcp_ranks=False)
    except BaseException as e:  # noqa: BLE001 - returned, raised by the caller after the exchange
        return e
    return CheckpointCorruptError(f"{directory}: DCP load failed", path=os.fspath(directory))


def raise_as_corrupt(exc: BaseException, directory: str | os.PathLike, what: str, *, dcp_ranks: bool = True) -> None:
    """Re-raise a failed DCP read as :class:`CheckpointCorruptError`. ``KeyboardInterrupt``,
    ``SystemExit`` and ``MemoryError`` -- also when DCP wrapped them -- pass through as they
    are: they say nothing about the checkpoint. A ``CheckpointCorruptError`` raised on any rank
    inside DCP keeps its message and path; anything else is named with ``what`` and the
    directory (``dcp_ranks``: as :func:`describe_exception`).

    Raises:
        CheckpointCorruptError: always (or the original interrupt / ``MemoryError``).
    """
    for inner in _inner_failures(exc):
        if isinstance(inner, _NOT_CORRUPTION):
            raise inner
    for inner in _inner_failures(exc)[1:]:
        if isinstance(inner, CheckpointCorruptError):
            raise CheckpointCorruptError(_safe_str(inner), path=inner.path) from exc
    raise CheckpointCorruptError(
        f"{directory}: {what} ({describe_exception(exc, dcp_ranks=dcp_ranks)})", path=os.fspath(directory)
    ) from exc
