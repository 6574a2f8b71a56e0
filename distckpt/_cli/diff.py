"""``distckpt diff A B``: keys only in one, shape/dtype differences, max |a - b| per tensor.

Streams item by item (two batches in memory). Exit 0 when identical, 1 when they differ.
"""

from __future__ import annotations

import argparse

from .._tools.compare import diff_checkpoints
from .._tools.reader import GROUPS, resolve_checkpoint
from ._common import fmt_float, print_json, print_table
from ._errors import EXIT_FAILED, EXIT_OK

NAME = "diff"
HELP = "compare two checkpoints: keys only in one, shape/dtype differences, max abs difference per tensor"
EPILOG = """examples:
  distckpt diff runs/a/ckpt/step-000000100 runs/b/ckpt/step-000000100
  distckpt diff runs/a/ckpt runs/b/ckpt --group model --all     (roots: their newest checkpoints)
  distckpt diff A B --json | jq '.common[] | select(.equal | not) | .key'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt diff``."""
    p.add_argument("a", help="checkpoint directory or root")
    p.add_argument("b", help="checkpoint directory or root")
    p.add_argument("--group", choices=GROUPS, help="compare only this group")
    p.add_argument("--all", action="store_true", help="list equal items too (human output)")


def _shape(s):
    return "x".join(map(str, s)) if s else ("scalar" if s == [] else "object")


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt diff``; returns the exit code (0 identical, 1 the checkpoints differ)."""
    a, b = resolve_checkpoint(args.a), resolve_checkpoint(args.b)
    d = diff_checkpoints(a, b, group=args.group)
    code = EXIT_OK if d.identical else EXIT_FAILED
    if args.json:
        print_json({"a": str(a), "b": str(b), **d.as_dict()})
        return code
    print(f"A = {a}\nB = {b}")
    for label, keys in (("only in A", d.only_a), ("only in B", d.only_b)):
        if keys:
            print(f"\n{label} ({len(keys)}):")
            for k in keys:
                print(f"  {k}")
    if d.mismatched:
        print(f"\nshape/dtype differ ({len(d.mismatched)}):")
        print_table(
            ["KEY", "A", "B"],
            [
                [
                    t.key,
                    f"{_shape(t.shape_a)} {t.dtype_a or ''}".strip(),
                    f"{_shape(t.shape_b)} {t.dtype_b or ''}".strip(),
                ]
                for t in d.mismatched
            ],
            indent="  ",
        )
    shown = [t for t in d.common if args.all or not t.equal]
    differing = sum(not t.equal for t in d.common)
    print(f"\n{len(d.common)} common items, {differing} differ")
    if shown:
        print_table(
            ["KEY", "EQUAL", "MAX ABS DIFF"],
            [[t.key, "yes" if t.equal else "no", fmt_float(t.max_abs_diff)] for t in shown],
            indent="  ",
        )
    print("identical" if d.identical else "checkpoints differ")
    return code
