"""Asynchronous write: stage the state_dict, then run DCP's save in the background.

Layering (as in ``torch.distributed.checkpoint.async_save``): a persistent stager
(:class:`~distckpt._engine.staging.ReusingStager` over DCP's ``DefaultStager``) copies tensors
off the training tensors into buffers it keeps and reuses across saves (pinned on CUDA, shared
memory for the process executor); the same DCP save then runs in a thread or a separate
process (in a thread, with the cyclic GC paused until it ends:
:data:`~distckpt._engine.blocking.GC_PAUSE`). Two completions: *staged* (training may mutate the
parameters again) and *written* (files are on disk; the commit may follow).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from .._errors import ConfigError
from .._ondisk.integrity import hash_file
from .blocking import GC_PAUSE, hashing_writer
from .incremental_writer import ReuseIndex
from .save_planner import CachingSavePlanner
from .staging import ReusingStager

__all__ = ["AsyncWriter", "AsyncMode", "cuda_device_of"]

AsyncMode = Literal["thread", "process"]


class AsyncWriter:
    """Starts background DCP saves with a stager reused across saves.

    Args:
        mode: ``"thread"`` or ``"process"`` (DCP ``AsyncCheckpointerType``).
        background_staging: copy in a background thread too; the caller must wait on
            :meth:`wait_staged` before mutating parameters (before ``optimizer.step()``).
        process_group: a gloo group used only by background work (never by the training loop).
        thread_count: ``FileSystemWriter`` writer threads per rank.
        write_timeout_s: deadline of each background write on this rank (seconds), see
            :class:`~distckpt._engine.writer.CheckedFileSystemWriter`.

    Raises:
        ConfigError: ``mode="process"`` without an initialised ``torch.distributed``.
    """

    def __init__(
        self,
        mode: AsyncMode,
        *,
        background_staging: bool,
        process_group: dist.ProcessGroup | None,
        thread_count: int,
        write_timeout_s: float | None = None,
    ) -> None:
        if mode == "process" and not dist.is_initialized():
            # DCP's process executor builds its daemon's group from the default one.
            raise ConfigError(
                "async_save.mode='process' needs torch.distributed initialised (init_process_group, "
                "also for a single process); without it use async_save.mode='thread'"
            )
        self.cuda = torch.cuda.is_available()
        # On CPU every CUDA-only option must be off: DefaultStager raises otherwise.
        self.options = StagingOptions(
            use_pinned_memory=self.cuda,
            use_shared_memory=mode == "process",
            use_async_staging=background_staging,
            use_non_blocking_copy=self.cuda,
        )
        self.background_staging = background_staging
        # Built at the first save, on the device of the state's tensors (see start()).
        self.stager: ReusingStager | None = None
        self._stager_device: torch.device | None = None
        self.checkpointer_type = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        self.process_group = process_group
        self.thread_count = thread_count
        self.write_timeout_s = write_timeout_s
        self._staged: Future | None = None

    def start(
        self,
        state_dict: dict[str, Any],
        directory: str | os.PathLike,
        reuse: ReuseIndex | Callable[[], ReuseIndex] | None = None,
        writer: Any = None,
    ) -> Future:
        """Stage ``state_dict`` and start writing it into ``directory`` (incrementally
        against ``reuse`` when given: the staged copy is hashed in the background write; through
        ``writer``, an object store's, when given: thread mode only, never incremental).

        Returns:
            The upload future: done when this rank's files are written (or failed).
        """
        if writer is None:
            writer = hashing_writer(
                directory, thread_count=self.thread_count, write_timeout_s=self.write_timeout_s, reuse=reuse
            )
        self._writer = writer
        device = cuda_device_of(state_dict) if self.cuda else None
        # DefaultStager syncs only the current device after its non-blocking copies and makes
        # its background stream on the current device: both must be the state's device.
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            if self.stager is None or device != self._stager_device:
                if self.stager is not None:
                    self.stager.close()
                self.stager, self._stager_device = ReusingStager(self.options), device
            if device is not None and self.background_staging:
                # The background copy runs on its own stream, which does not wait for the
                # kernels already queued (the optimizer step): wait for them here.
                torch.cuda.synchronize(device)
            # Thread mode: no cyclic GC until this rank's write is done. A generation-2
            # collection triggered by DCP's planning in this process stalls this rank, and the
            # others wait for it at the next collective (see blocking.gc_paused); training
            # allocations wait with it. The process executor plans in its own process.
            pause = self.checkpointer_type == AsyncCheckpointerType.THREAD
            if pause:
                GC_PAUSE.acquire()
            try:
                response = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    process_group=self.process_group,
                    async_checkpointer_type=self.checkpointer_type,
                    async_stager=self.stager,
                    planner=CachingSavePlanner(),
                )
            except BaseException:
                if pause:
                    GC_PAUSE.release()
                raise
        if isinstance(response, AsyncSaveResponse):
            self._staged, upload = response.staging_completion, response.upload_completion
        else:
            self._staged, upload = None, response
        if pause:
            upload.add_done_callback(lambda _: GC_PAUSE.release())
        return upload

    def written_files(self, directory: str | os.PathLike, rank: int) -> dict[str, tuple[int, str]]:
        """``{file name: (size_bytes, xxh3_128)}`` of this rank's files of the last save.

        The thread executor hashes while writing; the process executor writes in another
        process, so this rank hashes its own files (``__<rank>_*``, ``.metadata`` on rank 0)
        after the write, from the page cache.
        """
        if self.checkpointer_type == AsyncCheckpointerType.THREAD:
            return dict(self._writer.fs.written)
        directory = Path(directory)
        names = [p.name for p in directory.glob(f"__{rank}_*")]
        if rank == 0 and (directory / ".metadata").exists():
            names.append(".metadata")
        return {name: hash_file(directory / name) for name in names}

    def wait_staged(self) -> None:
        """Block until the last save's tensors are copied (a no-op without background staging)."""
        if self._staged is not None:
            try:
                self._staged.result()
            except Exception:  # noqa: BLE001 - the upload future reports the same failure
                pass
            self._staged = None

    def close(self) -> None:
        """Release staging buffers and executors."""
        self.wait_staged()
        if self.stager is not None:
            self.stager.close()


def cuda_device_of(state_dict: Any) -> torch.device | None:
    """Device of a CUDA tensor (DTensors included) in a nested state_dict, or None if it has none."""
    todo = [state_dict]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cuda":
                return obj.device
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
    return None
