import sys
from pathlib import Path

import pytest
import torch

# tests import their shared helpers module directly
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
