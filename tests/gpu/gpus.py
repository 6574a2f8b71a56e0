"""How many GPUs a GPU test may use; shared by the modules of tests/gpu."""

import pytest
import torch

NCCL = "nccl"


def need_gpus(n: int) -> None:
    """Skip unless ``n`` GPUs exist: the harness puts rank r on cuda:r, and NCCL refuses two
    ranks of one communicator on the same GPU ("Duplicate GPU detected"), so ranks never share."""
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs for {n} NCCL ranks, {have} present: NCCL does not allow two ranks on one GPU")
