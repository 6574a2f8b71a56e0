"""The storage seam's runtime contract (docs/design.md, "Storage seam"): small, and enough for the
manager. A backend implementing only :class:`CheckpointStore` saves, keeps, prunes and loads."""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from distckpt import CheckpointConfig, CheckpointManager, ConfigError, RetentionConfig, ScheduleConfig
from distckpt._engine import SafeFileSystemReader
from distckpt._engine.blocking import hashing_writer
from distckpt._errors import CheckpointCorruptError
from distckpt._ondisk.layout import checkpoint_name
from distckpt._ondisk.manifest import FileEntry, Manifest
from distckpt._storage import CheckpointStore, Others
from distckpt._storage.posix import PosixStore
from distckpt._storage.s3 import S3Store
from distckpt._tools.store_queries import ToolStore, tool_store
from tests.distributed.trainer import build, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def contract_members(protocol: type) -> set[str]:
    """Methods and properties a protocol declares itself (not inherited), public ones."""
    return {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def test_the_runtime_contract_is_at_most_22_methods_and_both_stores_implement_it():
    methods = contract_members(CheckpointStore)
    attributes = set(CheckpointStore.__annotations__)
    assert len(methods) <= 22, sorted(methods)
    assert attributes == {"root", "kind", "shared"}
    tool_only = {"verify", "object_sizes", "manifest_path", "named_step", "leftovers", "deferred_by", "check_tool_root"}
    assert contract_members(ToolStore) == tool_only and not methods & tool_only
    for store in (PosixStore, S3Store):  # both implement the contract and the tools' queries
        assert all(callable(getattr(store, m)) for m in methods | tool_only), store


class _MemoryFile:
    """A root object held in a dict (the lock's operations)."""

    def __init__(self, files: dict[str, str], name: str) -> None:
        self.files, self.name, self.where = files, name, f"memory:{name}"

    def create_exclusive(self, text: str) -> bool:
        return self.files.setdefault(self.name, text) is text

    def read(self) -> str | None:
        return self.files.get(self.name)

    def replace(self, text: str) -> None:
        self.files[self.name] = text

    def remove(self) -> None:
        self.files.pop(self.name, None)


class ContractOnlyStore(CheckpointStore):
    """A backend with the runtime contract and nothing else: manifests, ``latest``, set-aside
    names and root files live in dicts (the commit is one dict insert, as on S3); DCP files in
    ``data/step-N-<id>`` directories of ``objects``. Every call is recorded."""

    kind, shared = "memory", True

    def __init__(self, root: str, objects: Path) -> None:
        self.root, self.objects = root, objects
        self.manifests: dict[int, tuple[str, str]] = {}  # step -> (location, manifest JSON)
        self.aside: list[str] = []
        self.latest: str | None = None
        self.files: dict[str, str] = {}
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and name in contract_members(CheckpointStore):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def prepare(self, *, read_only: bool = False) -> None:
        (self.objects / "data").mkdir(parents=True, exist_ok=True)

    def root_file(self, name: str) -> _MemoryFile:
        return _MemoryFile(self.files, name)

    def pending_location(self, step: int, save_id: str) -> str:
        return str(self.objects / "data" / f"{checkpoint_name(step)}-{save_id}")

    def final_location(self, step: int, pending: str) -> str:
        return pending

    def begin_write(self, pending: str) -> None:
        Path(pending).mkdir(parents=True, exist_ok=True)

    def dcp_writer(self, location: str, *, thread_count: int, write_timeout_s: float | None, incremental: Any = None):
        return hashing_writer(location, thread_count=thread_count, write_timeout_s=write_timeout_s)

    def list_files(self, pending: str, hashes: dict, *, references: bool = False) -> list[FileEntry]:
        return [
            FileEntry(path=p.name, size_bytes=p.stat().st_size, hash=hashes[p.name][1])
            for p in sorted(Path(pending).iterdir())
        ]

    def commit(self, pending: str, step: int, manifest: Manifest, on_phase: Callable | None = None) -> str:
        if step in self.manifests:
            raise FileExistsError(f"{checkpoint_name(step)} is committed")
        self.manifests[step] = (pending, manifest.to_json())
        self.latest = checkpoint_name(step)
        return pending

    def abort(self, pending: str) -> None:
        shutil.rmtree(pending, ignore_errors=True)

    def committed_steps(self) -> list[int]:
        return sorted(self.manifests)

    def others(self) -> Others:
        return Others(unmanaged=[], deferred=[], set_aside=list(self.aside), latest=self.latest)

    def location_of(self, step: int) -> str:
        return self.manifests[step][0] if step in self.manifests else f"{self.objects}/data/{checkpoint_name(step)}"

    def exists(self, location: str) -> bool:
        return os.path.isdir(location)

    def is_plain_dcp(self, location: str) -> bool:
        return False

    def read_manifest(self, location: str) -> Manifest:
        for loc, text in self.manifests.values():
            if loc == location:
                return Manifest.from_dict(json.loads(text), path=location)
        raise CheckpointCorruptError(f"{location}: not committed", path=location)

    def validate(self, location: str, *, check_hashes: bool = False) -> Manifest:
        manifest = self.read_manifest(location)
        for f in manifest.files:
            if (Path(location) / f.path).stat().st_size != f.size_bytes:
                raise CheckpointCorruptError(f"{location}/{f.path}: size", path=location)
        return manifest

    def read_file(self, location: str, name: str) -> bytes:
        return (Path(location) / name).read_bytes()

    def dcp_reader(self, location: str, *, expected_files: Any, fast: bool, thread_count: int, block_digests=None):
        return SafeFileSystemReader(location, expected_files=expected_files)

    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        self.manifests.pop(step)
        self.aside.append(f"{reason}-{checkpoint_name(step)}-0")
        return self.aside[-1]

    def remove_leftovers(self) -> list[str]:
        referenced = {loc for loc, _ in self.manifests.values()}
        loose = [p for p in (self.objects / "data").iterdir() if str(p) not in referenced]
        for p in loose:
            shutil.rmtree(p)
        return [p.name for p in loose]

    def delete_checkpoints(self, steps: list[int], *, before: Any = None, remove: Any = None) -> list[str]:
        for step in steps:
            if before is not None:
                before(step)
            shutil.rmtree(self.manifests.pop(step)[0])
        return [f"deleted {checkpoint_name(s)}" for s in steps]


def test_a_backend_with_only_the_runtime_contract_saves_prunes_and_loads(tmp_path, monkeypatch):
    root = str(tmp_path / "root")  # never created: every byte goes through the store
    store = ContractOnlyStore(root, tmp_path / "objects")
    monkeypatch.setattr("distckpt._manager.open_config_store", lambda config: store)
    cfg = CheckpointConfig(
        root=root, retention=RetentionConfig(keep_last=1), schedule=ScheduleConfig(interval_steps=None)
    )

    def manager() -> tuple[CheckpointManager, Any]:
        model, optimizer, scheduler, scaler, loader = build(0, 1, {})
        return CheckpointManager(
            cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
        ), (model, optimizer, scheduler, scaler, loader)

    m, objs = manager()
    train_steps(*objs, 2)
    m.save(2)
    train_steps(*objs, 1)
    m.save(3)  # retention (keep_last: 1) deletes step 2 through the store
    saved = {k: v.clone() for k, v in objs[0].state_dict().items()}
    m.close()
    assert store.committed_steps() == [3] and [p.name for p in (tmp_path / "objects" / "data").iterdir()] == [
        Path(store.location_of(3)).name
    ]

    m2, objs2 = manager()
    state = m2.load()
    m2.close()
    assert state is not None and state.step == 3 and state.checkpoint_path == store.location_of(3)
    loaded = objs2[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert not Path(root).exists()
    assert {"commit", "delete_checkpoints", "dcp_writer", "dcp_reader", "read_file"} <= set(store.calls)


def test_the_tools_refuse_a_store_without_their_queries_naming_them(tmp_path):
    store = ContractOnlyStore(str(tmp_path / "root"), tmp_path / "objects")
    with pytest.raises(ConfigError, match="implements only the runtime contract") as err:
        tool_store(store)
    assert "check_tool_root" in str(err.value) and "verify" in str(err.value)
    assert tool_store(PosixStore(str(tmp_path))) is not None
