"""The benchmark's inputs: real images and text, split into train and test, saying whence.

Nothing is downloaded. Images: Fashion-MNIST from its IDX files (train files to train and
calibrate, t10k files to test), or scikit-learn's digits when they are absent. Text: LEAF's
Shakespeare when installed, else the English licence texts that Debian-based systems ship in
/usr/share/common-licenses, cut into 80-character windows over LEAF's vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model_zoo.data import SHAKESPEARE_VOCAB, DatasetNotFound, default_root, load_dataset

__all__ = ["CHAR_SEQ_LEN", "LICENSE_DIR", "BenchData", "image_data", "text_data"]

logger = logging.getLogger(__name__)

LICENSE_DIR = Path("/usr/share/common-licenses")
CHAR_SEQ_LEN = 80  # LEAF's Shakespeare window


@dataclass(frozen=True)
class BenchData:
    """Train and test tensors of one benchmark input, and where they came from."""

    name: str
    description: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: list[str]
    normalization: dict[str, list[float]] | None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, round(n * test_fraction))
    return order[n_test:], order[:n_test]


def image_data(root: str | Path | None = None, *, seed: int = 0) -> BenchData:
    """Fashion-MNIST (train files to train, t10k files to test), else digits, saying which."""
    try:
        ds = load_dataset("fashion_mnist", root)
    except DatasetNotFound as exc:
        logger.warning("Fashion-MNIST not found, using scikit-learn's digits: %s", exc)
        digits = load_dataset("digits", size=28, seed=seed)
        train, test = _split(len(digits), 0.2, seed)
        return BenchData(
            name="digits",
            description=(
                "scikit-learn digits (8x8 upscaled to 28x28), a seeded 80/20 train/test split: "
                f"Fashion-MNIST is not installed ({exc})"
            ),
            x_train=digits.x[train],
            y_train=digits.y[train],
            x_test=digits.x[test],
            y_test=digits.y[test],
            classes=digits.classes,
            normalization=digits.normalization,
        )
    if len(ds) != 70000:
        raise ValueError(
            f"expected the 60000 + 10000 images of Fashion-MNIST's train and t10k files, "
            f"found {len(ds)}: point --data-root at the standard files"
        )
    # The loader pools the train files, then the t10k files, in file order.
    return BenchData(
        name="fashion_mnist",
        description="Fashion-MNIST: train files for training and calibration, t10k for accuracy",
        x_train=ds.x[:60000],
        y_train=ds.y[:60000],
        x_test=ds.x[60000:],
        y_test=ds.y[60000:],
        classes=ds.classes,
        normalization=ds.normalization,
    )


_CHAR_ID = {c: i for i, c in enumerate(SHAKESPEARE_VOCAB)}


def _windows(ids: np.ndarray, count: int, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    available = len(ids) - CHAR_SEQ_LEN
    starts = rng.choice(available, size=min(count, available), replace=False)
    starts = np.sort(starts)
    x = np.stack([ids[s : s + CHAR_SEQ_LEN] for s in starts])
    y = ids[starts + CHAR_SEQ_LEN]
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))


def text_data(samples: int, *, seed: int = 0, license_dir: Path = LICENSE_DIR) -> BenchData | None:
    """Next-character windows of 80 characters over LEAF's 80-character vocabulary.

    LEAF's Shakespeare when installed; else the licence texts in `license_dir` (the first 85%
    of the text trains, the last 15% tests); None when neither exists.
    """
    root = default_root("shakespeare")
    ds = None
    if root is not None and root.is_dir():
        with contextlib.suppress(DatasetNotFound):
            ds = load_dataset("shakespeare", max_samples=2 * samples, seed=seed)
    if ds is not None:
        train, test = _split(len(ds), 0.5, seed)
        return BenchData(
            name="shakespeare",
            description="LEAF Shakespeare, a seeded 50/50 split of a stratified subset",
            x_train=ds.x[train],
            y_train=ds.y[train],
            x_test=ds.x[test],
            y_test=ds.y[test],
            classes=ds.classes,
            normalization=None,
        )
    files = sorted({p.resolve() for p in license_dir.glob("*") if p.is_file()})
    if not files:
        return None
    text = "\n".join(p.read_text(encoding="utf-8", errors="ignore") for p in files)
    text = re.sub(r"[ \t\r\f\v]+", " ", text)
    ids = np.array([_CHAR_ID[c] for c in text if c in _CHAR_ID], dtype=np.int64)
    cut = int(len(ids) * 0.85)
    rng = np.random.default_rng(seed)
    x_train, y_train = _windows(ids[:cut], samples, rng)
    x_test, y_test = _windows(ids[cut:], samples, rng)
    return BenchData(
        name="licence texts",
        description=(
            f"English licence texts from {license_dir} ({len(files)} files, {len(ids)} "
            "characters; LEAF Shakespeare is not installed): windows from the first 85% train, "
            "from the last 15% test"
        ),
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        classes=list(SHAKESPEARE_VOCAB),
        normalization=None,
    )
