"""Commit protocol and discovery on a POSIX file system (docs/design.md, section 4).

Rank 0 calls :func:`commit` after every rank's write succeeded::

    write manifest (tmp + fsync + os.replace) -> fsync pending dir -> rename pending -> final
    -> fsync root -> replace ``latest`` (tmp + fsync + os.replace) -> fsync root

A SIGKILL at any instant leaves either the previous checkpoint or the new one loadable:
before the rename the new one is a pending directory (never loaded); after it, the directory
holds a complete manifest. ``latest`` is only a hint; :func:`validate` is the truth.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable

from .._errors import CheckpointCorruptError
from .._ondisk.digests import is_digests_name, read_blocks
from .._ondisk.integrity import check_file
from .._ondisk.layout import (
    DEFERRED_MANIFEST,
    LATEST,
    MANIFEST,
    NO_MANIFEST,
    SET_ASIDE_REASONS,
    checkpoint_dirs,
    deleting_name,
    is_deferred,
    is_deleting,
    is_pending,
    parse_step,
)
from .._ondisk.manifest import FileEntry, Manifest, first_problem, structure_problems
from .localfs import fsync_dir, write_atomic

__all__ = [
    "set_aside",
    "list_files",
    "commit",
    "validate",
    "own_files",
    "verify",
    "find_committed",
    "remove_leftovers",
    "unmanaged_step_dirs",
    "damaged_step_dirs",
    "is_damaged",
    "existing_checkpoints",
    "repair_latest",
    "delete_checkpoint",
]

logger = logging.getLogger(__name__)


def list_files(checkpoint_dir: str | os.PathLike, hashes: dict[str, tuple[int, str]] | None = None) -> list[FileEntry]:
    """Every regular file under ``checkpoint_dir`` except the manifest, sorted, with sizes and
    the hashes the writing ranks reported (``{relative path: (size_bytes, digest)}``).

    Raises:
        CheckpointCorruptError: a file's size differs from what its writer reported.
    """
    root = Path(checkpoint_dir)
    hashes = hashes or {}
    entries = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}.tmp"):
            rel = p.relative_to(root).as_posix()
            size = p.stat().st_size
            reported = hashes.get(rel)
            if reported is not None and reported[0] != size:
                raise CheckpointCorruptError(f"{p}: {size} bytes on disk, its writer wrote {reported[0]}", path=str(p))
            entries.append(FileEntry(path=rel, size_bytes=size, hash=reported[1] if reported else None))
    return entries


def commit(
    pending_dir: str | os.PathLike,
    final_dir: str | os.PathLike,
    manifest: Manifest,
    on_phase: Callable[[str], None] | None = None,
) -> None:
    """Make a fully written pending directory a committed checkpoint. Rank 0 only.

    ``manifest.files`` must already list the pending directory's files. ``on_phase`` is
    called with ``"manifest"``, ``"rename"``, ``"latest"`` before each step.

    Raises:
        FileExistsError: ``final_dir`` exists (a checkpoint of that step is already committed).
        OSError: from the file system; the pending directory is then left for cleanup.
    """
    pending_dir, final_dir = Path(pending_dir), Path(final_dir)
    if final_dir.exists():
        if is_deferred(final_dir):
            raise FileExistsError(
                f"{final_dir} is a deferred checkpoint (retired by retention, {DEFERRED_MANIFEST}) "
                "whose files later incremental checkpoints still refer to: it cannot be replaced "
                "until they are gone; save another step, or use another root"
            )
        if is_damaged(final_dir, _latest_name(final_dir.parent)):
            raise FileExistsError(
                f"{final_dir}: {NO_MANIFEST}: distckpt's own files but no {MANIFEST}, so a save of its step "
                "cannot commit (distckpt never overwrites or deletes it). Restore its manifest from a copy, "
                "move it out of the root (load.fallback_to_older sets the newest such one aside at the next "
                "load), or save another step"
            )
        if not (final_dir / MANIFEST).exists():
            raise FileExistsError(
                f"{final_dir} exists and is not a distckpt checkpoint (no {MANIFEST}, none of distckpt's "
                f"files: unmanaged, e.g. a plain dcp.save); distckpt never overwrites or deletes it: move it "
                "out of the root, or `distckpt import` it into another root"
            )
        raise FileExistsError(f"{final_dir} already exists; refusing to overwrite a committed checkpoint")
    phase = on_phase or (lambda name: None)
    phase("manifest")
    write_atomic(pending_dir / MANIFEST, manifest.to_json())
    phase("rename")
    os.rename(pending_dir, final_dir)
    fsync_dir(final_dir.parent)
    phase("latest")
    write_atomic(final_dir.parent / LATEST, final_dir.name + "\n")


def validate(checkpoint_dir: str | os.PathLike, *, check_hashes: bool = False) -> Manifest:
    """Check a checkpoint directory against its manifest: every file exists with its size
    (and, with ``check_hashes``, its content hash; that reads every byte), the manifest's step
    is the directory's (``step-N``) and no file is there that the manifest does not list
    (:func:`~distckpt._ondisk.manifest.structure_problems`, as ``distckpt verify`` checks).

    Returns:
        The parsed manifest.

    Raises:
        CheckpointCorruptError: naming the first bad file (expected vs actual), or the manifest.
    """
    checkpoint_dir = Path(checkpoint_dir)
    manifest = Manifest.read(checkpoint_dir)
    blocks = {}
    if check_hashes:  # the blocks are only compared with the bytes when these are read
        blocks = read_blocks(manifest, lambda name: (checkpoint_dir / name).read_bytes(), location=str(checkpoint_dir))
    for entry in manifest.files:
        check_file(
            checkpoint_dir / entry.path,
            size_bytes=entry.size_bytes,
            digest=entry.hash if check_hashes else None,
            blocks=blocks.get(entry.path),
        )
    problem = first_problem(
        structure_problems(
            manifest,
            location=str(checkpoint_dir),
            manifest_path=str(checkpoint_dir / MANIFEST),
            dir_step=parse_step(checkpoint_dir.name),
            present=own_files(checkpoint_dir),
        ),
        str(checkpoint_dir),
    )
    if problem is not None:
        raise problem
    return manifest


def own_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Relative (posix) names of the regular files under a checkpoint directory."""
    root = Path(checkpoint_dir)
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


def verify(checkpoint_dir: str | os.PathLike) -> list[CheckpointCorruptError]:
    """Every problem of a checkpoint (manifest, each file's size and hash), not just the first."""
    checkpoint_dir = Path(checkpoint_dir)
    try:
        manifest = Manifest.read(checkpoint_dir)
    except CheckpointCorruptError as e:
        return [e]
    problems: list[CheckpointCorruptError] = []
    digests_problem = None
    try:
        blocks = read_blocks(manifest, lambda name: (checkpoint_dir / name).read_bytes(), location=str(checkpoint_dir))
    except CheckpointCorruptError as e:  # the files are still checked whole
        blocks, digests_problem = {f.path: b for f in manifest.files if (b := f.blocks()) is not None}, e
    for entry in manifest.files:
        try:
            check_file(
                checkpoint_dir / entry.path,
                size_bytes=entry.size_bytes,
                digest=entry.hash,
                blocks=blocks.get(entry.path),
            )
        except CheckpointCorruptError as e:
            problems.append(e)
    if digests_problem is not None and digests_problem.path not in {p.path for p in problems}:
        problems.insert(0, digests_problem)  # not already named by its size or hash
    return problems


def find_committed(root: str | os.PathLike) -> list[tuple[int, Path, Manifest | CheckpointCorruptError]]:
    """Every ``step-*`` directory, newest first, with its manifest or the reason it is invalid."""
    out: list[tuple[int, Path, Manifest | CheckpointCorruptError]] = []
    for step, path in reversed(checkpoint_dirs(root)):
        try:
            out.append((step, path, validate(path)))
        except CheckpointCorruptError as e:
            out.append((step, path, e))
    return out


def remove_leftovers(root: str | os.PathLike) -> list[str]:
    """Delete what a crash of distckpt can leave behind, and only what distckpt provably wrote.
    Rank 0, at start, while holding the root's lock.

    Removed: pending directories (``.pending-step-*``; ``.staging-step-*`` of earlier versions), deletions in progress
    (``.deleting-step-*``: retention renames a checkpoint so before deleting its files) and
    ``.latest.tmp-*`` files of an interrupted ``latest`` update. A ``step-*`` directory
    without a manifest is never removed or renamed here: one holding distckpt's files
    (:func:`is_damaged`) is the load's to judge (a corrupt checkpoint: set aside only with
    ``load.fallback_to_older``), any other is left alone (:func:`unmanaged_step_dirs`).

    Returns:
        Names removed.
    """
    removed: list[str] = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for entry in os.scandir(root):
        if entry.is_dir() and (is_pending(entry.name) or is_deleting(entry.name)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
        elif entry.is_file() and entry.name.startswith(f".{LATEST}.tmp-"):
            os.remove(entry.path)
            removed.append(entry.name)
    return removed


def _latest_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def is_damaged(checkpoint_dir: str | os.PathLike, latest: str | None) -> bool:
    """Whether a ``step-*`` directory is a distckpt checkpoint without its manifest
    (:data:`~distckpt._ondisk.layout.NO_MANIFEST`: uncommitted or damaged): no manifest, not a
    deferred deletion, and either the root's ``latest`` names it or it holds a
    file only distckpt writes (a ``.digests-rank-*.json`` digest file, an incremental
    ``__<rank>_items.json``). A plain DCP directory (``.metadata``, ``*.distcp``, a
    :mod:`distckpt.dcp` hash sidecar) is not: it is unmanaged. The one classification that load,
    ``distckpt ls`` and ``distckpt verify`` share (through :meth:`PosixStore.others`)."""
    path = Path(checkpoint_dir)
    if (path / MANIFEST).exists() or is_deferred(path) or not path.is_dir():
        return False
    if latest is not None and path.name == latest:
        return True
    return any(is_digests_name(n) or _ITEMS_RE.match(n) for n in os.listdir(path))


_ITEMS_RE = re.compile(r"^__\d+_items\.json$")


def damaged_step_dirs(root: str | os.PathLike) -> list[Path]:
    """``step-*`` directories that are distckpt checkpoints without a manifest (:func:`is_damaged`),
    oldest first: never loaded, deleted or overwritten (a save of that step fails while one is there)."""
    latest = _latest_name(Path(root))
    return [p for _, p in checkpoint_dirs(root) if is_damaged(p, latest)]


def unmanaged_step_dirs(root: str | os.PathLike) -> list[Path]:
    """``step-*`` directories without a manifest and without distckpt's own files, oldest first:
    not distckpt checkpoints (a plain ``dcp.save``, a copy). distckpt never loads, deletes or
    overwrites them. A deferred deletion (:func:`~distckpt._ondisk.layout.is_deferred`) and a
    damaged checkpoint (:func:`is_damaged`) are distckpt's own, not listed."""
    latest = _latest_name(Path(root))
    return [
        p
        for _, p in checkpoint_dirs(root)
        if not (p / MANIFEST).exists() and not is_deferred(p) and not is_damaged(p, latest)
    ]


def existing_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-*`` directory holding a manifest (committed, or
    damaged after its commit), oldest first: the checkpoints of whatever run wrote the root."""
    return [(s, p) for s, p in checkpoint_dirs(root) if (p / MANIFEST).exists()]


def repair_latest(root: str | os.PathLike) -> str | None:
    """Make ``latest`` name an existing checkpoint after some were set aside: if it names a
    missing directory, point it at the newest committed checkpoint, or remove it when there is
    none (it is distckpt's own hint; nothing is lost). Rank 0 holding the lock.

    Returns:
        The name ``latest`` now holds, or ``None`` when absent.
    """
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if name and ((root / name / MANIFEST).is_file() or is_damaged(root / name, name)):
        return name  # a checkpoint without its manifest keeps latest: the evidence it is distckpt's
    for _, path, result in find_committed(root):
        if isinstance(result, Manifest):
            write_atomic(root / LATEST, path.name + "\n")
            return path.name
    os.remove(root / LATEST)
    fsync_dir(root)
    return None


def set_aside(checkpoint_dir: str | os.PathLike, reason: str = "corrupt") -> Path:
    """Rename a checkpoint to ``<reason>-<name>-<n>`` in the same root (``n`` the first free
    number): kept, no longer a ``step-*`` directory (never loaded, never counted or deleted by
    retention, and its step can be saved again).

    Args:
        checkpoint_dir: the ``step-*`` directory.
        reason: ``corrupt``, ``rolledback`` or ``archived`` (see :data:`SET_ASIDE_REASONS`).

    Returns:
        The new path.

    Raises:
        ValueError: an unknown reason.
        OSError: the rename failed (permissions, another file system).
    """
    if reason not in SET_ASIDE_REASONS:
        raise ValueError(f"reason={reason!r}: expected one of {SET_ASIDE_REASONS}")
    src = Path(checkpoint_dir)
    n = 0
    while (dst := src.with_name(f"{reason}-{src.name}-{n}")).exists():
        n += 1
    os.rename(src, dst)
    fsync_dir(src.parent)
    return dst


def delete_checkpoint(checkpoint_dir: str | os.PathLike, remove: Callable[[Path], None] | None = None) -> None:
    """Delete a committed checkpoint: first rename it to ``.deleting-<name>-<id>`` (durable),
    so a crash mid-delete leaves a directory that is provably distckpt's deletion (removed at
    the next start) and never a ``step-*`` directory that lacks files.

    Args:
        remove: called with the renamed directory to remove its files (e.g.
            :meth:`distckpt._save.purge.Purger.submit`, in the background); ``None``: removed here,
            ignoring errors.

    Raises:
        OSError: the rename failed (the checkpoint is then untouched).
    """
    src = Path(checkpoint_dir)
    doomed = src.with_name(deleting_name(src.name, uuid.uuid4().hex[:8]))
    try:
        os.rename(src, doomed)
    except FileNotFoundError:
        return
    fsync_dir(src.parent)
    if remove is not None:
        remove(doomed)
    else:
        shutil.rmtree(doomed, ignore_errors=True)
