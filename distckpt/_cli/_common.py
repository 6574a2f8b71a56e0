"""Output helpers shared by the subcommands: JSON, aligned tables, sizes, times."""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime, timezone
from typing import Any, Sequence

__all__ = ["add_common", "add_checkpoint_output", "print_json", "print_table", "fmt_bytes", "fmt_time", "fmt_float"]


def add_common(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--debug``, accepted after every subcommand."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")


def add_checkpoint_output(parser: argparse.ArgumentParser, *, out_help: str, force_help: str) -> None:
    """What ``export`` and ``release`` share: ``checkpoint`` (a directory or a root), ``out``,
    ``--dtype``, ``--force`` and ``--no-progress``."""
    parser.add_argument("checkpoint", help="checkpoint directory, or a root (its newest committed checkpoint)")
    parser.add_argument("out", help=out_help)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="cast floating-point model tensors")
    parser.add_argument("--force", action="store_true", help=force_help)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=False, default=str, allow_nan=True))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, indent: str = "") -> None:
    """Left-aligned columns separated by two spaces; ``None`` prints as ``-``."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        print(indent + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def fmt_bytes(n: int | None) -> str | None:
    """``1536`` -> ``1.5 KiB``."""
    if n is None:
        return None
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # pragma: no cover


def fmt_time(wall_time: float | None) -> str | None:
    """Seconds since the epoch -> ``2026-11-29T09:04:12Z`` (UTC)."""
    if not wall_time:
        return None
    return datetime.fromtimestamp(wall_time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def fmt_float(x: float | None) -> str | None:
    if x is None:
        return None
    if math.isinf(x) or math.isnan(x) or x == 0:
        return str(x)
    return f"{x:.6g}"
