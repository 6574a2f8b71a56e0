"""``distckpt verify ROOT|CKPT``: read every byte and check it against the manifest.

A local plain DCP directory written by :class:`distckpt.dcp.FileSystemWriter` (no manifest, a
``.metadata.xxh3.json`` hash sidecar) is checked against that sidecar instead.

A ``step-N`` directory without a manifest is one of the two kinds of docs/format.md "Layout":
distckpt's own (``no manifest (uncommitted or damaged)``: a problem, exit 1) or a stock
``dcp.save`` without a sidecar (``unmanaged``, as ``ls`` says: nothing to check it against, so it is
listed, not verified, and does not change the exit code; ``distckpt import`` makes it a checkpoint).

Exit 0 when every checkpoint is intact, 1 when any problem is found (each bad file is named on
its own line), 2 when there is nothing to verify (an unmanaged plain DCP directory given alone, or
a root holding only those: the message suggests ``distckpt import``).
"""

from __future__ import annotations

import argparse

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from .._ondisk.layout import MANIFEST, is_deleting, location_step, no_manifest_reason
from .._storage import CheckpointStore, find_committed, open_location
from .._tools.audit import AuditReport, audit_checkpoint, audit_plain_dcp
from .._tools.store_queries import tool_store
from ._common import fmt_bytes, print_json
from ._errors import EXIT_FAILED, EXIT_OK

NAME = "verify"
HELP = (
    "check every file's size and xxh3-128 hash against its manifest (exit 1 naming each bad file; "
    "exit 2 when there is nothing to verify, e.g. only an unmanaged plain DCP directory)"
)
EPILOG = """examples:
  distckpt verify runs/demo/ckpt                       (every step-* checkpoint of a root)
  distckpt verify runs/demo/ckpt/step-000000020 --json
  distckpt verify s3://bucket/run1                     (every committed checkpoint of an S3 root)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt verify``."""
    p.add_argument("path", help="a checkpoint root or one checkpoint directory")


def targets(
    path: str,
) -> tuple[CheckpointStore, list[tuple[str, CheckpointCorruptError | None]], list[str], list[str]]:
    """``(store, [(checkpoint location, why it is not committed or None)], pending saves skipped,
    unmanaged plain DCP directories listed but not verified)`` of a root or of one checkpoint. A
    manifest that does not parse on object storage is its own location (a URL under ``manifests/``)
    with its error.

    Raises:
        CheckpointNotFoundError: nothing to verify at ``path``: no checkpoint, or only unmanaged
            plain DCP directories (no manifest, none of distckpt's files, no hash sidecar).
    """
    store, location = open_location(path)
    if location is not None:
        others = store.others()
        if location in others.damaged:
            return store, [(location, _damaged(location))], [], []
        if location in others.unmanaged or (store.is_plain_dcp(location) and audit_plain_dcp(location) is None):
            raise CheckpointNotFoundError(_unmanaged(location) + ": nothing to verify it against")
        return store, [(location, None)], [], []
    tools = tool_store(store)
    tools.check_tool_root()
    # Those with a manifest and the step-N directories without one (deferred deletions: checked
    # through their referrers), oldest first; unmanaged ones with a hash sidecar are checked against it.
    listed = [(s, loc, r if isinstance(r, CheckpointCorruptError) else None) for s, loc, r in find_committed(store)]
    others = store.others()
    unmanaged = [loc for loc in others.unmanaged if audit_plain_dcp(loc) is None]
    listed += [(_step(loc), loc, None) for loc in others.unmanaged if loc not in unmanaged]
    listed += [(_step(loc), loc, _damaged(loc)) for loc in others.damaged]
    found = [(loc, why) for _, loc, why in sorted(listed, key=lambda e: e[0])]
    if not found:
        if unmanaged:
            raise CheckpointNotFoundError(
                f"{store.root} holds no distckpt checkpoint to verify, only unmanaged plain DCP directories: "
                + "; ".join(_unmanaged(loc) for loc in unmanaged)
            )
        raise CheckpointNotFoundError(f"{store.root}: not a checkpoint and holds no committed checkpoint to verify")
    return store, found, [n for n in tools.leftovers() if not is_deleting(n.rsplit("/", 1)[-1])], unmanaged


def _step(location: str) -> int:
    return location_step(location) or 0


def _unmanaged(location: str) -> str:
    """What a plain DCP directory without a manifest or hash sidecar is (the words of ``ls``)."""
    return (
        f"{location}: unmanaged: a plain DCP checkpoint (no {MANIFEST}, not written by distckpt, no hash "
        f"sidecar); `distckpt import {location} NEW_ROOT` makes it a distckpt checkpoint"
    )


def _damaged(location: str) -> CheckpointCorruptError:
    """The problem of a checkpoint without its manifest (the words load and ``ls`` use)."""
    return CheckpointCorruptError(no_manifest_reason(location), path=location)


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt verify``; returns the exit code (0 every checkpoint intact, 1 a problem found).

    Raises:
        CheckpointNotFoundError: nothing to verify at ``path`` (exit 2).
    """
    store, entries, pending, unmanaged = targets(args.path)
    reports = [
        AuditReport(path=loc, manifest=None, problems=[result])  # the manifest did not parse
        if result is not None and (not store.exists(loc) or result.path == loc)
        else audit_plain_dcp(loc) or audit_checkpoint(loc, store=store)
        for loc, result in entries
    ]
    bad = [r for r in reports if not r.ok]
    if args.json:
        print_json(
            {
                "ok": not bad,
                "skipped_pending": pending,
                "unmanaged": unmanaged,
                "checkpoints": [
                    {
                        "path": str(r.path),
                        "ok": r.ok,
                        "unhashed": r.unhashed,
                        "kind": "checkpoint" if r.sidecar is None else "plain DCP with hash sidecar",
                        "problems": [{"path": e.path, "message": str(e)} for e in r.problems],
                    }
                    for r in reports
                ],
            }
        )
        return EXIT_FAILED if bad else EXIT_OK
    for r in reports:
        if r.sidecar is not None:
            what = f"plain DCP checkpoint with a hash sidecar, {len(r.sidecar)} files"
            if r.ok:
                print(f"ok       {r.path}  ({what}, {fmt_bytes(sum(r.sidecar.values()))})")
            else:
                print(f"CORRUPT  {r.path}  ({what}; {len(r.problems)} problem{'s' if len(r.problems) > 1 else ''})")
                for e in r.problems:
                    print(f"  {e}")
        elif r.ok:
            assert r.manifest is not None  # an unreadable manifest is one of the problems
            files = r.manifest.files
            note = f", {len(r.unhashed)} without a hash (size checked only)" if r.unhashed else ""
            print(f"ok       {r.path}  ({len(files)} files, {fmt_bytes(sum(f.size_bytes for f in files))}{note})")
        else:
            print(f"CORRUPT  {r.path}  ({len(r.problems)} problem{'s' if len(r.problems) > 1 else ''})")
            for e in r.problems:
                print(f"  {e}")
    for name in pending:
        print(f"skipped  {store.root}/{name}  (pending: an unfinished save)")
    for loc in unmanaged:
        print(f"skipped  {_unmanaged(loc)}")
    if bad:
        print(f"{len(bad)} of {len(reports)} checkpoint(s) corrupt")
    return EXIT_FAILED if bad else EXIT_OK
