"""Misuse in one process: torchrun without a process group, configs without root, export into a
missing directory, and which option the overwrite error names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    ConfigError,
    CoordinationConfig,
    ManagerClosedError,
    ScheduleConfig,
)
from distckpt._cli import main
from distckpt._tools.export import export_checkpoint
from tests.distributed.trainer import Net

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_torchrun_without_init_process_group_is_refused(tmp_path, monkeypatch):
    # What torchrun --nproc-per-node 2 sets; the script forgot init_process_group.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config = CheckpointConfig(root=str(tmp_path / "ckpt"), schedule=ScheduleConfig(interval_steps=None))
    with pytest.raises(ConfigError, match="init_process_group") as err:
        CheckpointManager(config, model=Net(), optimizer=None)
    assert "WORLD_SIZE=2" in str(err.value) and "process_group=" in str(err.value)
    assert not (tmp_path / "ckpt").exists()  # refused before touching the root
    # A one-process torchrun job (WORLD_SIZE=1) is a single process: allowed.
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with CheckpointManager(config, model=Net(), optimizer=None) as manager:
        assert manager.world_size == 1 and Path(manager.save(1)).is_dir()


@pytest.mark.parametrize("call", ["save", "maybe_save", "load", "wait"])
def test_a_closed_manager_names_the_call_and_what_to_do(tmp_path, call):
    model = Net()
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=None) as manager:
        manager.save(1)
    args = (2,) if call in ("save", "maybe_save") else ()
    with pytest.raises(ManagerClosedError) as err:
        getattr(manager, call)(*args)
    assert isinstance(err.value, RuntimeError)  # what it raised before: handlers of it keep working
    message = str(err.value)
    assert str(tmp_path) in message and f"{call}(" in message and "build a new CheckpointManager" in message


def test_yaml_without_root_names_the_missing_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  schedule: {interval_steps: 5}\n")
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['root'\]") as err:
        CheckpointConfig.from_yaml(path)
    assert str(path) in str(err.value)
    path.write_text("checkpoint:\n  root:\n")  # present but empty (None)
    with pytest.raises(ConfigError, match="root=None"):
        CheckpointConfig.from_yaml(path)


def _checkpoint(tmp_path):
    model = Net()
    with CheckpointManager(
        CheckpointConfig(root=str(tmp_path / "ckpt"), schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=None,
    ) as manager:
        return manager.save(1), model


def test_export_into_a_missing_directory_fails_before_reading(tmp_path, capsys):
    ckpt, _ = _checkpoint(tmp_path)
    out = tmp_path / "absent" / "w.safetensors"
    with pytest.raises(FileNotFoundError, match=f"output directory {tmp_path / 'absent'} does not exist"):
        export_checkpoint(ckpt, out, progress=True)
    assert not (tmp_path / "absent").exists()
    code = main(["export", str(ckpt), str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1  # one line: no progress bar before it
    assert "output directory" in err and "tmp-" not in err


def test_overwrite_error_names_only_the_option_of_its_context(tmp_path, capsys):
    ckpt, model = _checkpoint(tmp_path)
    out = tmp_path / "w.safetensors"
    export_checkpoint(ckpt, out, model_only=True)
    with pytest.raises(FileExistsError) as err:
        export_checkpoint(ckpt, out, model_only=True)
    assert "overwrite=True" in str(err.value) and "--force" not in str(err.value)
    assert main(["export", str(ckpt), str(out), "--model-only"]) == 2
    err_line = capsys.readouterr().err
    assert "--force" in err_line and "overwrite=True" not in err_line
    assert main(["export", str(ckpt), str(out), "--model-only", "--force", "--no-progress"]) == 0
    loaded = load_file(out)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_arrival_timeout_defaults_to_the_group_timeout_and_stays_within_it():
    assert CoordinationConfig(timeout_s=60.0).effective_arrival_timeout_s == 60.0
    assert CoordinationConfig(arrival_timeout_s=5.0).effective_arrival_timeout_s == 5.0
    assert CoordinationConfig(arrival_timeout_s=600.0).effective_arrival_timeout_s == 600.0
    for bad in (0, -1.0, 600.5, float("nan")):
        with pytest.raises(ConfigError, match="arrival_timeout_s"):
            CheckpointConfig(root="/tmp/x", coordination=CoordinationConfig(arrival_timeout_s=bad))


def test_liveness_timeout_defaults_to_a_minute_and_may_be_turned_off():
    assert CoordinationConfig().liveness_timeout_s == 60.0
    assert CoordinationConfig(liveness_timeout_s=None).liveness_timeout_s is None
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="coordination.liveness_timeout_s"):
            CoordinationConfig(liveness_timeout_s=bad)
    with pytest.raises(ConfigError, match="coordination.liveness_timeout_s"):  # not a top-level key
        CheckpointConfig(root="/tmp/x", liveness_timeout_s=5)  # type: ignore[call-arg]


def _config(tmp_path) -> CheckpointConfig:
    return CheckpointConfig(root=str(tmp_path / "ckpt"), schedule=ScheduleConfig(interval_steps=None))


def test_an_optimizer_of_another_model_is_refused_at_construction(tmp_path):
    model, other = Net(), Net()
    with pytest.raises(ConfigError, match=r"6 of the optimizer's 6 parameters are not parameters of the model") as err:
        CheckpointManager(_config(tmp_path), model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    assert "built from this model's parameters" in str(err.value)
    assert not (tmp_path / "ckpt").exists()  # refused before touching the root
    mixed = torch.optim.SGD([{"params": model.inp.parameters()}, {"params": other.out.parameters()}], lr=0.1)
    with pytest.raises(ConfigError, match=r"2 of the optimizer's 4 parameters are not parameters of the model"):
        CheckpointManager(_config(tmp_path), model=model, optimizer=mixed)
    # Its own parameters (some of them, or through torch.compile's wrapper) are fine.
    partial = torch.optim.Adam(model.out.parameters())
    with CheckpointManager(_config(tmp_path), model=torch.compile(model), optimizer=partial) as manager:
        assert Path(manager.save(1)).is_dir()


def test_a_step_that_is_not_an_int_is_a_type_error_naming_it(tmp_path):
    with CheckpointManager(_config(tmp_path), model=Net(), optimizer=None) as manager:
        for call in (manager.save, manager.maybe_save):
            for bad in ("3", True, 2.0):
                with pytest.raises(
                    TypeError, match=rf"{call.__name__}\(step=.*\): step must be an int .*got {type(bad).__name__}"
                ):
                    call(bad)
        assert not list((tmp_path / "ckpt").glob("step-*"))  # nothing was written
        assert Path(manager.save(3)).name.endswith("3")  # the manager is still usable


def test_a_model_that_is_not_a_module_is_a_type_error_naming_its_type(tmp_path):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module .*got dict"):
        CheckpointManager(_config(tmp_path), model={"w": torch.zeros(2)}, optimizer=None)  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()
