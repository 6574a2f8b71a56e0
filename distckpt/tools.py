"""Offline tools on committed checkpoints, without a process group (docs/cli.md): read, audit,
compare, export, import and release. Each takes a checkpoint location (a ``str``: a directory
or an ``s3://`` data prefix) as ``distckpt`` commands do."""

from ._tools.audit import audit_checkpoint
from ._tools.compare import diff_checkpoints
from ._tools.export import export_checkpoint, import_weights, load_weights
from ._tools.reader import CheckpointReader
from ._tools.release import release_checkpoint

__all__ = [
    "CheckpointReader",
    "audit_checkpoint",
    "diff_checkpoints",
    "export_checkpoint",
    "import_weights",
    "load_weights",
    "release_checkpoint",
]
