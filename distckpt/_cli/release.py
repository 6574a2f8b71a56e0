"""``distckpt release CKPT OUT``: a release directory with the model's weights, a model card and
the training config (no optimizer, scheduler, RNG or data state)."""

from __future__ import annotations

import argparse

from .._ondisk.layout import refuse_url_output
from .._tools.reader import resolve_checkpoint
from .._tools.release import release_checkpoint
from ._common import add_checkpoint_output, fmt_bytes, print_json

NAME = "release"
HELP = "write OUT/model.safetensors (model only), OUT/model_card.md and OUT/training_config.json"
EPILOG = """The weights are streamed tensor by tensor (bounded memory, as `export`); the card and the
config list step, epoch, samples/tokens seen, loss and recent loss history, metrics, world size and
wrapper at save, versions, hardware and the run's plain extra_state values (data description,
hyper-parameters). A root means its newest committed checkpoint.

examples:
  distckpt release runs/demo/ckpt release/gpt --dtype bf16
  distckpt release runs/demo/ckpt/step-000000060 release/gpt --name-with-step   # release/gpt-step60-loss2.1234
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt release``."""
    add_checkpoint_output(
        p,
        out_help="release directory (created; its parent must exist)",
        force_help="replace the release files if they exist",
    )
    p.add_argument(
        "--name-with-step", action="store_true", help="write to OUT-step<N>-loss<L> (the checkpoint's step and loss)"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt release``; returns the exit code (0 ok)."""
    refuse_url_output(args.out, "release directory")  # before resolving the checkpoint
    ckpt = resolve_checkpoint(args.checkpoint)
    result = release_checkpoint(
        ckpt,
        args.out,
        dtype=args.dtype,
        name_with_step=args.name_with_step,
        overwrite=args.force,
        progress=not args.no_progress and not args.json,
    )
    if args.json:
        print_json({"checkpoint": str(ckpt), **result.as_dict()})
        return 0
    print(
        f"wrote {result.path}: {', '.join(result.files)} ({result.model.num_tensors} tensors, "
        f"{fmt_bytes(result.model.size_bytes)}, dtype {result.model.dtype or 'as saved'}) from {ckpt}"
    )
    return 0
