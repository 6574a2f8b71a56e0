"""Read one checkpoint directory item by item, in one process, without a process group.

A DCP checkpoint holds *items* under flattened keys (``model.<fqn>``, ``optim.state.<fqn>.<name>``,
``train_state``, ...): tensors, possibly in several shards written by different ranks, and
non-tensor values (``bytes`` made by ``torch.save``). :class:`CheckpointReader` lists them from
the ``.metadata`` file (read with an allow-list unpickler, never plain ``pickle.load``) and reads
them in small batches through DCP's own reader, so a FULL tensor is assembled from its shards
while peak memory stays about one batch (a few tensors), not the whole checkpoint.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .._engine import SafeLoadPlanner
from .._engine.blocking import raise_as_corrupt
from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from .._ondisk.layout import MANIFEST
from .._ondisk.manifest import Manifest
from .._storage import find_committed, open_location, read_dcp_metadata

__all__ = ["GROUPS", "ItemInfo", "CheckpointReader", "item_group", "resolve_checkpoint"]

GROUPS = ("model", "optimizer", "dataloader", "rng", "extra", "other")
_BATCH_BYTES = 64 << 20


def item_group(key: str) -> str:
    """Group of a flattened checkpoint key: one of :data:`GROUPS`."""
    if key.startswith("model."):
        return "model"
    if key.startswith("optim."):
        return "optimizer"
    if key == "data" or (key.startswith("rank_state.") and key.endswith(".dataloader")):
        return "dataloader"
    if key.startswith("rank_state.") and key.endswith(".rng"):
        return "rng"
    if key.startswith("extra.") or key == "extra":
        return "extra"
    return "other"


@dataclass(kw_only=True)
class ItemInfo:
    """One item of a checkpoint, from its DCP metadata (no data read).

    Attributes:
        key: flattened key, e.g. ``model.encoder.layer.0.attention.self.query.weight``.
        group: see :func:`item_group`.
        kind: ``"tensor"`` or ``"object"`` (a pickled non-tensor value).
        shape: global shape of a tensor; ``None`` for an object.
        dtype: ``str(torch.dtype)`` of a tensor; ``None`` for an object.
        size_bytes: tensor: ``numel * element size`` of the FULL tensor; object: bytes stored.
        shards: number of chunks (tensor) or stored records (object).
    """

    key: str
    group: str
    kind: str
    shape: list[int] | None
    dtype: str | None
    size_bytes: int
    shards: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a ``torch.dtype`` (``None`` for an object)."""
        return getattr(torch, self.dtype.split(".")[-1]) if self.dtype else None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``distckpt inspect --json``)."""
        return {
            "key": self.key,
            "group": self.group,
            "kind": self.kind,
            "shape": self.shape,
            "dtype": self.dtype,
            "size_bytes": self.size_bytes,
            "shards": self.shards,
        }


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """The checkpoint ``path`` names: itself when it is one (a directory with DCP metadata or a
    manifest; an S3 data prefix), else the newest committed checkpoint of the root it names.

    Returns:
        The checkpoint's location (a directory path, or an S3 data-prefix URL).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or holds neither DCP metadata nor a
            committed checkpoint.
    """
    store, location = open_location(path)
    if location is not None:
        return location
    if not store.exists(store.root):
        raise CheckpointNotFoundError(f"{store.root}: no such checkpoint or root")
    for _, found, result in find_committed(store):
        if isinstance(result, Manifest):
            return found
    raise CheckpointNotFoundError(
        f"{store.root}: not a checkpoint (no .metadata or {MANIFEST}) and no committed checkpoint under it"
    )


def _catalogue(metadata: Metadata, path: Path | str) -> dict[str, ItemInfo]:
    stored: dict[str, list[int]] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored.setdefault(index.fqn, []).append(info.length)
    items = {}
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for d in md.size:
                numel *= d
            covered = sum(_volume(c.sizes) for c in md.chunks)
            if covered < numel:
                raise CheckpointCorruptError(
                    f"{path}/.metadata: tensor {key!r} of shape {list(md.size)} has shards "
                    f"covering {covered} of {numel} elements",
                    path=f"{path}/.metadata",
                )
            itemsize = torch.empty((), dtype=md.properties.dtype, device="cpu").element_size()
            items[key] = ItemInfo(
                key=key,
                group=item_group(key),
                kind="tensor",
                shape=list(md.size),
                dtype=str(md.properties.dtype),
                size_bytes=numel * itemsize,
                shards=len(md.chunks),
            )
        elif isinstance(md, BytesStorageMetadata):
            lengths = stored.get(key, [])
            items[key] = ItemInfo(
                key=key,
                group=item_group(key),
                kind="object",
                shape=None,
                dtype=None,
                size_bytes=sum(lengths),
                shards=len(lengths),
            )
    return items


def _volume(sizes: Iterable[int]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n


class CheckpointReader:
    """Items of one checkpoint directory, readable one batch at a time.

    Args:
        checkpoint_dir: a directory with DCP files (committed by distckpt or plain DCP).
        check_files: before reading a data file, check its size and xxh3-128 hash against the
            manifest (each file once). Needs a readable manifest when one is present.

    Attributes:
        path: the checkpoint directory.
        metadata: DCP metadata (read safely).
        manifest: the parsed ``distckpt.json``, or ``None`` (absent or unreadable).
        manifest_error: why the manifest could not be read, or ``None``.
        items: ``{key: ItemInfo}``, sorted by key.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` is not a directory.
        CheckpointCorruptError: ``.metadata`` missing, unreadable or holding disallowed types;
            with ``check_files``, an unreadable manifest.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike, *, check_files: bool = True) -> None:
        store, location = open_location(checkpoint_dir)
        self.path: str = location if location is not None else os.fspath(checkpoint_dir)
        if not store.exists(self.path):
            raise CheckpointNotFoundError(f"{self.path}: no such checkpoint directory")
        self.metadata = read_dcp_metadata(store, self.path)
        read = None if store.is_plain_dcp(self.path) else functools.partial(store.read_manifest, self.path)
        expected = self._read_manifest(read, check_files)
        self._storage = store.dcp_reader(self.path, expected_files=expected, fast=False, thread_count=1)
        self._storage.read_metadata = lambda *a, **k: self.metadata  # parsed once, safely
        self.items = _catalogue(self.metadata, self.path)

    def _read_manifest(
        self, read_manifest: Callable[[], Manifest] | None, check_files: bool
    ) -> dict[str, tuple[int, str | None]] | None:
        """Set ``manifest`` and ``manifest_error`` from ``read_manifest()`` (``None``: the
        checkpoint has none); return the files to check as ``expected_files`` (``None``: none).

        Raises:
            CheckpointCorruptError: an unreadable manifest, with ``check_files``.
        """
        self.manifest: Manifest | None = None
        self.manifest_error: CheckpointCorruptError | None = None
        if read_manifest is not None:
            try:
                self.manifest = read_manifest()
            except CheckpointCorruptError as e:
                if check_files:
                    raise
                self.manifest_error = e
        return (
            {f.path: (f.size_bytes, f.hash) for f in self.manifest.files}
            if check_files and self.manifest is not None
            else None
        )

    def keys(self, group: str | None = None) -> list[str]:
        """Sorted keys, optionally of one group."""
        return [k for k, v in self.items.items() if group is None or v.group == group]

    def read(self, keys: Iterable[str]) -> dict[str, Any]:
        """Read items: FULL tensors (CPU, their stored dtype) and decoded objects.

        Objects are unpickled with ``torch.load(weights_only=True)``; distckpt's own non-tensor
        items decode to the ``bytes`` that :func:`distckpt._state.training_state.unpack` decodes further.

        Raises:
            KeyError: a key the checkpoint does not have.
            CheckpointCorruptError: a file that fails its manifest check or cannot be read.
        """
        target: dict[str, Any] = {}
        for key in keys:
            info = self.items[key]
            if info.kind == "tensor":
                assert info.shape is not None  # every tensor item records its shape
                target[key] = torch.empty(info.shape, dtype=info.torch_dtype, device="cpu")
            else:
                target[key] = b""
        if not target:
            return {}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load(target, storage_reader=self._storage, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointCorruptError:
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise_as_corrupt(e, self.path, f"reading {sorted(target)[0]!r}")
        return target

    def iter_read(self, keys: Iterable[str], *, batch_bytes: int = _BATCH_BYTES) -> Iterator[tuple[str, Any]]:
        """Yield ``(key, value)`` in the order of ``keys``, reading up to ``batch_bytes`` of
        tensors per DCP call (a larger tensor is read alone). Peak memory: about one batch plus
        one stored shard."""
        batch: list[str] = []
        size = 0
        for key in keys:
            n = self.items[key].size_bytes
            if batch and size + n > batch_bytes:
                values = self.read(batch)
                yield from ((k, values.pop(k)) for k in batch)
                batch, size = [], 0
            batch.append(key)
            size += n
        if batch:
            values = self.read(batch)
            yield from ((k, values.pop(k)) for k in batch)
