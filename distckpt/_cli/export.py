"""``distckpt export CKPT OUT``: FULL tensors into one safetensors or ``torch.save`` file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from .._ondisk.layout import refuse_url_output
from .._tools.export import export_checkpoint
from .._tools.reader import resolve_checkpoint
from ._common import add_checkpoint_output, fmt_bytes, print_json

NAME = "export"
HELP = "write a checkpoint's FULL tensors into one safetensors or torch.save file (no process group)"
EPILOG = """--dtype casts floating-point model tensors only; optimizer state and integer tensors keep their
dtype. safetensors holds tensors only: non-tensor items (train_state, param_groups, ...) are skipped
and listed. A root means its newest committed checkpoint.

examples:
  distckpt export runs/demo/ckpt/step-000000020 model.safetensors --model-only --dtype bf16
  distckpt export runs/demo/ckpt full.pt --format torch
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt export``."""
    add_checkpoint_output(p, out_help="output file", force_help="replace OUT if it exists")
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        help="output format (default: from OUT's suffix: .safetensors, else torch)",
    )
    p.add_argument("--model-only", action="store_true", help="only model tensors, keys without 'model.'")


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt export``; returns the exit code (0 ok).

    Raises:
        FileExistsError: ``OUT`` exists and ``--force`` was not given.
    """
    refuse_url_output(args.out)
    if Path(args.out).exists() and not args.force:
        raise FileExistsError(f"{args.out} exists; pass --force to replace it")
    ckpt = resolve_checkpoint(args.checkpoint)
    fmt: Literal["safetensors", "torch"] = args.format or (
        "safetensors" if Path(args.out).suffix == ".safetensors" else "torch"
    )
    result = export_checkpoint(
        ckpt,
        args.out,
        format=fmt,
        dtype=args.dtype,
        model_only=args.model_only,
        overwrite=args.force,
        progress=not args.no_progress and not args.json,
    )
    if args.json:
        print_json({"checkpoint": str(ckpt), **result.as_dict()})
        return 0
    print(
        f"wrote {result.path}: {result.num_tensors} tensors, {fmt_bytes(result.size_bytes)}, "
        f"{result.format}, dtype {result.dtype or 'as saved'}, from {ckpt} in {result.seconds:.1f} s"
    )
    if result.skipped:
        shown = ", ".join(result.skipped[:8]) + (", ..." if len(result.skipped) > 8 else "")
        print(f"skipped {len(result.skipped)} non-tensor item(s) safetensors cannot hold: {shown}")
    return 0
