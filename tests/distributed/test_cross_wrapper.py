"""A checkpoint saved under one wrapper loads under another, bitwise."""

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.trainer import load_report, save_after

pytestmark = pytest.mark.timeout(240)


def assert_same_state(saved: dict, loaded: dict) -> None:
    assert saved["params"].keys() == loaded["params"].keys()
    for k, v in saved["params"].items():
        assert torch.equal(v, loaded["params"][k]), k
    s_state, l_state = saved["optim"]["state"], loaded["optim"]["state"]
    assert s_state.keys() == l_state.keys() and s_state
    for fqn, entry in s_state.items():
        for name, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(l_state[fqn][name])), (fqn, name)


@pytest.mark.parametrize(
    "save_ws,save_opts,load_ws,load_opts",
    [
        (2, {"wrapper": "ddp"}, 1, {"wrapper": "plain"}),
        (2, {"wrapper": "fsdp2"}, 3, {"wrapper": "fsdp2"}),
        (2, {"wrapper": "ddp"}, 2, {"wrapper": "fsdp2"}),
        (1, {"wrapper": "plain", "compile": True}, 1, {"wrapper": "plain"}),
        (1, {"wrapper": "plain"}, 2, {"wrapper": "ddp", "compile": True}),
        (2, {"wrapper": "fsdp2", "state_dict_type": "full"}, 3, {"wrapper": "fsdp2"}),
        (2, {"wrapper": "fsdp2", "compile": True}, 1, {"wrapper": "plain"}),
        (2, {"wrapper": "fsdp2"}, 3, {"wrapper": "fsdp2", "fast_load": False}),
    ],
    ids=[
        "ddp2-plain1",
        "fsdp2x2-fsdp2x3",
        "ddp2-fsdp2x2",
        "compiled-plain",
        "plain-compiled_ddp2",
        "full_fsdp2x2-fsdp2x3",
        "compiled_fsdp2x2-plain1",
        "fsdp2x2-fsdp2x3_dcp_reader",
    ],
)
def test_cross_wrapper_load(tmp_path, save_ws, save_opts, load_ws, load_opts):
    check_cross_load(tmp_path, save_ws, save_opts, load_ws, load_opts)


def check_cross_load(
    tmp_path,
    save_ws: int,
    save_opts: dict,
    load_ws: int,
    load_opts: dict,
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> None:
    """Train 3 steps and save under ``save_opts`` on ``save_ws`` ranks, load under ``load_opts``
    on ``load_ws`` ranks in fresh processes; assert model and optimizer state bitwise equal."""
    common = {"root": str(tmp_path), "global_batch_size": 12, "steps": 3}
    saved = values(run_ranks(save_after, save_ws, {**common, **save_opts}, backend=backend, timeout_s=timeout_s))[0]
    loaded = values(run_ranks(load_report, load_ws, {**common, **load_opts}, backend=backend, timeout_s=timeout_s))
    assert loaded[0]["state"].step == 3 and loaded[0]["state"].saved_world_size == save_ws
    assert_same_state(saved, loaded[0])
    assert all(r["lr"] == loaded[0]["lr"] for r in loaded)


def train_full_at_end(rank, world_size, opts):
    from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
    from tests.distributed.trainer import build, full_params, train_steps

    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["root"], schedule=ScheduleConfig(interval_steps=2, full_at_end=True)),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
    )
    for step in range(1, 6):
        train_steps(model, optimizer, scheduler, scaler, loader, 1)
        manager.maybe_save(step, last_step=step == 5)
    manager.close()
    return full_params(model)


def test_full_at_end_writes_a_full_final_checkpoint(tmp_path):
    import json

    params = values(
        run_ranks(train_full_at_end, 2, {"root": str(tmp_path), "wrapper": "fsdp2", "global_batch_size": 12})
    )[0]
    kinds = {p.name: json.loads((p / "distckpt.json").read_text())["state_dict_type"] for p in tmp_path.glob("step-*")}
    assert kinds == {"step-000000002": "sharded", "step-000000004": "sharded", "step-000000005": "full"}
    from distckpt._engine import read_dcp_metadata

    def chunks(step):
        md = read_dcp_metadata(tmp_path / f"step-00000000{step}").state_dict_metadata
        return {k: len(v.chunks) for k, v in md.items() if k.startswith("model.") and hasattr(v, "chunks")}

    assert set(chunks(5).values()) == {1}  # one whole tensor per key: FULL
    assert max(chunks(4).values()) == 2  # FSDP2 shards on 2 ranks
    loaded = values(run_ranks(load_report, 1, {"root": str(tmp_path), "wrapper": "plain", "global_batch_size": 12}))[0]
    for k, v in params.items():
        assert torch.equal(v, loaded["params"][k]), k
