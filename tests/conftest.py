import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests_helpers


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def real_images() -> dict[str, Any]:
    """Real labelled images, split as published: Fashion-MNIST's train and t10k files when
    installed, else a seeded 80/20 split of scikit-learn's digits (28x28); `name` says which."""
    from model_zoo.data import DatasetNotFound, load_dataset

    try:
        ds = load_dataset("fashion_mnist")
    except DatasetNotFound:
        ds = load_dataset("digits", size=28)
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
        train, test = order[len(ds) // 5 :], order[: len(ds) // 5]
        return {
            "name": "digits",
            "x_train": ds.x[train],
            "y_train": ds.y[train],
            "x_test": ds.x[test],
            "y_test": ds.y[test],
        }
    # The loader pools the 60000 train images first, then the 10000 t10k (test) images.
    return {
        "name": "fashion_mnist",
        "x_train": ds.x[:60000],
        "y_train": ds.y[:60000],
        "x_test": ds.x[60000:],
        "y_test": ds.y[60000:],
    }
