import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests_helpers


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)
