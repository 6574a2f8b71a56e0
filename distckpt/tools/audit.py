"""Full check of a committed checkpoint, reporting every problem rather than the first.

On top of :func:`distckpt.storage.commit.verify` (manifest readable; each listed file present with its
size and xxh3-128 hash) it checks what a reader relies on next: the manifest's step matches the
directory name, no file is present that the manifest does not list, ``.metadata`` is DCP
metadata made of allowed types only (read without running code), every byte range it points
at lies in a listed file, and the manifest's model fingerprint matches the metadata's tensors.
Those structure checks are :func:`distckpt.ondisk.manifest.structure_problems`, which ``ls``, resume
discovery and ``load()`` apply too: only the hashes of files a load does not read are verify's alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import read_dcp_metadata
from ..errors import CheckpointCorruptError
from ..ondisk.layout import MANIFEST, parse_step
from ..ondisk.manifest import Manifest, structure_problems
from ..storage.commit import own_files, verify

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
    metadata = None
    if (path / ".metadata").exists():  # else already reported as a listed file that is missing
        try:
            metadata = read_dcp_metadata(path)
        except CheckpointCorruptError as e:
            problems.append(e)
    problems += structure_problems(manifest, location=str(path), manifest_path=str(path / MANIFEST),
                                   dir_step=parse_step(path.name), present=own_files(path), metadata=metadata)
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
    listed = {f.path for f in manifest.files}
    metadata = None
    try:
        metadata = store.read_dcp_metadata(location)
    except (CheckpointCorruptError, OSError) as e:
        if ".metadata" in listed and not any(".metadata" in str(p) for p in problems):
            problems.append(e if isinstance(e, CheckpointCorruptError)
                            else CheckpointCorruptError(str(e), path=f"{location}/.metadata"))
    problems += structure_problems(manifest, location=location, present=store.object_sizes(location),
                                   metadata=metadata)
    return report
