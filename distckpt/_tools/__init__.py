"""Offline tools on committed checkpoints (no process group): read, compare, audit, export,
release, import."""

from .audit import audit_checkpoint
from .compare import diff_checkpoints
from .export import export_checkpoint, import_weights, load_weights
from .reader import CheckpointReader
from .release import release_checkpoint

__all__ = [
    "CheckpointReader",
    "audit_checkpoint",
    "diff_checkpoints",
    "export_checkpoint",
    "import_weights",
    "load_weights",
    "release_checkpoint",
]
