"""distckpt as torchtitan's checkpointer (issue 28, item 3): torchtitan's checkpointer API
(``Config.build``, ``load``, ``save`` every step, ``maybe_wait_for_staging``,
``maybe_wait_for_saving``, ``close``) driven as torchtitan's trainer drives it, on 2 gloo ranks
with an FSDP2 model, torchtitan's ``OptimizersContainer`` and ``LRSchedulersContainer``, a
``StatefulDataLoader`` and the train state. A run stopped after step 7 (saves at 3 and 6) and
resumed by new processes equals the uninterrupted run bitwise: losses of steps 7-12 on every
rank, the final weights, the train state; blocking saves before the stop, async after."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks, values

pytest.importorskip("torchtitan.components.checkpointer", reason="needs the torchtitan extra")

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore")]

STEPS, G, N = 12, 8, 64


class _TrainState:
    """torchtitan's trainer as a Stateful: the step and the tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _job(rank: int, world_size: int, base: str, stop_after: int, async_mode: str) -> dict:
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from distckpt import ReshardableSampler
    from distckpt.data import make_stateful_dataloader
    from distckpt.integrations.torchtitan import DistckptCheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3, decay_type="cosine").build(
        optimizers=optimizers, training_steps=STEPS
    )
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g))
    sampler = ReshardableSampler(N, global_batch_size=G, rank=rank, world_size=world_size, seed=3)
    loader = make_stateful_dataloader(data, sampler)
    train_state = _TrainState()
    config = DistckptCheckpointManager.Config(enable=True, folder="ckpt", interval=3, async_mode=async_mode)
    checkpointer = config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=base,
    )
    resumed = checkpointer.load(step=-1)
    resumed_at = train_state.step
    losses = {}
    batches = iter(loader)
    while train_state.step < stop_after:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        train_state.step += 1
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += G
        losses[train_state.step] = loss.item()
        checkpointer.save(train_state.step, last_step=train_state.step == STEPS)
    checkpointer.maybe_wait_for_saving()
    in_flight = checkpointer.save_future is not None
    checkpointer.close()
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {
        "resumed": resumed,
        "resumed_at": resumed_at,
        "losses": losses,
        "final": full,
        "tokens": train_state.ntokens_seen,
        "lr": schedulers.schedulers[0].get_last_lr(),
        "in_flight_after_wait": in_flight,
    }


def test_torchtitan_checkpointer_save_load_resume_bitwise(tmp_path):
    # The saves' mode does not change the trajectory: the first run saves blocking, the resumed
    # run and the reference save async (thread), so one test covers both.
    ref = values(run_ranks(_job, 2, str(tmp_path / "ref"), STEPS, "thread"))
    first = values(run_ranks(_job, 2, str(tmp_path / "run"), 7, "off"))
    assert not first[0]["resumed"] and first[0]["resumed_at"] == 0
    saved = sorted(p.name for p in (tmp_path / "run" / "ckpt").glob("step-*"))
    assert saved == ["step-000000003", "step-000000006"]
    second = values(run_ranks(_job, 2, str(tmp_path / "run"), STEPS, "thread"))
    for rank in (0, 1):
        r, s = ref[rank], second[rank]
        assert s["resumed"] and s["resumed_at"] == 6  # train_state restored (TRAIN_STATE)
        assert [s["losses"][k] for k in range(7, STEPS + 1)] == [r["losses"][k] for k in range(7, STEPS + 1)]
        assert all(torch.equal(s["final"][k], r["final"][k]) for k in r["final"])
        assert s["tokens"] == r["tokens"] == STEPS * G and s["lr"] == r["lr"]
        assert not s["in_flight_after_wait"]
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").glob("step-*"))[-1] == "step-000000012"


def test_config_refuses_what_the_backend_does_not_do():
    from distckpt import ConfigError
    from distckpt.integrations.torchtitan import DistckptCheckpointManager

    with pytest.raises(ConfigError, match="last_save_in_hf"):
        DistckptCheckpointManager.Config(enable=True, last_save_in_hf=True, last_save_model_only=True)
    with pytest.raises(ValueError, match="at least 2 checkpoint replicas"):  # torchtitan's own checks still run
        DistckptCheckpointManager.Config(enable=True, keep_latest_k=1)
    disabled = DistckptCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )
    assert disabled.load() is False and disabled.save(3) is False


@pytest.mark.parametrize("load_only", [False, True])
def test_load_only_is_save_enabled_false(tmp_path, load_only):
    from distckpt.integrations.torchtitan import DistckptCheckpointManager

    model = torch.nn.Linear(2, 1)
    checkpointer = DistckptCheckpointManager.Config(enable=True, folder="ckpt", load_only=load_only).build(
        dataloader=None,
        model_parts=[model],
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    config = checkpointer.checkpoint_config()
    assert config.save.enabled is not load_only and config.effective_preemption is not load_only
    assert config.root == str(tmp_path / "ckpt")
