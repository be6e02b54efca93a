"""Data sets that need no files: scikit-learn's `digits` and the Synthetic(α, β) generator.

Synthetic(α, β) is the FedProx / pFedMe generator used by PFML: every user k has its own
softmax-regression model and its own input distribution,

    u_k ~ N(0, α),  W_k ~ N(u_k, 1) (60 x 10),  b_k ~ N(u_k, 1) (10),
    B_k ~ N(0, β),  v_k ~ N(B_k, 1) (60),  x ~ N(v_k, Σ) with Σ = diag(j^-1.2), j = 1..60,
    y = argmax softmax(W_k^T x + b_k),

with `(int(lognormal(4, 2)) + 50) * 5` samples for user k. The draws come from one legacy
`numpy.random.RandomState(seed)` in pFedMe's order (sizes, u, B, all v, then per user W, b, x),
so a seed gives the same data set as pFedMe's script seeded with it.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .base import Dataset, DatasetError, stratified_indices

__all__ = ["load_digits", "load_synthetic", "synthetic_arrays"]

logger = logging.getLogger(__name__)


def load_digits(
    *,
    size: int = 28,
    max_samples: int | None = None,
    seed: int = 0,
    normalize: bool = True,
) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes) as (N, 1, size, size).

    Pixel values 0..16 are scaled to [0, 1]; `size` other than 8 resizes with bilinear
    interpolation (28 by default, so the MNIST conv nets take it). With `normalize`, the mean and
    std of the resized [0, 1] images are applied and recorded.
    """
    if not isinstance(size, int) or size < 1:
        raise DatasetError(f"digits: size must be a positive integer (8, 28, 32...), got {size!r}")
    pixels, labels = _digits_arrays()
    keep = stratified_indices(labels, max_samples, seed)
    images = pixels[keep].reshape(-1, 1, 8, 8) / 16.0
    x = torch.from_numpy(images)
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        x = x.clamp_(0.0, 1.0)
    norm: dict[str, list[float]] | None = None
    if normalize:
        mean, std = float(x.mean()), float(x.std(unbiased=False))
        x = (x - mean) / max(std, 1e-12)
        norm = {"mean": [mean], "std": [std]}
    return Dataset(
        name="digits",
        x=x.contiguous(),
        y=torch.from_numpy(labels[keep]),
        classes=[str(d) for d in range(10)],
        input_shape=tuple(x.shape[1:]),
        normalization=norm,
    )


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as float32 pixels (N, 64), 0..16, and int64 labels (N,).

    Read from the CSV scikit-learn bundles (never downloaded), without importing scikit-learn:
    its import costs most of a second, which every `edgefl` process on digits paid before it
    trained (the demo's devices, a deployment's clients). Where the file is not at its place
    in the installed package, scikit-learn's own loader reads it."""
    spec = importlib.util.find_spec("sklearn")
    roots = spec.submodule_search_locations if spec is not None else None
    path = Path(next(iter(roots))) / "datasets" / "data" / "digits.csv.gz" if roots else None
    if path is not None and path.is_file():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return np.ascontiguousarray(table[:, :-1]), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as _sk_load_digits  # bundled: never downloads

    bunch = _sk_load_digits()
    return np.asarray(bunch.data, dtype=np.float32), np.asarray(bunch.target, dtype=np.int64)


def synthetic_arrays(
    alpha: float = 0.5,
    beta: float = 0.5,
    *,
    num_users: int = 100,
    num_features: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    iid: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The raw Synthetic(α, β) arrays: x float64 (N, F), y int64 (N,), user id int64 (N,).

    With `iid`, every user shares one model (W, b ~ N(0, 1)) and v_k = B_k·1, as in the FedProx
    iid variant; the per-user W, b are still drawn (and discarded) to keep the draw order.
    """
    if num_users < 1 or num_features < 1 or num_classes < 2:
        raise DatasetError(
            "synthetic: need num_users >= 1, num_features >= 1 and num_classes >= 2, got "
            f"{num_users}, {num_features}, {num_classes}"
        )
    if alpha < 0 or beta < 0:
        raise DatasetError(f"synthetic: alpha and beta must be >= 0, got {alpha}, {beta}")
    rng = np.random.RandomState(seed)
    # 1. samples per user
    sizes = (rng.lognormal(4, 2, num_users).astype(int) + 50) * 5
    # 2. priors: u_k (mean of W_k and b_k) and B_k (mean of v_k)
    mean_w = rng.normal(0, alpha, num_users)
    big_b = rng.normal(0, beta, num_users)
    cov_x = np.diag(np.power(np.arange(1, num_features + 1, dtype=np.float64), -1.2))
    # 3. every v_k before any user's model
    mean_x = np.zeros((num_users, num_features))
    for k in range(num_users):
        if iid:
            mean_x[k] = np.ones(num_features) * big_b[k]
        else:
            mean_x[k] = rng.normal(big_b[k], 1, num_features)
    if iid:
        w_global = rng.normal(0, 1, (num_features, num_classes))
        b_global = rng.normal(0, 1, num_classes)
    # 4. per user: W_k, b_k, then its samples
    xs, ys = [], []
    for k in range(num_users):
        w = rng.normal(mean_w[k], 1, (num_features, num_classes))
        b = rng.normal(mean_w[k], 1, num_classes)
        if iid:
            w, b = w_global, b_global
        xx = rng.multivariate_normal(mean_x[k], cov_x, int(sizes[k]))  # (n_k, F)
        # argmax of softmax(z) is argmax of z: the softmax is skipped (it can overflow)
        ys.append(np.argmax(xx @ w + b, axis=1).astype(np.int64))
        xs.append(xx)
    groups = np.repeat(np.arange(num_users, dtype=np.int64), sizes)
    return np.concatenate(xs), np.concatenate(ys), groups


def load_synthetic(
    *,
    alpha: float = 0.5,
    beta: float = 0.5,
    num_users: int = 100,
    num_features: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    iid: bool = False,
    max_samples: int | None = None,
) -> Dataset:
    """Synthetic(α, β) as a Dataset: x float32 (N, 60), not normalised; groups = user id.

    `max_samples` sub-samples after generation (stratified by class, seeded with `seed`), so the
    generated users are the same with or without it.
    """
    x, y, groups = synthetic_arrays(
        alpha,
        beta,
        num_users=num_users,
        num_features=num_features,
        num_classes=num_classes,
        seed=seed,
        iid=iid,
    )
    keep = stratified_indices(y, max_samples, seed)
    if len(keep) < len(y):
        x, y, groups = x[keep], y[keep], groups[keep]
    logger.info("generated synthetic(%s, %s): %d samples, %d users", alpha, beta, len(y), num_users)
    tx = torch.from_numpy(x.astype(np.float32))
    return Dataset(
        name="synthetic",
        x=tx,
        y=torch.from_numpy(y),
        classes=[str(c) for c in range(num_classes)],
        input_shape=tuple(tx.shape[1:]),
        normalization=None,
        groups=groups,
    )
