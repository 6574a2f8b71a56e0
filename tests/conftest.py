import os
import sys
import time

import pytest

# `launch` is a top-level folder, not an installed package: make it importable in tests.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_FIRST = os.path.join(ROOT, "tests", "integration")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: ``-n 2 --dist worksteal``) the torchrun-heavy
    integration tests come first: the scheduler gives each worker one half of the list and a
    worker that runs out takes from the end of the other's, so they run one after another on
    one worker, started first, while the other worker takes the rest."""
    if hasattr(config, "workerinput"):  # an xdist worker (every worker sorts the same way)
        items.sort(key=lambda item: not str(item.path).startswith(_FIRST))  # stable


@pytest.fixture
def slow_memory_copy(monkeypatch):
    """``slow_memory_copy(seconds)``: the memory tier's background copy of a snapshot's tensors
    sleeps that long first, so the next step would overtake it unless something waits for it."""
    from distckpt._memory import tier

    real = tier._copy_tensors

    def slow(seconds: float) -> None:
        def copy(slot, data, event):
            if data:  # the deferred copy, on the tier's worker thread
                time.sleep(seconds)
            real(slot, data, event)

        monkeypatch.setattr(tier, "_copy_tensors", copy)

    return slow
