"""``distckpt prune ROOT --keep-last K``: delete older committed checkpoints.

Uses the same retention rule as the manager (the newest committed checkpoint is never deleted)
and deletes each manifest first. Before deleting anything it reads every byte of the
checkpoints it would keep (sizes, hashes, safe ``.metadata`` read, as ``verify`` does): a kept
checkpoint that fails counts as corrupt, so the K kept ones are K that load, and a bit flip
in the newest never costs the older good ones. Corrupt and pending directories are never
touched. A checkpoint that a kept incremental checkpoint refers to is deferred (its manifest
renamed, the files referred to kept) and deleted by a later prune or retention once nobody
refers to it. Holds the root's write lock, so it refuses while a training job writes the root.
"""

from __future__ import annotations

import argparse

from .._ondisk.layout import checkpoint_name
from .._ondisk.manifest import Manifest
from .._save.retention import steps_to_delete
from .._storage import find_committed, open_store
from .._storage.lock import RootLock
from .._tools.audit import audit_checkpoint
from .._tools.store_queries import tool_store
from ._common import print_json

NAME = "prune"
HELP = "delete all but the newest K committed checkpoints (never the newest; --dry-run to preview)"
EPILOG = """examples:
  distckpt prune runs/demo/ckpt --keep-last 2 --dry-run
  distckpt prune runs/demo/ckpt --keep-last 3 --keep-every 1000
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt prune``."""
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--keep-last", type=int, required=True, metavar="K", help="committed checkpoints to keep (>= 1)")
    p.add_argument("--keep-every", type=int, metavar="N", help="also keep steps that are multiples of N")
    p.add_argument("--dry-run", action="store_true", help="only show what would be deleted")


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt prune``; returns the exit code (0 ok, ``--dry-run`` too).

    Raises:
        ValueError: ``--keep-last`` or ``--keep-every`` is below 1.
        CheckpointLockedError: another job holds the root's write lock (not with ``--dry-run``).
    """
    if args.keep_last < 1:
        raise ValueError(f"--keep-last {args.keep_last}: must be >= 1 (the newest checkpoint is always kept)")
    if args.keep_every is not None and args.keep_every < 1:
        raise ValueError(f"--keep-every {args.keep_every}: must be >= 1")
    store = tool_store(open_store(args.root))
    store.check_tool_root()
    lock = None
    if not args.dry_run:
        lock = RootLock.of(store)
        lock.acquire()
    try:
        found = find_committed(store)  # those with a manifest: never a deferred deletion
        committed = sorted(s for s, _, r in found if isinstance(r, Manifest))
        corrupt = [checkpoint_name(s) for s, _, r in found if not isinstance(r, Manifest)]
        others = store.others()
        corrupt = sorted(corrupt + [loc.rstrip("/").rsplit("/", 1)[-1] for loc in others.unmanaged + others.damaged])
        where = {s: loc for s, loc, _ in found}
        good = 0
        for step in sorted(committed, reverse=True):  # verify newest first until K load
            if good == args.keep_last:
                break
            if audit_checkpoint(where[step], store=store).ok:
                good += 1
            else:
                committed.remove(step)
                corrupt.append(checkpoint_name(step))
        doomed = steps_to_delete(committed, keep_last=args.keep_last, keep_every_steps=args.keep_every)
        deferred = store.deferred_by(doomed)  # a checkpoint a kept incremental one refers to is deferred
        if not args.dry_run:
            store.delete_checkpoints(doomed)
    finally:
        if lock is not None:
            lock.release()
    return report(args, store.root, committed, doomed, sorted(corrupt), deferred, where)


def report(
    args: argparse.Namespace,
    root: str,
    committed: list[int],
    doomed: list[int],
    corrupt: list[str],
    deferred: list[str] | None = None,
    where: dict[int, str] | None = None,
) -> int:
    """Print what :func:`run` deleted (or, ``--dry-run``, would delete), kept and left untouched, as
    JSON with ``--json``; returns 0.

    Args:
        args: the parsed command line.
        root: the root (messages).
        committed: steps of the committed checkpoints that load.
        doomed: steps deleted (or deferred).
        corrupt: names of the checkpoints left untouched as corrupt.
        deferred: names among ``doomed`` deferred because a kept incremental checkpoint refers to them.
        where: ``{step: location}``, to name each deleted checkpoint (default: ``root/step-N``).
    """
    deferred = deferred or []
    kept = [s for s in committed if s not in doomed]
    if args.json:
        print_json(
            {
                "root": str(root),
                "dry_run": args.dry_run,
                "deleted": [checkpoint_name(s) for s in doomed],
                "kept": [checkpoint_name(s) for s in kept],
                "corrupt_untouched": corrupt,
                "deferred": deferred,
            }
        )
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for s in doomed:
        note = "  (deferred: a kept incremental checkpoint refers to it)" if checkpoint_name(s) in deferred else ""
        print(f"{verb}  {(where or {}).get(s, f'{root}/{checkpoint_name(s)}')}{note}")
    print(
        f"{verb} {len(doomed)}, kept {len(kept)} committed checkpoint(s)"
        + (f"; {len(corrupt)} corrupt left untouched: {', '.join(corrupt)}" if corrupt else "")
    )
    return 0
