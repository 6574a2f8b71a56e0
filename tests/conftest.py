import os
import sys

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
