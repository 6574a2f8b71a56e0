import pytest
import torch
from safetensors.torch import save_file

from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
from distckpt._tools.export import import_weights
from tests.distributed.trainer import Net, build, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_import_into_full_training_state(tmp_path, caplog):
    torch.manual_seed(7)
    weights = Net().state_dict()
    save_file(weights, tmp_path / "w.safetensors")
    import_weights(tmp_path / "w.safetensors", tmp_path / "root")
    model, opt, sched, scaler, loader = build(0, 1, {})
    m = CheckpointManager(
        CheckpointConfig(root=str(tmp_path / "root"), schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        grad_scaler=scaler,
        dataloader=loader,
        extra_state={"x": 1},
    )
    with caplog.at_level("WARNING"):
        st = m.load()
    assert "model weights only" in caplog.text and "optimizer, lr_scheduler" in caplog.text
    assert st.step == 0 and not opt.state
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    train_steps(model, opt, sched, scaler, loader, 2)
    assert [s["step"].item() for s in opt.state.values()] == [2.0] * len(opt.state)
    m.save(2)
    m.close()
    model2, opt2, sched2, scaler2, loader2 = build(0, 1, {})
    m2 = CheckpointManager(
        CheckpointConfig(root=str(tmp_path / "root")),
        model=model2,
        optimizer=opt2,
        lr_scheduler=sched2,
        grad_scaler=scaler2,
        dataloader=loader2,
        extra_state={"x": 1},
    )
    assert m2.load().step == 2 and len(opt2.state) == len(opt.state)
    m2.close()
