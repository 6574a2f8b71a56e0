"""``distckpt ls ROOT``: every checkpoint of a root with its status.

Status: ``committed`` (manifest valid, files present with their sizes, ``.metadata`` readable
as DCP metadata: every check of ``distckpt verify`` but the files' hashes, the checks a resume
applies), ``corrupt`` (with the reason), ``unmanaged`` (a ``step-*`` directory without
a manifest, e.g. a plain ``dcp.save``: the manager ignores it), ``pending`` (an unfinished
save), ``deleting`` (a retention delete in progress) or ``set aside`` (renamed
``corrupt-``/``rolledback-``/``archived-step-*``: kept, never loaded). SIZE is the bytes of a
checkpoint's own files; REFS the bytes of the earlier checkpoints' files an incremental one refers
to (on disk once, in their owner's SIZE). Reads no data files and never unpickles anything but
allow-listed DCP metadata types.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from ..engine import read_dcp_metadata
from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..ondisk.layout import LATEST, MANIFEST, checkpoint_name, is_deferred, is_deleting, is_pending, parse_set_aside
from ..ondisk.manifest import Manifest, first_problem, structure_problems
from ..storage import is_s3_url, open_store, split_location
from ..storage.commit import find_committed
from ._common import fmt_bytes, fmt_float, fmt_time, print_json, print_table

NAME = "ls"
HELP = ("list the checkpoints of a root: step, time, size (own files; REFS: referenced files), world size, "
        "wrapper, loss, metrics, status")
EPILOG = """examples:
  distckpt ls runs/demo/ckpt
  distckpt ls s3://bucket/run1                         (an S3 root: AWS_* environment)
  distckpt ls runs/demo/ckpt --json | jq '.checkpoints[] | select(.status == "committed") | .step'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", help="checkpoint root (the directory holding step-* directories)")


def _manifest_columns(m: Manifest) -> dict[str, Any]:
    """A committed checkpoint's row values. ``size_bytes``: its own files (what it adds to the
    root); ``referenced_bytes``: the earlier checkpoints' files an incremental one refers to
    (``../step-N/...`` entries), counted with their owner, not here."""
    referenced = sum(f.size_bytes for f in m.files if f.path.startswith("../"))
    return dict(time=fmt_time(m.wall_time), wall_time=m.wall_time,
                size_bytes=sum(f.size_bytes for f in m.files) - referenced, referenced_bytes=referenced,
                world_size=m.world_size, state_dict_type=m.state_dict_type, wrapper=m.wrapper, loss=m.loss,
                metrics=m.metrics)


def list_root(root: Path) -> list[dict]:
    """One row per ``step-*`` (oldest first), then pending, deleting and set-aside directories.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist, is not a directory, or is a checkpoint.
    """
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such checkpoint root")
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: not a directory (expected a checkpoint root)")
    if (root / MANIFEST).exists() or (root / ".metadata").exists():
        raise CheckpointNotFoundError(
            f"{root} is a checkpoint directory, not a root: run `distckpt inspect {root}` "
            f"or `distckpt ls {root.parent}`")
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    rows = []
    for step, path, result in reversed(find_committed(root)):
        if isinstance(result, Manifest):
            result = with_metadata_checked(result, str(path), read_dcp_metadata)
        row = {"name": path.name, "step": step, "status": "committed", "latest": path.name == latest}
        if isinstance(result, Manifest):
            row.update(_manifest_columns(result))
        elif is_deferred(path):
            row.update(status="deferred", reason="retired; kept (never loaded) while incremental checkpoints "
                                                 "refer to its files")
        elif not (path / MANIFEST).exists():
            row.update(status="unmanaged", reason=f"no {MANIFEST}: not written by distckpt, ignored by the "
                                                  f"manager; `distckpt import {path} NEW_ROOT` to use it")
        else:
            row.update(status="corrupt", reason=str(result))
        rows.append(row)
    others = sorted(root.iterdir())
    rows += [{"name": p.name, "step": None, "status": "pending", "latest": False}
             for p in others if is_pending(p.name)]
    rows += [{"name": p.name, "step": None, "status": "deleting", "latest": False}
             for p in others if is_deleting(p.name)]
    rows += [{"name": p.name, "step": aside[1], "status": "set aside", "reason": aside[0], "latest": False}
             for p in others if (aside := parse_set_aside(p.name)) is not None]
    return rows


def with_metadata_checked(manifest: Manifest, location: str,
                          read: Callable[[str], Any]) -> Manifest | CheckpointCorruptError:
    """``manifest``, or the first problem of the checkpoint's ``.metadata`` (``read(location)``): unreadable,
    or not agreeing with the manifest (the checks resume discovery and ``load()`` apply)."""
    try:
        problem = first_problem(structure_problems(manifest, location=location, metadata=read(location)), location)
    except CheckpointCorruptError as e:
        return e
    return manifest if problem is None else problem


def list_s3_root(root: str) -> list[dict]:
    """:func:`list_root` of an ``s3://`` root: committed (or corrupt) checkpoints by manifest,
    then unreferenced data prefixes (``pending``) and set-aside manifests.

    Raises:
        CheckpointNotFoundError: ``root`` names one checkpoint, not a root.
    """
    if split_location(root)[1] is not None:
        raise CheckpointNotFoundError(f"{root} is a checkpoint, not a root: run `distckpt inspect {root}`")
    store: Any = open_store(root)  # an S3Store
    latest = store.read_latest()
    rows = []
    for step, location, result in reversed(store.find_committed()):
        if isinstance(result, Manifest):
            result = with_metadata_checked(result, location, store.read_dcp_metadata)
        name = location.rsplit("/", 1)[-1]
        row = {"name": name, "step": step, "status": "committed", "latest": checkpoint_name(step) == latest,
               "path": location}
        if isinstance(result, Manifest):
            row.update(_manifest_columns(result))
        else:
            row.update(status="corrupt", reason=str(result))
        rows.append(row)
    rows += [{"name": rel.rsplit("/", 1)[-1], "step": None, "status": "pending", "latest": False}
             for rel in store.unreferenced()]
    rows += [{"name": name, "step": aside[1], "status": "set aside", "reason": aside[0], "latest": False}
             for name in store.set_aside_names() if (aside := parse_set_aside(name)) is not None]
    return rows


def run(args: argparse.Namespace) -> int:
    root = args.root if is_s3_url(args.root) else Path(args.root)
    rows = list_s3_root(root) if isinstance(root, str) else list_root(root)
    if args.json:
        print_json({"root": str(root), "checkpoints": rows})
        return 0
    if not rows:
        print(f"no checkpoints in {root}")
        return 0
    print_table(
        ["NAME", "STEP", "TIME (UTC)", "SIZE", "REFS", "WORLD", "TYPE", "WRAPPER", "LOSS", "METRICS", "STATUS"],
        [[r["name"] + (" *" if r["latest"] else ""), r["step"], r.get("time"), fmt_bytes(r.get("size_bytes")),
          fmt_bytes(r.get("referenced_bytes") or None), r.get("world_size"), r.get("state_dict_type"),
          r.get("wrapper"), fmt_float(r.get("loss")),
          " ".join(f"{k}={fmt_float(v)}" for k, v in sorted((r.get("metrics") or {}).items())) or None,
          r["status"]] for r in rows])
    for r in rows:
        if r["status"] in ("corrupt", "unmanaged"):
            print(f"{r['name']}: {r['reason']}")
    if any(r["latest"] for r in rows):
        print("* = latest")
    return 0
