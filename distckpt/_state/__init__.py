"""The whole training state as one DCP state_dict and back: assembly, per-rank RNG, and the
step rule of a resume with another global batch."""
