"""Names on disk (docs/design.md, section 3): ``step-%09d``, ``.pending-step-%09d-<id>``,
``.deleting-step-%09d-<id>``, ``latest``, and set-aside checkpoints ``<reason>-step-%09d-<n>``."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .._errors import ConfigError

__all__ = [
    "LATEST",
    "MANIFEST",
    "checkpoint_name",
    "pending_name",
    "parse_step",
    "location_step",
    "is_pending",
    "deleting_name",
    "is_deleting",
    "SET_ASIDE_REASONS",
    "parse_set_aside",
    "DEFERRED_MANIFEST",
    "is_deferred",
    "check_root_scheme",
    "refuse_output_in_checkpoint",
    "refuse_url_output",
]

LATEST = "latest"
MANIFEST = "distckpt.json"
DEFERRED_MANIFEST = "distckpt.deferred.json"
"""A retired checkpoint's manifest while incremental checkpoints still refer to its files
(``distckpt._storage.incremental``): no longer committed, deleted once nobody refers to it."""
# The one rule for a ``step-N`` directory without a manifest that holds distckpt's own files
# (docs/format.md, "Layout"): load, ``distckpt ls`` and ``distckpt verify`` say it in these words.
NO_MANIFEST = "no manifest (uncommitted or damaged)"


def no_manifest_reason(location: str) -> str:
    """Why the ``step-N`` directory ``location`` (distckpt's files, no manifest) is never loaded,
    and what to do: the words load, ``ls`` and ``verify`` all use. On S3 ``location`` is the data
    prefix ``<root>/data/step-N-<id>`` of the step ``latest`` names, whose manifest
    ``<root>/manifests/step-N.json`` is missing."""
    step = location_step(location)
    manifest, where = MANIFEST, "the directory"
    if "://" in location:
        manifest, where = f"manifests/{checkpoint_name(step or 0)}.json", "its objects"
    return (
        f"{location}: {NO_MANIFEST}: distckpt's own files but no {manifest} (its manifest was "
        f"deleted, or it never committed); never loaded, never deleted. Restore {manifest} from a copy, "
        f"or move {where} out of the root; load.fallback_to_older sets the newest one aside "
        "(corrupt-step-N-<n>) and loads the previous committed checkpoint"
    )


def location_step(location: str) -> int | None:
    """Step of a checkpoint location: a ``step-N`` directory, or an S3 data prefix ``.../step-N-<id>``."""
    m = re.match(r"^step-(\d{9,})(?:-[0-9a-f]+)?$", location.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


_STEP_RE = re.compile(r"^step-(\d{9,})$")
# ``.staging-`` is the name earlier versions gave the same directory: still distckpt's own.
_PENDING_RE = re.compile(r"^\.(?:pending|staging)-step-(\d{9,})-([0-9a-f]+)$")
_DELETING_RE = re.compile(r"^\.deleting-step-(\d{9,})-([0-9a-f]+)$")
SET_ASIDE_REASONS = ("corrupt", "rolledback", "archived")
"""Why a checkpoint was renamed out of the way (never deleted): damaged, newer than a rollback's
``load.path``, or moved aside for a fresh run (``load.on_existing: archive``)."""
_SET_ASIDE_RE = re.compile(rf"^({'|'.join(SET_ASIDE_REASONS)})-step-(\d{{9,}})-(\d+)$")


def checkpoint_name(step: int) -> str:
    """Directory name of the committed checkpoint of global ``step`` (zero-padded to 9)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:09d}"


def pending_name(step: int, save_id: str) -> str:
    """Directory name a save of ``step`` writes into before its commit."""
    return f".pending-{checkpoint_name(step)}-{save_id}"


def parse_step(name: str) -> int | None:
    """Step of a committed-checkpoint directory name, or ``None`` for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_pending(name: str) -> bool:
    """Whether ``name`` is a pending directory: a save in progress, never loadable."""
    return _PENDING_RE.match(name) is not None


def deleting_name(step_dir_name: str, delete_id: str) -> str:
    """Name a checkpoint directory is renamed to before retention deletes its files: a crash
    mid-delete leaves a directory that is provably distckpt's (removed at the next start)."""
    return f".deleting-{step_dir_name}-{delete_id}"


def is_deleting(name: str) -> bool:
    """Whether ``name`` is a checkpoint whose deletion by distckpt was in progress."""
    return _DELETING_RE.match(name) is not None


def parse_set_aside(name: str) -> tuple[str, int] | None:
    """``(reason, step)`` of a set-aside checkpoint name (``rolledback-step-000000040-0``)."""
    m = _SET_ASIDE_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def checkpoint_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-*`` directory under ``root``, oldest first.

    Listing says nothing about validity: see :func:`distckpt._storage.commit.validate`.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        step = parse_step(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, Path(entry.path)))
    return sorted(found)


def is_deferred(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether a ``step-*`` directory is a retired checkpoint whose deletion waits until no
    kept (incremental) checkpoint refers to its files: never loaded, deleted by distckpt later."""
    path = Path(checkpoint_dir)
    return (path / DEFERRED_MANIFEST).exists() and not (path / MANIFEST).exists()


_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def check_root_scheme(root: str, what: str = "root") -> None:
    """Refuse a root that looks like a URL of a scheme distckpt does not support (``gs://``,
    ``S3://``, ``s3a://``, ``s3:/``): it would otherwise be taken as a local relative directory.

    Args:
        root: the root as given.
        what: the name of the setting, for the message.

    Raises:
        ConfigError: names the supported schemes (``s3://``, ``file://``, or a plain path).
    """
    if not _URL_RE.match(root) or root.startswith(("s3://", "file://")):
        return
    scheme = root.split(":", 1)[0]
    hint = f" Did you mean s3://{root.split(':', 1)[1].lstrip('/')}?" if scheme.lower() in ("s3", "s3a", "s3n") else ""
    raise ConfigError(
        f"{what}={root!r}: unsupported URL scheme {scheme + ':'!r}; supported roots are "
        f"s3://bucket/prefix, file:///path or a plain directory path.{hint}"
    )


def refuse_output_in_checkpoint(out: str | os.PathLike, what: str = "output") -> None:
    """Refuse to write ``out`` (a file or directory) inside a checkpoint: a directory holding a
    distckpt manifest (committed or deferred), checked for ``out`` and each of its parents --
    written files would make the checkpoint fail verification, or overwrite its data.

    Raises:
        ConfigError: names the checkpoint; write elsewhere.
    """
    path = Path(out).resolve()
    for d in (path, *path.parents):
        if (d / MANIFEST).is_file() or (d / DEFERRED_MANIFEST).is_file():
            raise ConfigError(
                f"{what} {str(out)!r} is inside the checkpoint {d}: distckpt never writes into a "
                "checkpoint (it would damage it); choose a path outside it"
            )


def refuse_url_output(out: str | os.PathLike, what: str = "output") -> None:
    """Refuse an output that is a URL (``s3://``, ``gs://``, any ``scheme://``; also ``s3:/``, the
    form ``pathlib`` collapses it to): ``export`` and ``release`` write local files only, and a
    URL taken as a path would become a local directory named after the scheme.

    Raises:
        ConfigError: names the output; write to a local path, then upload.
    """
    text = os.fspath(out)
    if _URL_RE.match(text):
        raise ConfigError(
            f"{what} {text!r} is a URL: export and release write local files only (S3 and "
            "other object-storage outputs are not supported). Write to a local path, then upload "
            "it (e.g. `aws s3 cp --recursive DIR s3://bucket/prefix/`)"
        )
