"""Save under one wrapper / world size on CUDA, load under another, bitwise (NCCL): FSDP2
2 -> 1 and 1 -> 2, FSDP1 FULL and SHARDED, FSDP1 -> FSDP2, DDP -> FSDP2, and ``torch.compile``
(inductor) on GPU.

Rank r runs on cuda:r; NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a case
needing more ranks than GPUs is skipped with that reason (see tests/gpu/test_resume_gpu.py).
"""

import pytest

from tests.distributed.test_cross_wrapper import check_cross_load
from tests.gpu.gpus import NCCL, need_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CUDA = {"device": "cuda"}
INDUCTOR = {"compile": True, "compile_backend": "inductor"}


@pytest.mark.parametrize(
    "save_ws,save_opts,load_ws,load_opts",
    [
        (2, {"wrapper": "fsdp2"}, 1, {"wrapper": "fsdp2"}),
        (1, {"wrapper": "fsdp2"}, 2, {"wrapper": "fsdp2"}),
        (2, {"wrapper": "fsdp2", "state_dict_type": "full"}, 1, {"wrapper": "plain"}),
        (1, {"wrapper": "fsdp1"}, 1, {"wrapper": "fsdp1"}),
        (1, {"wrapper": "fsdp1", "state_dict_type": "full"}, 1, {"wrapper": "fsdp1"}),
        (2, {"wrapper": "fsdp1"}, 2, {"wrapper": "fsdp1"}),
        (2, {"wrapper": "fsdp1", "state_dict_type": "full"}, 2, {"wrapper": "fsdp1"}),
        (1, {"wrapper": "fsdp1"}, 1, {"wrapper": "fsdp2"}),
        (2, {"wrapper": "fsdp1"}, 2, {"wrapper": "fsdp2"}),
        (2, {"wrapper": "ddp"}, 2, {"wrapper": "fsdp2"}),
        (1, {"wrapper": "ddp"}, 1, {"wrapper": "fsdp2"}),
        (1, {"wrapper": "fsdp2", **INDUCTOR}, 1, {"wrapper": "plain"}),
        (1, {"wrapper": "plain"}, 1, {"wrapper": "ddp", **INDUCTOR}),
    ],
    ids=[
        "fsdp2x2-fsdp2x1",
        "fsdp2x1-fsdp2x2",
        "full_fsdp2x2-plain1",
        "fsdp1x1-sharded",
        "fsdp1x1-full",
        "fsdp1x2-sharded",
        "fsdp1x2-full",
        "fsdp1x1-fsdp2x1",
        "fsdp1x2-fsdp2x2",
        "ddp2-fsdp2x2",
        "ddp1-fsdp2x1",
        "compiled_fsdp2x1-plain1",
        "plain1-compiled_ddp1",
    ],
)
def test_cross_load_on_gpu(tmp_path, save_ws, save_opts, load_ws, load_opts):
    need_gpus(max(save_ws, load_ws))
    check_cross_load(
        tmp_path, save_ws, {**CUDA, **save_opts}, load_ws, {**CUDA, **load_opts}, backend=NCCL, timeout_s=240
    )
