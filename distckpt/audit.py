"""Full check of a committed checkpoint, reporting every problem rather than the first.

On top of :func:`distckpt.commit.verify` (manifest readable; each listed file present with its
size and xxh3-128 hash) it checks what a reader relies on next: the manifest's step matches the
directory name, no file is present that the manifest does not list, ``.metadata`` is DCP
metadata made of allowed types only (read without running code), every byte range it points
at lies in a listed file, and the manifest's model fingerprint matches the metadata's tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .commit import verify
from .engine import read_dcp_metadata
from .errors import CheckpointCorruptError
from .layout import MANIFEST, parse_step
from .manifest import Manifest

__all__ = ["AuditReport", "audit_checkpoint", "audit_store_checkpoint"]


@dataclass(kw_only=True)
class AuditReport:
    """Result of :func:`audit_checkpoint`.

    Attributes:
        path: the checkpoint directory (an S3 checkpoint's data-prefix URL).
        manifest: the parsed manifest, or ``None`` when it is unreadable.
        problems: every problem found, each naming its file in ``.path``.
        unhashed: files the manifest lists without a hash (schema v1): size checked only.
    """

    path: Path | str
    manifest: Manifest | None
    problems: list[CheckpointCorruptError] = field(default_factory=list)
    unhashed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_checkpoint(checkpoint_dir: str | os.PathLike) -> AuditReport:
    """Check one checkpoint directory completely (reads every byte of every file).

    Never raises for a damaged checkpoint: problems are returned. ``OSError`` other than a
    missing file (e.g. permission denied) propagates.
    """
    path = Path(checkpoint_dir)
    problems = list(verify(path))
    try:
        manifest = Manifest.read(path)
    except CheckpointCorruptError:
        return AuditReport(path=path, manifest=None, problems=problems)
    report = AuditReport(path=path, manifest=manifest, problems=problems,
                         unhashed=[f.path for f in manifest.files if f.hash is None])
    manifest_path = str(path / MANIFEST)
    step = parse_step(path.name)
    if step is not None and step != manifest.step:
        problems.append(CheckpointCorruptError(
            f"{manifest_path}: manifest says step {manifest.step}, directory is step {step}",
            path=manifest_path))
    listed = {f.path: f.size_bytes for f in manifest.files}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and rel != MANIFEST and rel not in listed:
            problems.append(CheckpointCorruptError(
                f"{p}: file not listed in the manifest (added or renamed after the commit)", path=str(p)))
    if not (path / ".metadata").exists():
        return report  # already reported as a listed file that is missing
    try:
        metadata = read_dcp_metadata(path)
    except CheckpointCorruptError as e:
        problems.append(e)
        return report
    meta_path = str(path / ".metadata")
    for index, info in (metadata.storage_data or {}).items():
        size = listed.get(info.relative_path)
        if size is None:
            problems.append(CheckpointCorruptError(
                f"{meta_path}: item {index.fqn!r} is stored in {info.relative_path!r}, which the "
                "manifest does not list", path=meta_path))
        elif info.offset + info.length > size:
            problems.append(CheckpointCorruptError(
                f"{path / info.relative_path}: item {index.fqn!r} at bytes {info.offset}.."
                f"{info.offset + info.length} lies past the end ({size} bytes)",
                path=str(path / info.relative_path)))
    saved = {k[len("model."):]: (list(v.size), str(v.properties.dtype))
             for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    recorded = {k: (list(v.shape), v.dtype) for k, v in manifest.model.items()}
    if saved != recorded:
        diff = sorted(k for k in set(saved) | set(recorded) if saved.get(k) != recorded.get(k))
        problems.append(CheckpointCorruptError(
            f"{manifest_path}: the manifest's model fingerprint does not match the tensors in "
            f".metadata (first differences: {', '.join(diff[:5])})", path=manifest_path))
    return report


def audit_store_checkpoint(store: Any, location: str) -> AuditReport:
    """:func:`audit_checkpoint` of a checkpoint on object storage (``store``'s ``location``):
    manifest, every listed object's size and hash (reads every byte), no unlisted object, and
    ``.metadata`` (allow-list) pointing only into listed objects, within their sizes."""
    problems = list(store.verify(location))
    try:
        manifest = store.read_manifest(location)
    except CheckpointCorruptError:
        return AuditReport(path=location, manifest=None, problems=problems)
    report = AuditReport(path=location, manifest=manifest, problems=problems,
                         unhashed=[f.path for f in manifest.files if f.hash is None])
    listed = {f.path: f.size_bytes for f in manifest.files}
    for name in sorted(set(store.object_sizes(location)) - set(listed)):
        problems.append(CheckpointCorruptError(
            f"{location}/{name}: object not listed in the manifest (added after the commit)",
            path=f"{location}/{name}"))
    try:
        metadata = store.read_dcp_metadata(location)
    except (CheckpointCorruptError, OSError) as e:
        if ".metadata" in listed and not any(".metadata" in str(p) for p in problems):
            problems.append(e if isinstance(e, CheckpointCorruptError)
                            else CheckpointCorruptError(str(e), path=f"{location}/.metadata"))
        return report
    for index, info in (metadata.storage_data or {}).items():
        size = listed.get(info.relative_path)
        if size is None or info.offset + info.length > size:
            problems.append(CheckpointCorruptError(
                f"{location}/.metadata: item {index.fqn!r} points at {info.relative_path!r} bytes "
                f"{info.offset}..{info.offset + info.length}, outside the listed objects",
                path=f"{location}/.metadata"))
    return report
