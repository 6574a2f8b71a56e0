"""The memory tier: node-local snapshots every few steps, replicated to other nodes, restored at
any world size before the durable root is read (docs/memory.md)."""

from .recover import MemoryRestore, restore_from_memory
from .tier import MemoryTier, estimate_bytes

__all__ = ["MemoryRestore", "MemoryTier", "estimate_bytes", "restore_from_memory"]
