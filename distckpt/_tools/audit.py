"""Full check of a committed checkpoint, reporting every problem rather than the first.

On top of the store's ``verify`` (manifest readable; each listed file present with its
size and xxh3-128 hash) it checks what a reader relies on next: the manifest's step matches the
directory name, no file is present that the manifest does not list, ``.metadata`` is DCP
metadata made of allowed types only (read without running code), every byte range it points
at lies in a listed file, and the manifest's model fingerprint matches the metadata's tensors.
Those structure checks are :func:`distckpt._ondisk.manifest.structure_problems`, which ``ls``, resume
discovery and ``load()`` apply too: only the hashes of files a load does not read are verify's alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import CheckpointCorruptError
from .._ondisk import dcp_hashes
from .._ondisk.integrity import check_file
from .._ondisk.layout import MANIFEST
from .._ondisk.manifest import Manifest, structure_problems
from .._storage import CheckpointStore, open_location, read_dcp_metadata
from .store_queries import tool_store

__all__ = ["AuditReport", "audit_checkpoint", "audit_plain_dcp"]


@dataclass(kw_only=True)
class AuditReport:
    """Result of :func:`audit_checkpoint`.

    Attributes:
        path: the checkpoint directory (an S3 checkpoint's data-prefix URL).
        manifest: the parsed manifest, or ``None`` when it is unreadable.
        problems: every problem found, each naming its file in ``.path``.
        unhashed: files the manifest lists without a hash (schema v1): size checked only.
        sidecar: for a plain DCP directory checked against its hash sidecar(s)
            (:func:`audit_plain_dcp`), ``{file name: size_bytes}`` of the files they list; else ``None``.
    """

    path: str
    manifest: Manifest | None
    problems: list[CheckpointCorruptError] = field(default_factory=list)
    unhashed: list[str] = field(default_factory=list)
    sidecar: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems


def audit_checkpoint(location: str | os.PathLike, *, store: CheckpointStore | None = None) -> AuditReport:
    """Check one committed checkpoint completely (reads every byte of every file): manifest,
    every listed file's size and hash, no unlisted file, ``.metadata`` (allow-list) pointing only
    into listed files within their sizes, the model fingerprint.

    Args:
        location: the checkpoint (a directory, or an S3 checkpoint's data-prefix URL).
        store: its root's store (default: opened from ``location``).

    Never raises for a damaged checkpoint: problems are returned. ``OSError`` other than a
    missing file (e.g. permission denied) propagates.
    """
    location = os.fspath(location)
    store = tool_store(store if store is not None else open_location(location)[0])
    problems = list(store.verify(location))
    try:
        manifest = store.read_manifest(location)
    except CheckpointCorruptError:
        return AuditReport(path=location, manifest=None, problems=problems)
    report = AuditReport(
        path=location, manifest=manifest, problems=problems, unhashed=[f.path for f in manifest.files if f.hash is None]
    )
    metadata = None
    try:
        metadata = read_dcp_metadata(store, location)
    except (CheckpointCorruptError, OSError) as e:  # a missing listed .metadata is reported by verify
        if ".metadata" in {f.path for f in manifest.files} and not any(".metadata" in str(p) for p in problems):
            problems.append(
                e
                if isinstance(e, CheckpointCorruptError)
                else CheckpointCorruptError(str(e), path=f"{location}/.metadata")
            )
    problems += structure_problems(
        manifest,
        location=location,
        manifest_path=store.manifest_path(location),
        dir_step=store.named_step(location),
        present=store.object_sizes(location),
        metadata=metadata,
    )
    return report


def audit_plain_dcp(directory: str | os.PathLike) -> AuditReport | None:
    """Check a plain DCP directory written by :class:`distckpt.dcp.FileSystemWriter` (no manifest)
    against the hash sidecar(s) it left next to ``.metadata`` (:mod:`distckpt._ondisk.dcp_hashes`):
    every file a sidecar lists, its size and xxh3-128 hash (block digests too), and no ``.distcp``
    file present that no sidecar lists. Reads every byte.

    Returns:
        The report (``sidecar`` set), or ``None`` when ``directory`` is not a local directory
        holding a sidecar and no manifest (a checkpoint, an object-storage URL, or a stock
        ``dcp.save``: nothing to check against).
    """
    root = Path(directory)
    plain = root.is_dir() and not (root / MANIFEST).exists()
    sidecars = sorted(root.glob("*" + dcp_hashes.SUFFIX)) if plain else []
    if not sidecars:
        return None
    report = AuditReport(path=os.fspath(directory), manifest=None, sidecar={})
    assert report.sidecar is not None
    for sidecar in sidecars:
        try:
            listed = dcp_hashes.decode(sidecar.read_bytes(), str(sidecar))
        except CheckpointCorruptError as e:
            report.problems.append(e)
            continue
        for name, (size, digest, blocks) in sorted(listed.items()):
            report.sidecar[name] = size
            try:
                check_file(root / name, size_bytes=size, digest=digest, blocks=blocks, source="hash sidecar")
            except CheckpointCorruptError as e:
                report.problems.append(e)
    for extra in sorted(p for p in root.glob("*.distcp") if p.name not in report.sidecar):
        report.problems.append(
            CheckpointCorruptError(f"{extra}: a DCP data file that no hash sidecar lists", path=str(extra))
        )
    return report
