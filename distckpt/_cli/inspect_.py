"""``distckpt inspect CKPT``: the manifest's summary and every item, grouped.

Reads only ``distckpt.json`` and ``.metadata`` (allow-listed DCP metadata types; no data file
is opened, nothing is unpickled otherwise).
"""

from __future__ import annotations

import argparse
from typing import Any

from .._tools.reader import GROUPS, CheckpointReader, resolve_checkpoint
from ._common import fmt_bytes, fmt_float, fmt_time, print_json, print_table

NAME = "inspect"
HELP = "show a checkpoint's manifest summary and its tensors (global shape, dtype, bytes) by group"
EPILOG = """examples:
  distckpt inspect runs/demo/ckpt/step-000000020
  distckpt inspect runs/demo/ckpt --group model      (a root means its newest committed checkpoint)
  distckpt inspect runs/demo/ckpt/step-000000020 --json | jq '.groups.model.size_bytes'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt inspect``."""
    p.add_argument("checkpoint", help="checkpoint directory, or a root (its newest committed checkpoint)")
    p.add_argument("--group", choices=GROUPS, help="list only this group's items")


def summary(reader: CheckpointReader) -> dict | None:
    """The manifest's summary of ``reader``'s checkpoint (``size_bytes``: of the files it lists;
    ``wall_time``: seconds since the epoch, ``time`` the same as UTC text; ``timings_s``: seconds),
    or ``None`` when it has no readable manifest."""
    m = reader.manifest
    if m is None:
        return None
    return {
        "step": m.step,
        "epoch": m.epoch,
        "global_samples_seen": m.global_samples_seen,
        "time": fmt_time(m.wall_time),
        "wall_time": m.wall_time,
        "world_size": m.world_size,
        "wrapper": m.wrapper,
        "state_dict_type": m.state_dict_type,
        "loss": m.loss,
        "torch_version": m.torch_version,
        "distckpt_version": m.distckpt_version,
        "schema_version": m.schema_version,
        "model_tensors": len(m.model),
        "model_fingerprint": m.model_fingerprint,
        "timings_s": m.timings_s,
        "files": len(m.files),
        "size_bytes": sum(f.size_bytes for f in m.files),
        "hash_algorithm": m.hash_algorithm,
    }


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt inspect``; returns the exit code (0 ok)."""
    path = resolve_checkpoint(args.checkpoint)
    reader = CheckpointReader(path, check_files=False)
    groups: dict[str, dict[str, Any]] = {}
    for g in GROUPS:
        items = [reader.items[k] for k in reader.keys(g)]
        if items and (args.group in (None, g)):
            groups[g] = {
                "items": len(items),
                "tensors": sum(i.kind == "tensor" for i in items),
                "size_bytes": sum(i.size_bytes for i in items),
                "entries": [i.as_dict() for i in items],
            }
    manifest = summary(reader)
    if args.json:
        print_json(
            {
                "path": str(path),
                "manifest": manifest,
                "manifest_error": str(reader.manifest_error) if reader.manifest_error else None,
                "groups": groups,
            }
        )
        return 0
    print(f"checkpoint {path}")
    if manifest is not None:
        m = manifest
        print(
            f"  step {m['step']}  epoch {m['epoch']}  samples {m['global_samples_seen']}  "
            f"loss {fmt_float(m['loss']) or '-'}  saved {m['time']}"
        )
        print(
            f"  world size {m['world_size']}  wrapper {m['wrapper']}  state dict {m['state_dict_type']}  "
            f"torch {m['torch_version']}  distckpt {m['distckpt_version']} (schema {m['schema_version']})"
        )
        print(
            f"  {m['files']} files, {fmt_bytes(m['size_bytes'])}  model {m['model_tensors']} tensors, "
            f"fingerprint {m['model_fingerprint'][:16]}  timings "
            + ", ".join(f"{k} {v:.3f} s" for k, v in m["timings_s"].items())
        )
    elif reader.manifest_error is not None:
        print(f"  manifest unreadable: {reader.manifest_error}")
    else:
        print("  no manifest: a plain DCP directory, not committed by distckpt")
    for g, info in groups.items():
        print(f"\n{g}: {info['items']} items, {fmt_bytes(info['size_bytes'])}")
        print_table(
            ["KEY", "SHAPE", "DTYPE", "BYTES", "SHARDS"],
            [
                [
                    e["key"],
                    "x".join(map(str, e["shape"])) if e["shape"] else ("scalar" if e["kind"] == "tensor" else "object"),
                    (e["dtype"] or "").replace("torch.", "") or None,
                    fmt_bytes(e["size_bytes"]),
                    e["shards"],
                ]
                for e in info["entries"]
            ],
            indent="  ",
        )
    return 0
