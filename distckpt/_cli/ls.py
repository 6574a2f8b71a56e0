"""``distckpt ls ROOT``: every checkpoint of a root with its status.

Status: ``committed`` (manifest valid, files present with their sizes, ``.metadata`` readable
as DCP metadata: every check of ``distckpt verify`` but the files' hashes, the checks a resume
applies), ``corrupt`` (with the reason), ``no manifest`` (a ``step-*`` directory holding
distckpt's own files but no manifest: uncommitted or damaged, never loaded), ``unmanaged`` (a
``step-*`` directory without a manifest or distckpt's files, e.g. a plain ``dcp.save``: the
manager ignores it), ``pending`` (an unfinished
save), ``deleting`` (a retention delete in progress) or ``set aside`` (renamed
``corrupt-``/``rolledback-``/``archived-step-*``: kept, never loaded). SIZE is the bytes of a
checkpoint's own files; REFS the bytes of the earlier checkpoints' files an incremental one refers
to (on disk once, in their owner's SIZE). Reads no data files and never unpickles anything but
allow-listed DCP metadata types.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from .._ondisk.layout import (
    MANIFEST,
    NO_MANIFEST,
    checkpoint_name,
    is_deleting,
    location_step,
    no_manifest_reason,
    parse_set_aside,
)
from .._ondisk.manifest import Manifest, first_problem, structure_problems
from .._storage import find_committed, open_location, read_dcp_metadata
from .._tools.store_queries import tool_store
from ._common import fmt_bytes, fmt_float, fmt_time, print_json, print_table

NAME = "ls"
HELP = (
    "list the checkpoints of a root: step, time, size (own files; REFS: referenced files), world size, "
    "wrapper, loss, metrics, status"
)
EPILOG = """examples:
  distckpt ls runs/demo/ckpt
  distckpt ls s3://bucket/run1                         (an S3 root: AWS_* environment)
  distckpt ls runs/demo/ckpt --json | jq '.checkpoints[] | select(.status == "committed") | .step'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt ls``."""
    p.add_argument("root", help="checkpoint root (the directory holding step-* directories)")


def _manifest_columns(m: Manifest) -> dict[str, Any]:
    """A committed checkpoint's row values. ``size_bytes``: its own files (what it adds to the
    root); ``referenced_bytes``: the earlier checkpoints' files an incremental one refers to
    (``../step-N/...`` entries), counted with their owner, not here."""
    referenced = sum(f.size_bytes for f in m.files if f.path.startswith("../"))
    return dict(
        time=fmt_time(m.wall_time),
        wall_time=m.wall_time,
        size_bytes=sum(f.size_bytes for f in m.files) - referenced,
        referenced_bytes=referenced,
        world_size=m.world_size,
        state_dict_type=m.state_dict_type,
        wrapper=m.wrapper,
        loss=m.loss,
        metrics=m.metrics,
    )


def list_root(root: str) -> list[dict]:
    """One row per checkpoint (oldest first), then saves and deletions in progress and set-aside
    checkpoints, of a root on any store.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist, is not a directory, or is a checkpoint.
    """
    store, location = open_location(root)
    if location is not None:
        raise CheckpointNotFoundError(
            f"{root} is a checkpoint, not a root: run `distckpt inspect {root}` or `distckpt ls {store.root}`"
        )
    tools = tool_store(store)
    tools.check_tool_root()
    others = store.others()
    latest = others.latest
    unmanaged, deferred, damaged = set(others.unmanaged), set(others.deferred), set(others.damaged)
    found_all: list[tuple[int, str, Manifest | CheckpointCorruptError | None]] = list(find_committed(store))
    found_all += [(location_step(loc) or 0, loc, None) for loc in others.unmanaged + others.deferred + others.damaged]
    rows = []
    for step, found, result in sorted(found_all, key=lambda e: e[0]):
        if isinstance(result, Manifest):
            result = with_metadata_checked(result, found, lambda loc: read_dcp_metadata(store, loc))
        row = {
            "name": found.rstrip("/").rsplit("/", 1)[-1],
            "step": step,
            "status": "committed",
            "latest": checkpoint_name(step) == latest,
            "path": found,
        }
        if isinstance(result, Manifest):
            row.update(_manifest_columns(result))
        elif found in unmanaged:
            row.update(
                status="unmanaged",
                reason=f"no {MANIFEST}: not written by distckpt, ignored by the "
                f"manager; `distckpt import {found} NEW_ROOT` to use it",
            )
        elif found in damaged:
            row.update(status=NO_MANIFEST.split(" (")[0], reason=no_manifest_reason(found))
        elif found in deferred:
            row.update(
                status="deferred",
                reason="retired; kept (never loaded) while incremental checkpoints refer to its files",
            )
        else:
            row.update(status="corrupt", reason=str(result))
        rows.append(row)
    names = [rel.rsplit("/", 1)[-1] for rel in tools.leftovers()]
    rows += [
        {"name": n, "step": None, "status": "deleting" if is_deleting(n) else "pending", "latest": False} for n in names
    ]
    rows += [
        {"name": n, "step": aside[1], "status": "set aside", "reason": aside[0], "latest": False}
        for n in (name.rsplit("/", 1)[-1] for name in others.set_aside)
        if (aside := parse_set_aside(n)) is not None
    ]
    return rows


def with_metadata_checked(
    manifest: Manifest, location: str, read: Callable[[str], Any]
) -> Manifest | CheckpointCorruptError:
    """``manifest``, or the first problem of the checkpoint's ``.metadata`` (``read(location)``): unreadable,
    or not agreeing with the manifest (the checks resume discovery and ``load()`` apply)."""
    try:
        problem = first_problem(structure_problems(manifest, location=location, metadata=read(location)), location)
    except CheckpointCorruptError as e:
        return e
    return manifest if problem is None else problem


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt ls``; returns the exit code (0 ok, an empty root too)."""
    root = args.root
    rows = list_root(root)
    if args.json:
        print_json({"root": root, "checkpoints": rows})
        return 0
    if not rows:
        print(f"no checkpoints in {root}")
        return 0
    print_table(
        ["NAME", "STEP", "TIME (UTC)", "SIZE", "REFS", "WORLD", "TYPE", "WRAPPER", "LOSS", "METRICS", "STATUS"],
        [
            [
                r["name"] + (" *" if r["latest"] else ""),
                r["step"],
                r.get("time"),
                fmt_bytes(r.get("size_bytes")),
                fmt_bytes(r.get("referenced_bytes") or None),
                r.get("world_size"),
                r.get("state_dict_type"),
                r.get("wrapper"),
                fmt_float(r.get("loss")),
                " ".join(f"{k}={fmt_float(v)}" for k, v in sorted((r.get("metrics") or {}).items())) or None,
                r["status"],
            ]
            for r in rows
        ],
    )
    for r in rows:
        if r["status"] in ("corrupt", "unmanaged", NO_MANIFEST.split(" (")[0]):
            print(f"{r['name']}: {r['reason']}")
    if any(r["latest"] for r in rows):
        print("* = latest")
    return 0
