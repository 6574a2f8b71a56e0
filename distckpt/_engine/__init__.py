"""Write and read DCP checkpoints: blocking ``dcp.save``/``dcp.load`` with typed errors, a
metadata reader that never runs code from the checkpoint, and a loader that unpickles with
``weights_only=True``."""

from .async_writer import AsyncWriter
from .blocking import dcp_load, dcp_save
from .safe_io import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata

__all__ = ["AsyncWriter", "SafeFileSystemReader", "SafeLoadPlanner", "read_dcp_metadata", "dcp_save", "dcp_load"]
