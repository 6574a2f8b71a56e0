"""Entry point and the one exception-to-message map of the CLI."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..commit import find_committed, validate
from ..errors import DistCkptError
from ..layout import is_staging
from ..manifest import Manifest

__all__ = ["main"]


def _cmd_ls(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint root")
    rows = []
    for step, path, result in reversed(find_committed(root)):
        row = {"name": path.name, "step": step, "status": "committed" if isinstance(result, Manifest) else "corrupt"}
        if isinstance(result, Manifest):
            row.update(time=datetime.fromtimestamp(result.wall_time, timezone.utc).isoformat(timespec="seconds"),
                       size_bytes=sum(f.size_bytes for f in result.files), world_size=result.world_size,
                       state_dict_type=result.state_dict_type, wrapper=result.wrapper, loss=result.loss)
        else:
            row["reason"] = str(result)
        rows.append(row)
    rows += [{"name": p.name, "status": "staging"} for p in sorted(root.iterdir()) if is_staging(p.name)]
    if args.json:
        print(json.dumps({"root": str(root), "checkpoints": rows}, indent=1))
        return 0
    cols = ["name", "status", "step", "time", "size_bytes", "world_size", "state_dict_type", "wrapper", "loss"]
    table = [cols] + [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    path = Path(args.path)
    targets = [path] if (path / "distckpt.json").exists() else [p for _, p, _ in find_committed(path)]
    if not targets:
        raise FileNotFoundError(f"{path}: no checkpoints to verify")
    bad = 0
    for target in targets:
        try:
            validate(target)
            print(f"ok       {target}")
        except DistCkptError as e:
            bad += 1
            print(f"CORRUPT  {target}: {e}")
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distckpt", description="Inspect distckpt checkpoint directories.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list checkpoints in a root", epilog="example: distckpt ls runs/demo/ckpt --json")
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=_cmd_ls)
    p = sub.add_parser("verify", help="check files against manifests (exit 1 if any is bad)",
                       epilog="example: distckpt verify runs/demo/ckpt/step-000000020")
    p.add_argument("path", help="a checkpoint root or one checkpoint directory")
    p.set_defaults(fn=_cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (0 ok, 1 check failed, 2 error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (DistCkptError, OSError) as e:
        if args.debug:
            raise
        print(f"distckpt {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
