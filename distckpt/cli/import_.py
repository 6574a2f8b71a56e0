"""``distckpt import WEIGHTS ROOT``: a weights file -> a committed checkpoint of ROOT."""

from __future__ import annotations

import argparse

from ..export import import_weights
from ..manifest import Manifest
from ._common import fmt_bytes, print_json

NAME = "import"
HELP = "commit a safetensors or torch.save state dict as a step-0 checkpoint that CheckpointManager loads"
EPILOG = """Names in WEIGHTS must be the model's state_dict keys (no 'module.' prefix). The checkpoint
holds model weights only: load it with a CheckpointManager built without optimizer, scheduler,
scaler or dataloader, at any world size and with any wrapper.

examples:
  distckpt import model.safetensors runs/finetune/ckpt
  distckpt import pretrained.pt runs/finetune/ckpt --step 1000 --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("weights", help="safetensors file or torch.save {name: tensor} file")
    p.add_argument("root", help="checkpoint root (created if absent)")
    p.add_argument("--step", type=int, default=0, help="step to record (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.step < 0:
        raise ValueError(f"--step {args.step}: must be >= 0")
    path = import_weights(args.weights, args.root, step=args.step)
    m = Manifest.read(path)
    size = sum(f.size_bytes for f in m.files)
    if args.json:
        print_json({"checkpoint": str(path), "step": m.step, "tensors": len(m.model), "size_bytes": size,
                    "model_fingerprint": m.model_fingerprint})
        return 0
    print(f"committed {path}: {len(m.model)} tensors, {fmt_bytes(size)}, fingerprint {m.model_fingerprint[:16]}")
    return 0
