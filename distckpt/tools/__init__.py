"""Offline tools on committed checkpoints (no process group): read, compare, audit, export,
release, import."""
