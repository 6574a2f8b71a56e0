"""Exact resume on CUDA with NCCL: FSDP2 and DDP at the same world size, fp16 + GradScaler with
skipped steps, and the CUDA RNG of every device.

Runs only where CUDA exists (tests/gpu/conftest.py skips everything with "no CUDA" otherwise).
Rank r runs on cuda:r (tests/distributed/harness.py, ``backend="nccl"``). NCCL refuses two ranks
of one communicator on the same GPU (it fails with "Duplicate GPU detected"), so a case that
needs more ranks than there are GPUs is skipped, saying so; nowhere do ranks share a GPU. Every
multi-process run has a hard timeout (``run_ranks(timeout_s=...)``) and every test a pytest one.
Dropout is on (the test model's ``nn.Dropout``, CUDA philox RNG) and the trainer turns on
``torch.use_deterministic_algorithms`` (with ``CUBLAS_WORKSPACE_CONFIG`` set by the harness).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.test_exact_resume import check_exact_resume
from tests.distributed.test_rng import rng_job
from tests.gpu.gpus import NCCL, need_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CUDA = {"device": "cuda"}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
def test_same_world_resume_is_bitwise_on_nccl(tmp_path, wrapper, world_size):
    need_gpus(world_size)
    check_exact_resume(tmp_path, world_size, {**CUDA, "wrapper": wrapper}, backend=NCCL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp16_grad_scaler_resume_is_bitwise_including_skipped_steps(tmp_path, world_size):
    """fp16 autocast with a GradScaler whose initial scale (2**24) overflows fp16 gradients: the
    first steps are skipped (inf grads, scale halved), and with growth every 2 steps the scale
    keeps climbing back into overflow, so steps are skipped on both sides of the checkpoint."""
    need_gpus(world_size)
    K, j = 20, 9
    base, resumed = check_exact_resume(
        tmp_path,
        world_size,
        {**CUDA, "wrapper": "ddp" if world_size > 1 else "plain", "amp": True, "init_scale": 2.0**24},
        backend=NCCL,
        K=K,
        j=j,
    )
    scales = base[0]["scales"]
    skipped = [s for s in range(2, K + 1) if scales[s] < scales[s - 1]]  # an inf step halves the scale
    assert scales[1] < 2.0**24 and any(s <= j for s in skipped), scales
    assert any(s > j for s in skipped), f"no skipped step after the checkpoint: {scales}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_rng_of_every_device_is_restored(tmp_path, world_size):
    """Each rank advances the RNG of every visible device, saves; fresh ranks load and draw the
    same next numbers on their own device (and on CPU, python, numpy)."""
    need_gpus(world_size)
    saved = values(run_ranks(rng_job, world_size, {"root": str(tmp_path), "load": False}, backend=NCCL))
    resumed = values(run_ranks(rng_job, world_size, {"root": str(tmp_path), "load": True}, backend=NCCL))
    for rank in range(world_size):
        assert saved[rank]["draws"][3], "no CUDA draws"
        # CPU sources, and the rank's own device (cuda:rank): only its generator is saved.
        assert resumed[rank]["draws"][:3] == saved[rank]["draws"][:3]
        assert resumed[rank]["draws"][3][rank] == saved[rank]["draws"][3][rank]
    if world_size > 1:
        assert saved[0]["draws"][3] != saved[1]["draws"][3]  # per-rank streams, not one shared


_RNG_SCRIPT = """
import sys, torch
from distckpt._state.rng import capture_rng, restore_rng
torch.cuda.set_device(torch.cuda.device_count() - 1)  # the rank's device: the last visible one
if sys.argv[1] == "save":
    torch.manual_seed(1234)
    torch.rand(3, device="cuda")
    torch.save(capture_rng(), sys.argv[2])
else:
    restore_rng(torch.load(sys.argv[2], weights_only=True))
print(torch.rand(4, device="cuda").tolist())
"""


def test_cuda_rng_follows_the_device_under_another_visible_order(tmp_path):
    """Saved by a process that sees GPUs (a, b) and runs on b (index 1); restored by one whose
    CUDA_VISIBLE_DEVICES is b alone (index 0): b's stream continues (issue 35, item 8)."""
    need_gpus(2)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    a, b = visible.split(",")[:2]
    path = str(tmp_path / "rng.pt")

    def run(mode: str, devices: str) -> list[float]:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices}
        out = subprocess.run(
            [sys.executable, "-c", _RNG_SCRIPT, mode, path], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    saved = run("save", f"{a},{b}")
    assert run("load", b) == saved
