"""Incremental checkpoints: which previous checkpoint a save reuses, the references a commit
records, and deletions that never remove a file a kept checkpoint refers to.

A save with ``save.incremental: true`` compares every tensor item with the newest committed
checkpoint before it (:func:`reuse_for`); unchanged items are not written, and the new
checkpoint's DCP ``.metadata`` points at the file that first stored them through
``../step-N/<file>`` (the write side: :mod:`distckpt._engine.incremental_writer`). Rank 0 lists
those files in the new manifest, with the size and hash the owning checkpoint recorded
(:func:`reference_entries`), so ``validate``, ``verify``, the loaders and ``export`` check them
like the checkpoint's own files, and retention finds references by reading manifests only.

Deleting a checkpoint that a kept checkpoint refers to is deferred (:class:`References`): its
manifest is renamed ``distckpt.deferred.json`` (it is no longer a committed checkpoint: never
loaded, counted or offered for resume; its name stays, so references still resolve) and its
files nobody refers to are removed; the directory goes once no checkpoint refers to it.
Local (POSIX) roots only: references are relative file-system paths.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

from .._engine import read_dcp_metadata
from .._engine.incremental_writer import ReuseIndex, read_item_records
from .._errors import CheckpointCorruptError
from .._ondisk.digests import holds_blocks, is_digests_name
from .._ondisk.layout import DEFERRED_MANIFEST, MANIFEST, checkpoint_dirs, checkpoint_name, is_deferred
from .._ondisk.manifest import FileEntry, Manifest
from .commit import delete_checkpoint, validate
from .localfs import fsync_dir

__all__ = ["reuse_for", "reference_entries", "referenced_files", "References", "delete_or_defer"]

logger = logging.getLogger(__name__)


def reuse_for(root: str | os.PathLike, step: int, *, full_every: int | None) -> ReuseIndex:
    """What an incremental save of ``step`` may reuse: the item records of the newest committed
    checkpoint older than ``step``. Every rank calls it (each reads every rank's records: a
    replicated item may have been written by another rank). Never raises: an unreadable or
    non-incremental previous checkpoint makes this a full save (logged).

    Args:
        full_every: this save is full when the previous one was the ``full_every - 1``-th
            save after a full one (``None``: only when there is nothing to reuse).
    """
    full = ReuseIndex(base=None, records={}, since_full=0)
    for s, path in reversed(checkpoint_dirs(root)):
        if s >= step or not (path / MANIFEST).exists():
            continue
        try:
            validate(path)
            found = read_item_records(path)
        except (CheckpointCorruptError, OSError, ValueError, KeyError, TypeError) as e:
            logger.warning(
                "incremental save of step %d: %s is not usable as its base (%s); writing every tensor", step, path, e
            )
            return full
        if found is None:
            return full  # not written incrementally: nothing recorded to compare with
        records, since_full = found
        if full_every is not None and since_full + 1 >= full_every:
            return full
        return ReuseIndex(base=path.name, records=records, since_full=since_full + 1)
    return full


def _owner_manifest(owner_dir: Path) -> Manifest:
    for name in (MANIFEST, DEFERRED_MANIFEST):
        path = owner_dir / name
        if path.exists():
            return Manifest.from_dict(json.loads(path.read_text(encoding="utf-8")), path=str(path))
    raise CheckpointCorruptError(f"{owner_dir}: referenced checkpoint has no manifest", path=str(owner_dir))


def reference_entries(checkpoint_dir: str | os.PathLike) -> list[FileEntry]:
    """Manifest entries of the other checkpoints' files that ``checkpoint_dir``'s ``.metadata``
    refers to (``../step-N/<file>``), with the size and hash their owner recorded. Rank 0,
    before the commit.

    Raises:
        CheckpointCorruptError: a referenced file is missing, has another size than its owner
            recorded, or its owner lists no such file (the save then fails; nothing is lost).
    """
    checkpoint_dir = Path(checkpoint_dir)
    metadata = read_dcp_metadata(checkpoint_dir)
    refs = sorted(
        {info.relative_path for info in (metadata.storage_data or {}).values() if info.relative_path.startswith("../")}
    )
    owners: dict[str, dict[str, FileEntry]] = {}
    entries = []
    for rel in refs:
        _, owner, name = rel.split("/", 2)
        if owner not in owners:
            owners[owner] = {f.path: f for f in _owner_manifest(checkpoint_dir.parent / owner).files}
        entry = owners[owner].get(name)
        path = checkpoint_dir / rel
        if entry is None or not path.is_file() or path.stat().st_size != entry.size_bytes:
            raise CheckpointCorruptError(
                f"{checkpoint_dir.parent / owner / name}: file of {owner} that the new checkpoint refers to is "
                "missing, or differs from what its manifest records",
                path=str(path),
            )
        entries.append(
            FileEntry(
                path=rel,
                size_bytes=entry.size_bytes,
                hash=entry.hash,
                block_ends=entry.block_ends,
                block_hashes=entry.block_hashes,
            )
        )
    for owner, files in owners.items():  # the owners' digest files hold the referenced files' blocks
        entries += [
            FileEntry(path=f"../{owner}/{f.path}", size_bytes=f.size_bytes, hash=f.hash)
            for f in files.values()
            if is_digests_name(f.path) and not f.path.startswith("../") and holds_blocks(f.path, f.size_bytes, f.hash)
        ]
    return entries


def referenced_files(manifest: Manifest) -> dict[str, set[str]]:
    """``{checkpoint name: {file names}}`` of the other checkpoints' files ``manifest`` lists."""
    out: dict[str, set[str]] = {}
    for f in manifest.files:
        if f.path.startswith("../"):
            _, owner, name = f.path.split("/", 2)
            out.setdefault(owner, set()).add(name)
    return out


# {manifest path: ((inode, mtime), what it refers to)}: retention reads each manifest once, not at every save.
_REFS_SEEN: dict[str, tuple[tuple[int, int], dict[str, set[str]]]] = {}


class References:
    """Who refers to whom in one root, from every directory's manifest (committed
    and set-aside checkpoints alike); deletes checkpoints nobody refers to, defers the others.
    Rank 0 (or ``distckpt prune``), holding the root's lock.

    Args:
        root: the checkpoint root.
        remove: removes a deleted checkpoint's renamed ``.deleting-*`` directory (see
            :func:`~distckpt._storage.commit.delete_checkpoint`); ``None``: at once, on this thread.
    """

    def __init__(self, root: str | os.PathLike, remove: Callable[[Path], None] | None = None) -> None:
        self.root = Path(root)
        self._remove = remove
        self._refs: dict[str, dict[str, set[str]]] = {}  # referrer -> owner -> files
        seen: dict[str, tuple[tuple[int, int], dict[str, set[str]]]] = {}
        for entry in os.scandir(self.root):
            try:
                st = os.stat(os.path.join(entry.path, MANIFEST)) if entry.is_dir() else None
            except FileNotFoundError:
                continue
            if st is None:
                continue
            key, path = (st.st_ino, st.st_mtime_ns), os.path.join(entry.path, MANIFEST)
            cached = _REFS_SEEN.get(path)
            if cached is not None and cached[0] == key:  # a manifest is replaced, never edited in place
                refs = cached[1]
            else:
                try:
                    refs = referenced_files(Manifest.read(entry.path))
                except CheckpointCorruptError:
                    continue  # an unreadable manifest refers to nothing loadable
            seen[path] = (key, refs)
            self._refs[entry.name] = refs
        _REFS_SEEN.update(seen)
        for gone in set(_REFS_SEEN) - set(seen):
            if os.path.dirname(os.path.dirname(gone)) == str(self.root):
                del _REFS_SEEN[gone]

    def referenced(self, name: str) -> set[str]:
        """Files of checkpoint ``name`` that some kept checkpoint refers to."""
        return {f for refs in self._refs.values() for f in refs.get(name, ())}

    def forget(self, name: str) -> None:
        """Stop counting the references of checkpoint ``name`` (it is being deleted)."""
        self._refs.pop(name, None)

    def retire(self, checkpoint_dir: str | os.PathLike) -> str:
        """Delete a committed checkpoint (as :func:`~distckpt._storage.commit.delete_checkpoint`), or
        defer it while another kept checkpoint refers to its files.

        Returns:
            ``"deleted"`` or ``"deferred"``.

        Raises:
            OSError: a rename failed (the checkpoint is then still committed and whole).
        """
        path = Path(checkpoint_dir)
        self.forget(path.name)
        if not self.referenced(path.name):
            delete_checkpoint(path, self._remove)
            return "deleted"
        os.replace(path / MANIFEST, path / DEFERRED_MANIFEST)  # no longer a committed checkpoint
        fsync_dir(path)
        self._trim(path)
        return "deferred"

    def collect(self) -> list[str]:
        """Delete deferred checkpoints nobody refers to any more; trim the files of the others.

        Returns:
            Names of the directories deleted.
        """
        deleted = []
        for _, path in checkpoint_dirs(self.root):
            if not is_deferred(path):
                continue
            if self.referenced(path.name):
                self._trim(path)
            else:
                delete_checkpoint(path, self._remove)
                deleted.append(path.name)
        return deleted

    def _trim(self, path: Path) -> None:
        """Remove a deferred checkpoint's files that no kept checkpoint refers to."""
        keep = self.referenced(path.name) | {DEFERRED_MANIFEST}
        for p in path.iterdir():
            if p.is_file() and p.name not in keep:
                p.unlink()


def delete_or_defer(
    root: str | os.PathLike,
    steps: list[int],
    *,
    before: Callable[[int], None] | None = None,
    remove: Callable[[Path], None] | None = None,
) -> list[str]:
    """Retention on a POSIX root: delete each checkpoint of ``steps`` (oldest first), or defer
    it while a kept checkpoint refers to its files; then delete the deferred ones nobody refers
    to any more. Rank 0, holding the root's lock.

    Args:
        before: called with each step before it is deleted (the transaction's phase hook).
        remove: as :class:`References`.

    Returns:
        One line per action, for the log.

    Raises:
        OSError: a rename failed (that checkpoint is then still committed and whole).
    """
    if not steps:  # nothing deleted: no reference changed since the last retention
        return []
    refs = References(root, remove=remove)
    done = []
    for step in steps:
        if before is not None:
            before(step)
        path = Path(root) / checkpoint_name(step)
        done.append(f"{refs.retire(path)} {path}")
    done += [f"deleted {Path(root) / name} (no kept checkpoint refers to it any more)" for name in refs.collect()]
    return done
