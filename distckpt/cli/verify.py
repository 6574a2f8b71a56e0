"""``distckpt verify ROOT|CKPT``: read every byte and check it against the manifest.

Exit 0 when every checkpoint is intact, 1 when any problem is found (each bad file is named on
its own line), 2 when there is nothing to verify.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..ondisk.layout import MANIFEST, checkpoint_dirs, is_deferred, is_pending, parse_step
from ..storage import is_s3_url, open_store, split_location
from ..tools.audit import AuditReport, audit_checkpoint, audit_store_checkpoint
from ._common import fmt_bytes, print_json
from ._errors import EXIT_FAILED, EXIT_OK

NAME = "verify"
HELP = "check every file's size and xxh3-128 hash against its manifest (exit 1 naming each bad file)"
EPILOG = """examples:
  distckpt verify runs/demo/ckpt                       (every step-* checkpoint of a root)
  distckpt verify runs/demo/ckpt/step-000000020 --json
  distckpt verify s3://bucket/run1                     (every committed checkpoint of an S3 root)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a checkpoint root or one checkpoint directory")


def targets(path: Path) -> tuple[list[Path], list[str]]:
    """Checkpoint directories to verify and pending directories skipped.

    Raises:
        CheckpointNotFoundError: nothing that looks like a checkpoint at ``path``.
    """
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: not a directory (expected a checkpoint or a root)")
    if (path / MANIFEST).exists() or (path / ".metadata").exists() or parse_step(path.name) is not None:
        return [path], []
    found = [p for _, p in checkpoint_dirs(path) if not is_deferred(p)]  # deferred: checked through referrers
    pending = sorted(p.name for p in path.iterdir() if is_pending(p.name))
    if not found:
        raise CheckpointNotFoundError(f"{path}: not a checkpoint and holds no step-* checkpoint to verify")
    return found, pending


def s3_targets(url: str) -> tuple[Any, list[tuple[str, Any]], list[str]]:
    """``(store, [(checkpoint location, discovery's result)], unreferenced data prefixes)`` of an
    ``s3://`` root or checkpoint. A manifest that does not parse is its own location (a URL
    under ``manifests/``) with its error as the result.

    Raises:
        CheckpointNotFoundError: no checkpoint there.
    """
    root, location = split_location(url)
    store: Any = open_store(root)  # an S3Store (unreferenced() is S3's)
    if location is not None:
        return store, [(location, None)], []
    found = [(loc, result) for _, loc, result in reversed(store.find_committed())]
    if not found:
        raise CheckpointNotFoundError(f"{root}: holds no committed checkpoint to verify")
    return store, found, store.unreferenced()


def run(args: argparse.Namespace) -> int:
    if is_s3_url(args.path):
        store, entries, pending = s3_targets(args.path)
        reports = [AuditReport(path=loc, manifest=None, problems=[result])  # the manifest did not parse
                   if isinstance(result, CheckpointCorruptError) and result.path == loc
                   else audit_store_checkpoint(store, loc) for loc, result in entries]
    else:
        found, pending = targets(Path(args.path))
        reports = [audit_checkpoint(p) for p in found]
    bad = [r for r in reports if not r.ok]
    if args.json:
        print_json({"ok": not bad, "skipped_pending": pending, "checkpoints": [
            {"path": str(r.path), "ok": r.ok, "unhashed": r.unhashed,
             "problems": [{"path": e.path, "message": str(e)} for e in r.problems]} for r in reports]})
        return EXIT_FAILED if bad else EXIT_OK
    for r in reports:
        if r.ok:
            assert r.manifest is not None  # an unreadable manifest is one of the problems
            files = r.manifest.files
            note = f", {len(r.unhashed)} without a hash (size checked only)" if r.unhashed else ""
            print(f"ok       {r.path}  ({len(files)} files, {fmt_bytes(sum(f.size_bytes for f in files))}{note})")
        else:
            print(f"CORRUPT  {r.path}  ({len(r.problems)} problem{'s' if len(r.problems) > 1 else ''})")
            for e in r.problems:
                print(f"  {e}")
    for name in pending:
        print(f"skipped  {args.path.rstrip('/')}/{name}  (pending: an unfinished save)")
    if bad:
        print(f"{len(bad)} of {len(reports)} checkpoint(s) corrupt")
    return EXIT_FAILED if bad else EXIT_OK
