"""``distckpt import WEIGHTS ROOT``: a weights file -> a committed checkpoint of ROOT."""

from __future__ import annotations

import argparse

from .._ondisk.manifest import Manifest
from .._storage import open_store
from .._tools.export import import_weights
from ._common import fmt_bytes, print_json

NAME = "import"
HELP = (
    "commit a safetensors file, torch.save state dict or plain DCP directory as a step-0 checkpoint "
    "that CheckpointManager loads"
)
EPILOG = """Names in WEIGHTS must be the model's state_dict keys (no 'module.' prefix). A DCP directory
(a plain dcp.save, any world size) gives its model.<fqn> tensors, or, when it has no model.*
items, its tensors under their own names; other items (optimizer, ...) are not imported. The
source is never changed. The checkpoint holds model weights only: the manager loads it at any
world size and with any wrapper, and starts optimizer, scheduler, scaler and data fresh.
ROOT must hold no checkpoints (a resume would take those, not the import) unless
--archive-existing renames them archived-step-N-<n> (nothing is deleted).

examples:
  distckpt import model.safetensors runs/finetune/ckpt
  distckpt import pretrained.pt runs/finetune/ckpt --step 1000 --json
  distckpt import runs/plain_dcp/step-000000500 runs/finetune/ckpt --step 500
  distckpt import model.safetensors s3://bucket/finetune      (an S3 root: AWS_* environment)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``distckpt import``."""
    p.add_argument("weights", help="safetensors file, torch.save {name: tensor} file or DCP directory")
    p.add_argument("root", help="checkpoint root (created if absent)")
    p.add_argument("--step", type=int, default=0, help="step to record (default 0)")
    p.add_argument(
        "--archive-existing",
        action="store_true",
        help="rename the checkpoints ROOT holds archived-step-N-<n> first (default: refuse)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``distckpt import``; returns the exit code (0 ok).

    Raises:
        ValueError: ``--step`` is negative.
    """
    if args.step < 0:
        raise ValueError(f"--step {args.step}: must be >= 0")
    location = import_weights(
        args.weights, args.root, step=args.step, on_existing="archive" if args.archive_existing else "refuse"
    )
    return report(args, location, open_store(args.root).read_manifest(location))


def report(args: argparse.Namespace, path: object, m: Manifest) -> int:
    """Print the checkpoint committed at ``path`` (``m``: its manifest), as JSON with ``--json``; returns 0."""
    size = sum(f.size_bytes for f in m.files)
    if args.json:
        print_json(
            {
                "checkpoint": str(path),
                "step": m.step,
                "tensors": len(m.model),
                "size_bytes": size,
                "model_fingerprint": m.model_fingerprint,
            }
        )
        return 0
    print(f"committed {path}: {len(m.model)} tensors, {fmt_bytes(size)}, fingerprint {m.model_fingerprint[:16]}")
    return 0
