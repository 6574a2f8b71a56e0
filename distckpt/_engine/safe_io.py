"""Reading a checkpoint directory as data, never code.

DCP stores ``.metadata`` as a pickle and loads non-tensor items with
``torch.load(weights_only=False)``; both would run code planted in a downloaded checkpoint.
:func:`read_dcp_metadata` uses an unpickler that admits only DCP's metadata types, and
:class:`SafeLoadPlanner` loads non-tensor items with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from typing_extensions import override

from .._errors import CheckpointCorruptError
from .._ondisk.integrity import check_file
from .._ondisk.safe_values import load_value
from .torch_format.flatten import flatten_state_dict
from .torch_format.internals import ShardedTensor, set_element

__all__ = ["read_dcp_metadata", "parse_dcp_metadata", "SafeFileSystemReader", "SafeLoadPlanner"]

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_ALLOWED["torch.distributed.checkpoint.metadata"] = {
    n for n, v in vars(dcp_metadata).items() if isinstance(v, type) or n == "_MEM_FORMAT_ENCODING"
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self._path = path

    @override
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointCorruptError(
            f"{self._path}: refusing to unpickle {module}.{name}: a DCP .metadata file may only "
            "hold DCP metadata types (checkpoint directories are data, never code). "
            "Do not load this checkpoint unless you trust its origin.",
            path=self._path,
        )


def read_dcp_metadata(checkpoint_dir: str | os.PathLike) -> Metadata:
    """Read ``<checkpoint_dir>/.metadata`` with an allow-list unpickler.

    Raises:
        CheckpointCorruptError: missing/unreadable file, a disallowed type, or not DCP metadata.
    """
    return _read_metadata_file(str(Path(checkpoint_dir) / ".metadata"))


def _read_metadata_file(path: str) -> Metadata:
    try:
        with open(path, "rb") as f:
            return parse_dcp_metadata(f, path)
    except FileNotFoundError as e:
        raise CheckpointCorruptError(f"{path}: DCP metadata file missing", path=path) from e
    except OSError as e:
        raise CheckpointCorruptError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})", path=path) from e


def parse_dcp_metadata(f: io.IOBase | io.BytesIO, path: str) -> Metadata:
    """Unpickle DCP ``Metadata`` from an open binary file with the allow-list unpickler (used
    for ``.metadata`` read from object storage too; ``path`` names it in errors).

    Raises:
        CheckpointCorruptError: a disallowed type, garbage, or not DCP metadata.
    """
    try:
        metadata = _MetadataUnpickler(f, path).load()
    except CheckpointCorruptError:
        raise
    except Exception as e:  # pickle raises many types on garbage
        raise CheckpointCorruptError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})", path=path) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: not DCP metadata (got {type(metadata).__name__})", path=path)
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses :func:`read_dcp_metadata` and that,
    given the manifest's file list, checks size and hash of each file this rank reads before
    reading it (each file once per reader).

    Args:
        path: checkpoint directory.
        expected_files: ``{relative path: (size_bytes, digest or None)}``; ``None`` skips checks.

    Attributes:
        expected_source: the record ``expected_files`` comes from, named in error messages:
            ``"manifest"`` (a distckpt checkpoint) or ``"hash sidecar"`` (a plain DCP directory,
            :class:`distckpt.dcp.FileSystemReader`).
    """

    expected_source = "manifest"

    def __init__(
        self, path: str | os.PathLike, expected_files: dict[str, tuple[int, str | None]] | None = None
    ) -> None:
        super().__init__(path)
        self.expected_files = expected_files
        self._checked: set[str] = set()
        self.known_metadata: Metadata | None = None

    def share_over(self, group: Any, *, min_bytes: int | None = None) -> None:
        """Readers that cannot share what they read among ranks ignore this (see
        :class:`~distckpt._engine.read.shared_read.SharingReader`)."""

    def use_metadata(self, metadata: Metadata) -> None:
        """Serve ``read_metadata`` from ``metadata``, already parsed (and checked) by the caller
        from this checkpoint's ``.metadata``: unpickling it costs about 50 us per item."""
        self.known_metadata = metadata

    @override
    def read_data(self, plan, planner):
        if self.expected_files is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                if name in self._checked:
                    continue
                if name not in self.expected_files:
                    raise CheckpointCorruptError(
                        f"{Path(self.path) / name}: DCP metadata refers to a file the {self.expected_source} "
                        "does not list",
                        path=str(Path(self.path) / name),
                    )
                size, digest = self.expected_files[name]
                check_file(Path(self.path) / name, size_bytes=size, digest=digest, source=self.expected_source)
                self._checked.add(name)
        return super().read_data(plan, planner)

    @override
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = self.known_metadata or _read_metadata_file(str(self._get_metadata_path(kwargs.get("rank"))))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``torch.load(weights_only=True)``
    (numpy scalars and arrays admitted: :func:`distckpt._ondisk.safe_values.load_value`), and plans
    a load of whole tensors without DCP's overlap search (:func:`whole_tensor_load_plan`).

    Its set-up walks the state_dict once where it can: DCP's walk that splits FSDP1's nested
    ``ShardedTensor``s, and the one that materialises meta tensors, run only when the flattened
    state_dict holds one (as :class:`~distckpt._engine.save_planner.LeanSavePlanner`); else it
    sets what ``DefaultLoadPlanner.set_up_planner`` of torch 2.13 sets (the state_dict, flat and
    as given, the key paths, the metadata, the coordinator flag)."""

    @override
    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.whole_plan = False
        if not self.flatten_state_dict:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        flat, mappings = flatten_state_dict(state_dict)
        if any(isinstance(v, ShardedTensor) or (isinstance(v, torch.Tensor) and v.is_meta) for v in flat.values()):
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        self.original_state_dict, self.state_dict, self.mappings = state_dict, flat, mappings
        self.metadata, self.is_coordinator = metadata, is_coordinator

    @override
    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set_up_planner's
        plan = whole_tensor_load_plan(self.state_dict, self.metadata)
        self.whole_plan = plan is not None
        return plan if plan is not None else super().create_local_plan()

    @override
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # An item of the whole-tensor plan reads all of its target: DCP's narrow of it is the
        # target itself, found without DCP's per-item index checks.
        cls = type(self)
        if (
            getattr(self, "whole_plan", False)
            and cls.lookup_tensor is DefaultLoadPlanner.lookup_tensor
            and cls.transform_tensor is DefaultLoadPlanner.transform_tensor
        ):
            return self.state_dict[read_item.dest_index.fqn]
        return super().resolve_tensor(read_item)

    @override
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = load_value(value)
        except pickle.UnpicklingError as e:
            raise CheckpointCorruptError(
                f"item {read_item.dest_index.fqn!r}: refusing to unpickle a non-tensor value that "
                f"needs arbitrary code ({e}); checkpoint directories are data, never code"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def whole_tensor_load_plan(state_dict: dict[str, Any], metadata: dcp_metadata.Metadata) -> LoadPlan | None:
    """DCP's local load plan of the flat ``state_dict`` where its keys are exactly ``metadata``'s and
    every tensor is a plain one saved whole, as one chunk at offset 0 (an unsharded model, its
    optimizer state): one ``ReadItem`` per key, equal to the one ``create_default_local_load_plan``
    makes, built directly instead of by intersecting chunk lists (microseconds per item). ``None``
    for anything else: DCP plans it, with its errors and its reading of keys the target lacks
    (a checkpoint of torch 2.3's flattening, a partial load), a DTensor, a shard, a size mismatch."""
    saved = metadata.state_dict_metadata
    if len(saved) != len(state_dict):
        return None
    # The metadata's own storage keys serve as the items' indices where equal (DCP compares
    # indices by value): no new index, nor its torch.Size, per item.
    stored = {index.fqn: index for index in getattr(metadata, "storage_data", None) or ()}
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if md is None:
            return None
        if isinstance(md, dcp_metadata.BytesStorageMetadata):
            if isinstance(obj, torch.Tensor):
                return None
            index = stored.get(fqn)
            if index is None or index.offset is not None:
                index = dcp_metadata.MetadataIndex(fqn)
            requests.append(ReadItem(LoadItemType.BYTE_IO, index, _ZERO, index, _ZERO, _ZERO))
            continue
        if type(obj) not in _PLAIN or len(md.chunks) != 1:
            return None
        chunk = md.chunks[0]
        size = obj.size()
        if size != md.size or chunk.sizes != size or any(chunk.offsets):
            return None
        if 0 in size:
            continue  # no overlap: DCP plans no read of an empty tensor
        offsets = chunk.offsets
        index = stored.get(fqn)
        if index is None or index.offset != offsets:
            index = dcp_metadata.MetadataIndex(fqn, offsets, 0)  # immutable: one for both ends
        requests.append(ReadItem(LoadItemType.TENSOR, index, offsets, index, offsets, size))
    return LoadPlan(requests)


_ZERO = torch.Size((0,))
