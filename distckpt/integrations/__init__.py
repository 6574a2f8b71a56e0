"""distckpt inside other training frameworks (docs/integrations.md): ``integrations.hf`` (the
Hugging Face ``Trainer``; needs the ``hf`` extra) and ``integrations.torchtitan`` (a torchtitan
checkpointer backend; needs the ``torchtitan`` extra). Import the submodule you use: this package
imports neither framework."""
