"""distckpt as torchtitan's checkpointer backend (docs/integrations.md, "torchtitan"; needs the
``torchtitan`` extra)."""

from .._integrations.torchtitan import DistckptCheckpointManager

__all__ = ["DistckptCheckpointManager"]
