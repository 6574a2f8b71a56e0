"""Async saves of CUDA state (pinned staging buffers, non-blocking device-to-host copies) are
bitwise equal to a blocking save of the same state while training mutates the parameters, and
a background-staged copy waits for kernels still queued on the compute stream.

Rank r runs on cuda:r; a case needing more ranks than GPUs is skipped because NCCL refuses two
ranks on one GPU (see tests/gpu/test_resume_gpu.py).
"""

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.test_async import check_async_equals_state_at_save
from tests.distributed.test_cross_wrapper import assert_same_state
from tests.distributed.trainer import full_params, load_report, save_after
from tests.gpu.gpus import NCCL, need_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode,background_staging", [("thread", False), ("thread", True), ("process", False)])
def test_async_save_equals_blocking_save_while_training(tmp_path, world_size, mode, background_staging):
    need_gpus(world_size)
    opts = {"device": "cuda", "wrapper": "fsdp2" if world_size > 1 else "plain"}
    loaded_async = check_async_equals_state_at_save(
        tmp_path / "async", world_size, {**opts, "mode": mode, "background_staging": background_staging}, backend=NCCL
    )
    # The same 3 steps saved blocking (no staging): both checkpoints load to the same bits.
    values(run_ranks(save_after, world_size, {**opts, "root": str(tmp_path / "blocking")}, backend=NCCL))
    loaded_blocking = values(
        run_ranks(load_report, world_size, {**opts, "root": str(tmp_path / "blocking")}, backend=NCCL)
    )[0]
    assert_same_state(loaded_blocking, loaded_async)


def save_behind_queued_kernels(rank, world_size, opts):
    """Queue a ~0.5 s spin kernel and then ``p += 1`` on every parameter, and save at once (no
    host sync, no GradScaler, whose state_dict would sync): the checkpoint must hold the
    parameters after the ``+ 1``, as program order says."""
    from distckpt import AsyncSaveConfig, CheckpointConfig, CheckpointManager, ScheduleConfig
    from tests.distributed.trainer import build, train_steps

    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, 2)
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=None),
        async_save=AsyncSaveConfig(mode="thread", background_staging=True),
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    manager.save(1)  # allocates the pinned buffers (an allocation may sync the device)
    manager.wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU clock cycles before the add runs
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.save(2)
    manager.wait_staged()
    manager.wait()
    manager.close()
    return full_params(model)


def load_model_and_optimizer(rank, world_size, opts):
    """Load what :func:`save_behind_queued_kernels` saved (model + optimizer only)."""
    from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
    from tests.distributed.trainer import build

    model, optimizer, *_ = build(rank, world_size, opts)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=optimizer,
    )
    state = manager.load()
    manager.close()
    return {"step": state.step, "params": full_params(model)}


def test_background_staging_waits_for_kernels_queued_before_save(tmp_path):
    need_gpus(1)
    opts = {"device": "cuda", "wrapper": "plain", "root": str(tmp_path)}
    expected = values(run_ranks(save_behind_queued_kernels, 1, opts, backend=NCCL))[0]
    loaded = values(run_ranks(load_model_and_optimizer, 1, opts, backend=NCCL))[0]
    assert loaded["step"] == 2
    for k, v in expected.items():
        assert torch.equal(v, loaded["params"][k]), k
