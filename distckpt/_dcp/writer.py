"""``distckpt.dcp.FileSystemWriter``: torch's ``FileSystemWriter``, every argument and behaviour
kept, plus what distckpt adds (docs/integrations.md, "Plain DCP").

What is kept (torch 2.13's ``torch.distributed.checkpoint.FileSystemWriter``): the signature and
defaults, the file names (``__<rank>_<n>.distcp``, ``.metadata`` or ``__<rank>.metadata``), the
``.metadata`` contents, ``single_file_per_rank``, ``sync_files`` (one fsync per file),
``thread_count``, ``per_thread_copy_ahead``, ``cache_staged_state_dict`` (the same
``BlockingAsyncStager``), ``overwrite`` (the same warning or ``RuntimeError``), ``_extensions``
(stream transforms such as ``ZStandard``, recorded in ``.metadata`` as stock does) and
``serialization_format``. The methods DCP calls are torch's own, inherited.

What is added:

* every file is hashed (xxh3-128, and block digests) from the bytes as they are written, and
  rank 0 records the hashes of every rank's files and of ``.metadata`` in a sidecar that stock
  readers ignore (:mod:`distckpt._ondisk.dcp_hashes`), so :class:`distckpt.dcp.FileSystemReader`
  verifies the directory without a distckpt manifest;
* a failure in any writer thread fails the save on every rank, and ``write_timeout_s`` bounds a
  rank's write phase (:mod:`distckpt._engine.writer`);
* ``s3://bucket/prefix`` paths: each file streamed to the object store while it is written.

The ``torch.save`` zip CRC-32 is not computed (the xxh3 digest covers the bytes); ``torch.load``
and stock readers read such files.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from torch.distributed.checkpoint import FileSystemWriter as TorchFileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from typing_extensions import override

from .._engine.writer import CheckedFileSystemWriter
from .._ondisk import dcp_hashes
from .._storage.plain_dcp import dcp_file_system, local_path, valid_location

__all__ = ["FileSystemWriter", "HASHES_FQN"]

# The index of the one extra WriteResult each rank returns from write_data: it carries that
# rank's file hashes to the coordinator's finish(), which removes it before DCP's own finish.
HASHES_FQN = "__distckpt_file_hashes__"


class FileSystemWriter(CheckedFileSystemWriter):
    """Drop-in for ``torch.distributed.checkpoint.FileSystemWriter`` that also records the
    hashes of what it writes (module docstring). Use it where DCP takes a ``storage_writer``
    (``dcp.save``, ``dcp.async_save``); every rank makes the calls DCP makes.

    Args:
        path: the checkpoint directory, ``file://`` path, or ``s3://bucket/prefix`` URL.
        single_file_per_rank: one file per writer thread of each rank (``True``) or one file per
            tensor or blob (``False``).
        sync_files: fsync each file (and ``.metadata``) before the save returns. No effect
            on S3 (an uploaded object is durable).
        thread_count: writer threads of each rank.
        per_thread_copy_ahead: bytes each writer thread copies from the GPU ahead of writing
            (torch's overlapping loader: one thread, a GPU present); 0 after :meth:`stage`.
        cache_staged_state_dict: keep the staged CPU copy between ``dcp.async_save`` calls
            (faster staging, memory held; reuse this writer for every save).
        overwrite: write into a directory that already holds a checkpoint (with torch's
            warning); ``False`` raises ``RuntimeError`` there, as stock.
        _extensions: stream transforms applied to each item (experimental in torch), e.g.
            ``[torch.distributed.checkpoint._extension.ZStandard()]`` (needs ``zstandard``).
        serialization_format: ``SerializationFormat.TORCH_SAVE`` (default) or ``SAFETENSORS``.
        write_timeout_s: distckpt's: this rank gives up writing after this many seconds
            (``WriteDeadlineExceeded``); ``None`` (default) for no limit.
        endpoint_url, region: distckpt's, S3 only: the client's endpoint and region (default
            ``$AWS_ENDPOINT_URL`` / ``$AWS_DEFAULT_REGION``; credentials from boto3's chain).

    Raises:
        RuntimeError: ``overwrite=False`` and ``path`` already holds a checkpoint (from ``dcp.save``).
        WriteDeadlineExceeded: past ``write_timeout_s`` (from ``dcp.save``, on every rank).
        OSError, StorageError: a writer thread's failure (from ``dcp.save``, on every rank).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        write_timeout_s: float | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
    ) -> None:
        # torch's own constructor (CheckedFileSystemWriter's takes only distckpt's arguments).
        TorchFileSystemWriter.__init__(
            self,
            local_path(path),
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
        )
        self.write_timeout_s = write_timeout_s
        self.endpoint_url, self.region = endpoint_url, region
        self._use_fs_for(path)

    def _use_fs_for(self, path: str | os.PathLike) -> None:
        self.fs = dcp_file_system(path, endpoint_url=self.endpoint_url, region=self.region)
        self.path = self.fs.init_path(local_path(path))
        self._requested_sync = getattr(self, "_requested_sync", self.sync_files)
        # An object store has no descriptor to fsync (torch would fall back to os.sync()).
        self.sync_files = self._requested_sync and getattr(self.fs, "fsync_applies", True)

    @override
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._use_fs_for(checkpoint_id)
        super().reset(local_path(checkpoint_id) if checkpoint_id else checkpoint_id)

    @override
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator

    @override
    def prepare_local_plan(self, plan: Any) -> Any:
        plan = super().prepare_local_plan(plan)  # torch's overwrite check first
        # An older save's hashes must not describe this save's files (a crash mid-save then
        # reads as corrupt, never as verified). The rank that writes the sidecar removes it:
        # the coordinator, or each rank for its own without rank coordination.
        if getattr(self, "is_coordinator", True) or not self.use_collectives:
            sidecar = self.fs.concat_path(self.path, dcp_hashes.sidecar_name(self._metadata_name()))
            if self.fs.exists(sidecar):
                try:
                    self.fs.rm_file(sidecar)
                except FileNotFoundError:
                    pass
        return plan

    @override
    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        results = list(future.value())
        mine = {r.storage_data.relative_path for r in results}
        hashes = {
            name: (w[0], w[1], getattr(w, "blocks", None)) for name, w in dict(self.fs.written).items() if name in mine
        }
        results.append(WriteResult(index=MetadataIndex(HASHES_FQN), size_in_bytes=0, storage_data=hashes))
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    @override
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        hashes: dict[str, dcp_hashes.FileHash] = {}
        clean = []
        for rank_results in results:
            clean.append([r for r in rank_results if r.index.fqn != HASHES_FQN])
            for r in rank_results:
                if r.index.fqn == HASHES_FQN:
                    hashes.update(r.storage_data)
        self.fs.begin(None)  # write_timeout_s bounds the write phase, not the metadata
        super().finish(metadata, clean)  # torch's: .metadata through a temporary name
        name = self._metadata_name()
        size, digest = self.fs.written[name]
        hashes[name] = (size, digest, None)
        tmp = self.fs.concat_path(self.path, dcp_hashes.sidecar_name(name) + ".tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            f.write(dcp_hashes.encode(hashes))
            if self.sync_files:
                os.fsync(f.fileno())
        self.fs.rename(tmp, self.fs.concat_path(self.path, dcp_hashes.sidecar_name(name)))

    def _metadata_name(self) -> str:
        """``.metadata``, or ``__<rank>.metadata`` for a save without rank coordination."""
        rank = None if self.use_collectives or self.rank is None else self.rank
        return os.path.basename(os.fspath(self._get_metadata_path(rank)))

    @override
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_location(checkpoint_id)
