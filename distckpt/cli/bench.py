"""``distckpt bench``: run the save benchmark (or, with ``--load``, the load benchmark).

The benchmarks live in the source tree (``benchmarks/``), next to the ``distckpt`` package of an
editable install; arguments after ``--`` pass through to them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

NAME = "bench"
HELP = "benchmark async vs blocking save (or --load: stock vs fast load) and write JSON, table, plot"
EPILOG = """examples:
  distckpt bench -- --sizes-mib 256 --world-sizes 1 2 --repeats 3 --out runs/bench_save
  distckpt bench --load -- --size-mib 1024 --world-sizes 1 2 --out runs/bench_load
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt bench``."""
    p.add_argument("--load", action="store_true", help="run benchmarks/bench_load.py instead of bench_save.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (after --)")


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt bench``; returns the benchmark's exit code (0 ok).

    Raises:
        FileNotFoundError: no ``benchmarks/`` next to the package (not an editable install of a clone).
    """
    source_tree = Path(__file__).resolve().parents[2]
    if not (source_tree / "benchmarks" / "__init__.py").exists():
        raise FileNotFoundError(
            f"{source_tree / 'benchmarks'}: the benchmarks ship with the source tree; run "
            "`distckpt bench` from an editable install of a clone (pip install -e .)"
        )
    if str(source_tree) not in sys.path:
        sys.path.insert(0, str(source_tree))
    module = importlib.import_module("benchmarks.bench_load" if args.load else "benchmarks.bench_save")
    passthrough = [a for a in args.args if a != "--"]
    return int(module.main(passthrough) or 0)
