"""Model/optimizer state through ``torch.distributed.checkpoint.state_dict`` for every wrapper.

DCP's ``get_state_dict``/``set_state_dict`` already strip wrapper prefixes (DDP ``module.``,
``torch.compile`` ``_orig_mod.``, FSDP1 internals) and return DTensors for FSDP2; this package
adds wrapper detection, the FULL/SHARDED choice, and guards around DCP's optimizer helpers.
"""

from .model_optim import ModelOptimState, specs_of, tensor_specs, tied_keys
from .stateful import as_saved, put_empty_dicts, with_saved_keys, with_saved_optim_keys, without_empty_dicts
from .wrappers import (
    check_model_and_optimizer,
    ddp_rebuilds_buckets,
    ddp_resume_not_bitwise,
    inner_optimizer,
    wrapper_kind,
)

__all__ = [
    "check_model_and_optimizer",
    "inner_optimizer",
    "ddp_rebuilds_buckets",
    "ddp_resume_not_bitwise",
    "wrapper_kind",
    "ModelOptimState",
    "specs_of",
    "tensor_specs",
    "tied_keys",
    "with_saved_keys",
    "with_saved_optim_keys",
    "as_saved",
    "without_empty_dicts",
    "put_empty_dicts",
]
