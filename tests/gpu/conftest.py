from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    """Every test in this folder is a GPU test, skipped where CUDA is absent (CI and the CPU
    development machines)."""
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs an NVIDIA GPU: CUDA is not available here"))
