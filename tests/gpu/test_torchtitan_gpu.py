"""torchtitan's llama3 debug model (6 layers, dim 256, vocab 2048) checkpointed through
distckpt's torchtitan backend on CUDA/NCCL (issue 28, item 3): built the way torchtitan's
trainer builds it (meta device, ``to_empty``, ``init_weights``), FSDP2, torchtitan's optimizer
and LR scheduler containers, async saves; stopped after step 5 (saves at 2 and 4) and resumed by
new processes, bitwise equal to the uninterrupted run. torchtitan's model code imports triton,
which comes with CUDA builds of torch: on a CPU machine this file is skipped (tests/gpu/conftest.py:
"no CUDA"). NOT RUN YET: written on a machine without a GPU (docs/status.md)."""

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.gpu.gpus import NCCL, need_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

STEPS, SEQ, BATCH = 8, 64, 4


def _debug_job(rank: int, world_size: int, base: str, stop_after: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.models.llama3 import model_registry

    from distckpt.integrations.torchtitan import DistckptCheckpointManager

    device = torch.device("cuda", rank)
    torch.use_deterministic_algorithms(True, warn_only=True)  # same kernels on both sides of the resume
    torch.manual_seed(0)
    spec = model_registry("debugmodel", attn_backend="sdpa")
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 8e-4})],
        implementation="foreach",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)

    class TrainState:
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    train_state = TrainState()
    checkpointer = DistckptCheckpointManager.Config(enable=True, folder="ckpt", interval=2, async_mode="thread").build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=base,
    )
    checkpointer.load(step=-1)
    losses = {}
    while train_state.step < stop_after:
        train_state.step += 1
        g = torch.Generator(device="cpu").manual_seed(1000 * train_state.step + rank)  # the step's batch
        tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g).to(device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses[train_state.step] = loss.item()
        checkpointer.save(train_state.step, last_step=train_state.step == STEPS)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    return {"losses": losses, "final": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchtitan_debug_model_resumes_bitwise_through_distckpt(tmp_path, world_size):
    need_gpus(world_size)
    pytest.importorskip("triton")
    pytest.importorskip("torchtitan.models.llama3")
    ref = values(run_ranks(_debug_job, world_size, str(tmp_path / "ref"), STEPS, backend=NCCL, timeout_s=500))
    values(run_ranks(_debug_job, world_size, str(tmp_path / "run"), 5, backend=NCCL, timeout_s=500))
    got = values(run_ranks(_debug_job, world_size, str(tmp_path / "run"), STEPS, backend=NCCL, timeout_s=500))
    for r, g in zip(ref, got):
        assert [g["losses"][s] for s in range(5, STEPS + 1)] == [r["losses"][s] for s in range(5, STEPS + 1)]
        assert all(torch.equal(g["final"][k], r["final"][k]) for k in r["final"])
