"""``distckpt memory ls|clean DIR``: the memory tier's snapshots left in a node's memory directory,
listed, and removed where no job will (a node that never came back to its job; docs/memory.md,
"Cleanup")."""

from __future__ import annotations

import argparse
import os
import time

from .._memory.cleanup import JobMemory, clean, scan
from ._common import add_common, fmt_bytes, fmt_time, print_json, print_table

NAME = "memory"
HELP = "list (ls) or remove (clean) the memory tier's snapshots in a node's memory directory"
EPILOG = """DIR is the job's memory.dir on this node (default /dev/shm/distckpt); with {node} in it
(quote it), every node directory this machine reaches. Each job is a directory job-<16 hex> (a
hash of its checkpoint root). `clean` deletes only distckpt's own snapshot and slot files in them,
then the directory when nothing else is left. It keeps a job whose files a process on this machine
holds open (a live job holds every slot open) or that changed in the last --older-than seconds (a
job between a crash and its restart, whose next run restores from these files); --force removes
them anyway.

examples:
  distckpt memory ls /dev/shm/distckpt
  distckpt memory clean /dev/shm/distckpt --older-than 600
  distckpt memory clean '/dev/shm/distckpt/{node}' --job job-0123456789abcdef --force
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt memory``: ``ls DIR`` and ``clean DIR [options]``."""
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("ls", help="jobs, nodes, steps, ranks and bytes held in DIR")
    clean_p = sub.add_parser("clean", help="remove the snapshots of jobs that are no longer running")
    for q in (ls, clean_p):
        q.add_argument("dir", metavar="DIR", help="the memory directory (memory.dir; {node}: every node's)")
        add_common(q)
    clean_p.add_argument(
        "--older-than",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="only jobs whose directory has not changed for this long (default: 3600)",
    )
    clean_p.add_argument("--job", help="only this job (job-<16 hex>, as `ls` shows it)")
    clean_p.add_argument("--force", action="store_true", help="also jobs in use or recently changed")
    clean_p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def _row(j: JobMemory, now: float) -> list[object]:
    steps = f"{j.steps[0]}..{j.steps[-1]}" if len(j.steps) > 1 else (str(j.steps[0]) if j.steps else None)
    state = f"in use (pid {','.join(map(str, j.pids))})" if j.pids else f"idle {now - j.changed:.0f} s"
    return [os.path.basename(j.path), j.node, steps, len(j.ranks), j.files, fmt_bytes(j.bytes), state]


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt memory``; returns the exit code (0 ok)."""
    now = time.time()
    headers = ["JOB", "NODE", "STEPS", "RANKS", "FILES", "SIZE", "STATE"]
    if args.action == "ls":
        jobs = scan(args.dir)
        if args.json:
            print_json([j.as_dict() for j in jobs])
        elif not jobs:
            print(f"no memory-tier snapshots in {args.dir}")
        else:
            print_table(headers, [_row(j, now) for j in jobs])
            print(
                f"{fmt_bytes(sum(j.bytes for j in jobs))} in {len(jobs)} job directories (last change up to "
                f"{fmt_time(max(j.changed for j in jobs))})"
            )
        return 0
    removed, kept = clean(args.dir, older_than_s=args.older_than, force=args.force, job=args.job, dry_run=args.dry_run)
    if args.json:
        print_json({"removed": [j.as_dict() for j in removed], "kept": [{**j.as_dict(), "why": w} for j, w in kept]})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for j in removed:
        print(f"{verb} {j.path}: {j.files} files, {fmt_bytes(j.bytes)} (node {j.node})")
    for j, why in kept:
        print(f"kept {j.path}: {why}")
    if not removed and not kept:
        print(f"no memory-tier snapshots in {args.dir}" + (f" of {args.job}" if args.job else ""))
    return 0
