"""Coordination of ranks: all-ranks-agree helpers on distckpt's own gloo group, ranks per node and
the shared-root check, phase events."""
