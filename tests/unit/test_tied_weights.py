"""Tied weights: a checkpoint that lacks a key the live model ties to a saved key (Hugging Face
``save_pretrained`` drops ``lm_head.weight`` when it is the input embedding) loads from the twin."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from distckpt import CheckpointConfig, CheckpointManager, IncompatibleCheckpointError
from distckpt._tools.export import import_weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TinyLM(nn.Module):
    """Embedding -> linear -> output head; ``tied``: the head's weight is the embedding's."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        if tied:
            self.lm_head = nn.Linear(8, 32, bias=False)
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(ids))
        return self.lm_head(h) if hasattr(self, "lm_head") else h @ self.embed.weight.T


def test_tied_keys_groups_one_tensor_under_every_name():
    from distckpt._adapters import tied_keys

    assert tied_keys(TinyLM()) == {"embed.weight": ["lm_head.weight"], "lm_head.weight": ["embed.weight"]}
    assert tied_keys(TinyLM(tied=False)) == {}


def test_import_of_a_file_without_the_tied_head_loads_it_from_the_embedding(tmp_path):
    torch.manual_seed(1)
    source = TinyLM()
    # As save_pretrained writes it: the tied lm_head.weight is left out.
    weights = {k: v.clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, tmp_path / "model.safetensors")
    import_weights(tmp_path / "model.safetensors", tmp_path / "root")
    torch.manual_seed(2)
    model = TinyLM()
    with CheckpointManager(CheckpointConfig(root=str(tmp_path / "root")), model=model, optimizer=None) as manager:
        assert manager.load().step == 0
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert model.lm_head.weight is model.embed.weight  # still tied
    ids = torch.tensor([[1, 5, 7]])
    assert torch.equal(model(ids), source(ids))


def test_normal_load_of_a_checkpoint_without_the_tied_key(tmp_path):
    # A run whose model computes the head from the embedding (no lm_head key) saves with AdamW...
    torch.manual_seed(3)
    source = TinyLM(tied=False)
    optimizer = torch.optim.AdamW(source.parameters(), lr=0.01)
    source(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=source, optimizer=optimizer) as manager:
        manager.save(1)
    # ...and the tied architecture resumes from it, optimizer state included.
    torch.manual_seed(4)
    model = TinyLM()
    optimizer2 = torch.optim.AdamW(model.parameters(), lr=0.01)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=model, optimizer=optimizer2) as manager:
        assert manager.load().step == 1
    assert torch.equal(model.lm_head.weight, source.embed.weight) and model.lm_head.weight is model.embed.weight
    assert torch.equal(model.proj.weight, source.proj.weight)
    assert torch.equal(optimizer2.state[model.embed.weight]["exp_avg"], optimizer.state[source.embed.weight]["exp_avg"])


def test_untied_missing_key_is_still_an_error(tmp_path):
    # Only a tie excuses a missing key: an untied model missing a saved key still fails.
    class Untied(TinyLM):
        def __init__(self) -> None:
            super().__init__(tied=False)
            self.lm_head = nn.Linear(8, 32, bias=False)

    save_file(
        {k: v.clone() for k, v in TinyLM().state_dict().items() if k != "lm_head.weight"},
        tmp_path / "model.safetensors",
    )
    import_weights(tmp_path / "model.safetensors", tmp_path / "root")
    with CheckpointManager(CheckpointConfig(root=str(tmp_path / "root")), model=Untied(), optimizer=None) as manager:
        with pytest.raises(IncompatibleCheckpointError, match="missing in checkpoint: lm_head.weight"):
            manager.load()
