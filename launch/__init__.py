"""Demonstration torchrun training job (byte-level GPT on stdlib source) for distckpt."""
