"""Every test under tests/gpu is marked ``gpu`` and skipped with reason "no CUDA" when
``torch.cuda.is_available()`` is false, so ``pytest tests/gpu`` on a CPU machine reports skips
and the default suite (``-m "not slow and not gpu"``) deselects them."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="no CUDA")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
