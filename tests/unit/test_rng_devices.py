"""CUDA RNG follows the rank's device, not its visible index (issue 35, item 8), checked on CPU
with a stand-in for ``torch.cuda`` that maps visible indices to physical devices (the real
thing: tests/gpu/test_resume_gpu.py)."""

import io

import pytest
import torch

from distckpt._state.rng import capture_rng, restore_rng


class FakeCuda:
    """``visible``: the physical devices this process sees, in visible-index order (its
    ``CUDA_VISIBLE_DEVICES``); ``generators``: each physical device's RNG state."""

    def __init__(self, monkeypatch, generators: dict[str, torch.Tensor], visible: list[str], current: int) -> None:
        self.generators, self.visible, self.current = generators, visible, current
        for name in ("is_available", "device_count", "current_device", "get_rng_state", "set_rng_state"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.get_rng_state(i) for i in range(2)])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_rng_state_all)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.visible)

    def current_device(self) -> int:
        return self.current

    def _index(self, device) -> int:
        index = (
            self.current if device == "cuda" else torch.device(device, 0).index if isinstance(device, str) else device
        )
        assert 0 <= index < len(self.visible), f"no visible device {device}"
        return index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.generators[self.visible[self._index(device)]].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.generators[self.visible[self._index(device)]] = state.clone()

    def set_rng_state_all(self, states) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def _round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_the_ranks_device_state_lands_on_its_device_under_another_visible_order(monkeypatch):
    x, y = torch.tensor([1, 1, 1], dtype=torch.uint8), torch.tensor([2, 2, 2], dtype=torch.uint8)
    # At save the rank sees GPUs X and Y and runs on Y (visible index 1).
    FakeCuda(monkeypatch, {"X": x, "Y": y}, ["X", "Y"], current=1)
    saved = _round_trip(capture_rng())
    # At resume its CUDA_VISIBLE_DEVICES is Y alone: Y is index 0 and must get Y's stream.
    fresh = {"X": torch.zeros(3, dtype=torch.uint8), "Y": torch.zeros(3, dtype=torch.uint8)}
    FakeCuda(monkeypatch, fresh, ["Y"], current=0)
    restore_rng(saved)
    assert torch.equal(fresh["Y"], y)
    assert torch.equal(fresh["X"], torch.zeros(3, dtype=torch.uint8))  # untouched
    # Another order (an elastic remap: the rank now on X, visible index 1 of [Y, X]): X gets it.
    fresh = {"X": torch.zeros(3, dtype=torch.uint8), "Y": torch.zeros(3, dtype=torch.uint8)}
    FakeCuda(monkeypatch, fresh, ["Y", "X"], current=1)
    restore_rng(saved)
    assert torch.equal(fresh["X"], y) and torch.equal(fresh["Y"], torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("visible", [["X", "Y"], ["X"]])
def test_an_older_snapshots_per_index_states_still_restore(monkeypatch, visible):
    old = {"X": torch.tensor([5], dtype=torch.uint8), "Y": torch.tensor([6], dtype=torch.uint8)}
    snapshot = capture_rng()  # CPU part of a real snapshot
    snapshot.pop("cuda_device", None)
    snapshot["cuda"] = [old["X"], old["Y"]]  # the layout before: one state per visible index
    fresh = {"X": torch.zeros(1, dtype=torch.uint8), "Y": torch.zeros(1, dtype=torch.uint8)}
    FakeCuda(monkeypatch, fresh, visible, current=0)
    restore_rng(_round_trip(snapshot))
    assert [fresh[d].item() for d in ("X", "Y")] == [5, 6 if len(visible) == 2 else 0]


def test_an_in_process_snapshot_restores_every_device(monkeypatch):
    """The loss probe's snapshot (``every_device``): the same process puts every device back."""
    gens = {"X": torch.tensor([1], dtype=torch.uint8), "Y": torch.tensor([2], dtype=torch.uint8)}
    cuda = FakeCuda(monkeypatch, gens, ["X", "Y"], current=0)
    snapshot = capture_rng(every_device=True)
    cuda.generators = {"X": torch.tensor([7], dtype=torch.uint8), "Y": torch.tensor([8], dtype=torch.uint8)}
    restore_rng(snapshot)
    assert [cuda.generators[d].item() for d in ("X", "Y")] == [1, 2]
    assert "cuda" not in capture_rng()  # a checkpoint's snapshot: the current device alone
