"""The memory tier: node-local snapshots every few steps, replicated to other nodes, restored at
any world size before the durable root is read (docs/memory.md)."""

from .source import MemoryRestore, MemorySource, choose_snapshot, take_inventory
from .tier import MemoryTier, estimate_bytes

__all__ = ["MemoryRestore", "MemorySource", "MemoryTier", "choose_snapshot", "estimate_bytes", "take_inventory"]
