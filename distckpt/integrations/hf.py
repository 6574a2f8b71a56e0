"""The Hugging Face ``Trainer`` saving and resuming through distckpt (docs/integrations.md,
"Hugging Face Trainer"; needs the ``hf`` extra)."""

from .._integrations.hf import DistckptTrainer

__all__ = ["DistckptTrainer"]
