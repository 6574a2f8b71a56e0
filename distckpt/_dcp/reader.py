"""``distckpt.dcp.FileSystemReader``: a drop-in for torch's ``FileSystemReader`` that reads any
DCP checkpoint directory (written by stock DCP or by :class:`distckpt.dcp.FileSystemWriter`)
with distckpt's readers, and verifies every file it reads when the directory has the hash
sidecar :class:`~distckpt.dcp.FileSystemWriter` writes (:mod:`distckpt._ondisk.dcp_hashes`).

It delegates every ``StorageReader`` call to one of distckpt's readers, chosen by the path
(:func:`distckpt._storage.plain_dcp.dcp_reader`): on POSIX the fast reader (large sequential
reads straight into the destination tensors, digests computed from the bytes read, ranged reads
verified per block) or DCP's item-by-item reader after a whole-file check; on S3 a reader that
downloads each object once and checks it. ``.metadata`` is unpickled with an allow-list and
non-tensor items are loaded the way the planner asks (``DefaultLoadPlanner``: as stock).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future
from typing_extensions import override

from .._engine.safe_io import parse_dcp_metadata
from .._engine.torch_format.internals import StorageReaderTransforms
from .._errors import CheckpointCorruptError
from .._ondisk import dcp_hashes
from .._ondisk.integrity import HASH_ALGORITHM, new_hasher
from .._storage.plain_dcp import dcp_reader, read_bytes, valid_location

__all__ = ["FileSystemReader"]

_log = logging.getLogger(__name__)


def _is_coordinator() -> bool:
    """Rank 0 of the default group, or a process without one."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class FileSystemReader(StorageReader):
    """Drop-in for ``torch.distributed.checkpoint.FileSystemReader`` (module docstring). Use it
    where DCP takes a ``storage_reader`` (``dcp.load``); every rank makes the calls DCP makes.

    Args:
        path: the checkpoint directory, ``file://`` path, or ``s3://bucket/prefix`` URL.
        _extension_registry: as torch's (experimental): decodes items saved with stream
            transforms; ``None``: torch's default registry (``ZStandard``).
        verify: distckpt's: check each file this rank reads, and ``.metadata``, against the
            hash sidecar when the directory has one (``False``: never read it). A directory
            without a sidecar (a stock ``FileSystemWriter``'s) is read unverified, as stock,
            with one WARNING per load (logger ``distckpt._dcp.reader``, rank 0).
        fast: distckpt's, POSIX only: the fast reader (default) or DCP's item-by-item reader.
        thread_count: distckpt's: parallel read streams of this rank (fast reader).
        endpoint_url, region: distckpt's, S3 only: the client's endpoint and region.

    Attributes:
        hashes: the sidecar's ``{file name: (size_bytes, digest, blocks)}`` after
            ``read_metadata``, or ``None`` (no sidecar, or ``verify=False``).

    Raises:
        CheckpointCorruptError: from ``read_metadata`` or ``read_data`` (inside ``dcp.load``,
            which wraps it in its ``CheckpointException`` on every rank): a file whose size or
            xxh3-128 digest differs from the sidecar, naming the file and the bytes; a
            malformed sidecar; a ``.metadata`` that is not DCP metadata.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: Any = None,
        *,
        verify: bool = True,
        fast: bool = True,
        thread_count: int = 2,
        endpoint_url: str | None = None,
        region: str | None = None,
    ) -> None:
        super().__init__()
        self._registry = _extension_registry
        self.verify, self.fast, self.thread_count = verify, fast, int(thread_count)
        self.endpoint_url, self.region = endpoint_url, region
        self.hashes: dict[str, dcp_hashes.FileHash] | None = None
        self._location = path
        self._open(None)

    def _open(self, hashes: dict[str, dcp_hashes.FileHash] | None) -> None:
        self.hashes = hashes
        expected: dict[str, tuple[int, str | None]] | None = None
        if hashes is not None:
            expected = {name: (size, digest) for name, (size, digest, _b) in hashes.items()}
        blocks = None if hashes is None else {name: b for name, (_s, _d, b) in hashes.items() if b is not None}
        self._inner = dcp_reader(
            self._location,
            expected_files=expected,
            block_digests=blocks,
            fast=self.fast,
            thread_count=self.thread_count,
            endpoint_url=self.endpoint_url,
            region=self.region,
            expected_source="hash sidecar",
        )
        if self._registry is not None:
            self._inner.transforms = StorageReaderTransforms(self._registry)

    def __getattr__(self, name: str) -> Any:
        # Attributes of torch's reader (path, fs, storage_data, load_id, transforms, ...).
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        """The checkpoint this reader reads (as torch's ``FileSystemReader.checkpoint_id``)."""
        return self._inner.path

    @override
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._location = checkpoint_id
        self._open(None)

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        data = read_bytes(self._inner, dcp_hashes.sidecar_name(name)) if self.verify else None
        if data is None:
            self._open(None)
            if self.verify and _is_coordinator():
                # Documented, but a user cannot see it happen otherwise: once per load (DCP reads the
                # metadata once per load), on one rank.
                _log.warning(
                    "%s: no hash sidecar (%s), reading unverified (a stock FileSystemWriter's directory; "
                    "distckpt.dcp.FileSystemWriter writes one)",
                    os.fspath(self._inner.path),
                    dcp_hashes.sidecar_name(name),
                )
            return self._inner.read_metadata(*args, **kwargs)
        self._open(dcp_hashes.decode(data, self._where(dcp_hashes.sidecar_name(name))))
        raw = self._checked(name)
        metadata = parse_dcp_metadata(io.BytesIO(raw), self._where(name))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self._inner.load_id
        return metadata

    def _where(self, name: str) -> str:
        return os.fspath(self._inner.fs.concat_path(self._inner.path, name))

    def _checked(self, name: str) -> bytes:
        """The bytes of ``name`` (``.metadata``), verified against the sidecar."""
        assert self.hashes is not None
        where = self._where(name)
        if name not in self.hashes:
            raise CheckpointCorruptError(f"{where}: the hash sidecar next to it does not list it", path=where)
        size, digest, _blocks = self.hashes[name]
        raw = read_bytes(self._inner, name)
        if raw is None:
            raise CheckpointCorruptError(f"{where}: missing, but the hash sidecar lists it", path=where)
        hasher = new_hasher()
        hasher.update(raw)
        if len(raw) != size or hasher.hexdigest() != digest:
            raise CheckpointCorruptError(
                f"{where}: {len(raw)} bytes with {HASH_ALGORITHM} {hasher.hexdigest()}, the hash sidecar "
                f"records {size} bytes with {digest} (the file changed after the save); restore it from a copy",
                path=where,
            )
        return raw

    @override
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    @override
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._inner.prepare_local_plan(plan)

    @override
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._inner.prepare_global_plan(plans)

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return self._inner.read_data(plan, planner)

    @override
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_location(checkpoint_id)
