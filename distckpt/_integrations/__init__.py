"""The implementations behind ``distckpt.integrations`` (private)."""
