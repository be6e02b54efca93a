"""The in-memory `Dataset` container, the loaders' errors and the helpers every loader shares.

A `Dataset` is a whole data set held as two tensors (inputs and labels) plus what a federated run
needs to describe it: class names, the input shape, the normalisation that was applied and, where
the data has one, the natural owner of each sample (a Synthetic user, a FEMNIST writer, a
Shakespeare speaker). Splitting it across clients is the partitioner's job (`partition.py`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Dataset",
    "DatasetError",
    "DatasetNotFound",
    "UnknownDataset",
    "as_index_array",
    "channel_stats_uint8",
    "image_dataset_from_uint8",
    "normalize_uint8",
    "stratified_indices",
    "unknown_keywords",
]

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A data file exists but is malformed (bad magic number, wrong sizes, bad JSON...)."""


class DatasetNotFound(FileNotFoundError):
    """A data file the loader needs is missing; the message says which, where, and how to get it.

    Nothing is ever downloaded: the files must be placed in the directory by the user (or
    installed by the named Debian package).
    """

    def __init__(
        self,
        dataset: str,
        missing: Sequence[str],
        searched: Sequence[str | Path],
        hint: str,
    ) -> None:
        self.dataset = dataset
        self.missing = list(missing)
        self.searched = [str(p) for p in searched]
        self.hint = hint
        where = ", ".join(self.searched)
        files = ", ".join(self.missing)
        super().__init__(f"{dataset}: missing {files} (looked in: {where}). {hint}")

    def __str__(self) -> str:  # FileNotFoundError would otherwise format (errno, strerror)
        return str(self.args[0])


class UnknownDataset(DatasetError, KeyError):
    """`load_dataset` was given a name that is not registered; the message lists the known ones."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = list(known)
        super().__init__(f"unknown dataset {name!r}; known datasets: {', '.join(self.known)}")

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0])


@dataclass(eq=False)
class Dataset:
    """A whole data set in memory.

    `x` is float32 (N, C, H, W) for images or (N, F) for feature vectors, already normalised; for
    text it is int64 (N, T) token ids. `y` is int64 (N,). `normalization` is the per-channel
    {"mean": [...], "std": [...]} that was applied to [0, 1]-scaled inputs, or None when the
    inputs were left as they are. `groups` holds the natural owner id (0..G-1) of every sample
    where the data has owners, else None.
    """

    name: str
    x: torch.Tensor
    y: torch.Tensor
    classes: list[str]
    input_shape: tuple[int, ...]
    normalization: dict[str, list[float]] | None
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise DatasetError(
                f"{self.name}: {self.x.shape[0]} inputs but {self.y.shape[0]} labels"
            )
        if self.y.dtype != torch.int64:
            raise DatasetError(f"{self.name}: labels must be int64, got {self.y.dtype}")
        if tuple(self.x.shape[1:]) != tuple(self.input_shape):
            raise DatasetError(
                f"{self.name}: input_shape {self.input_shape} does not match x.shape[1:] "
                f"{tuple(self.x.shape[1:])}"
            )
        if self.groups is not None and len(self.groups) != len(self.y):
            raise DatasetError(
                f"{self.name}: {len(self.groups)} group ids for {len(self.y)} samples"
            )
        if len(self.y) and (int(self.y.min()) < 0 or int(self.y.max()) >= len(self.classes)):
            raise DatasetError(
                f"{self.name}: labels span {int(self.y.min())}..{int(self.y.max())} but there "
                f"are {len(self.classes)} classes"
            )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: Any) -> Dataset:
        """A new Dataset holding the samples at `indices` (in that order); metadata is kept."""
        idx = as_index_array(indices, len(self))
        t_idx = torch.from_numpy(idx)
        return Dataset(
            name=self.name,
            x=self.x[t_idx],
            y=self.y[t_idx],
            classes=list(self.classes),
            input_shape=tuple(self.input_shape),
            normalization=self.normalization,
            groups=None if self.groups is None else self.groups[idx],
        )


def as_index_array(indices: Any, size: int) -> np.ndarray:
    """`indices` (list, array, tensor, range, bool mask) as int64 numpy indices, range-checked."""
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.dtype == np.bool_:
        if idx.shape != (size,):
            raise IndexError(f"boolean mask of shape {idx.shape} for {size} samples")
        return np.flatnonzero(idx).astype(np.int64)
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
    idx = idx.astype(np.int64).reshape(-1)
    if idx.min() < -size or idx.max() >= size:
        raise IndexError(f"index out of range for {size} samples: {idx.min()}..{idx.max()}")
    return np.where(idx < 0, idx + size, idx)


def stratified_indices(labels: np.ndarray, max_samples: int | None, seed: int) -> np.ndarray:
    """Sorted indices of a seeded random subset of at most `max_samples`, stratified by label.

    Each class keeps its share of the subset (largest-remainder rounding), so small subsets keep
    the class balance of the whole. `None` or a value >= len(labels) keeps everything.
    """
    n = len(labels)
    if max_samples is None or max_samples >= n:
        return np.arange(n, dtype=np.int64)
    if max_samples <= 0:
        raise DatasetError(f"max_samples must be a positive integer or None, got {max_samples}")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * (max_samples / n)
    take = np.floor(quota).astype(np.int64)
    short = max_samples - int(take.sum())
    if short > 0:
        # largest remainders first; ties broken at random so no class is always favoured
        order = np.lexsort((rng.random(len(classes)), -(quota - take)))
        take[order[:short]] += 1
    chosen = [
        rng.choice(np.flatnonzero(labels == c), size=int(k), replace=False)
        for c, k in zip(classes, take, strict=True)
        if k > 0
    ]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


_HIST_ROWS = 4096  # images per histogram slice


def channel_stats_uint8(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Exact per-channel mean and std of uint8 images (N, C, H, W), on the [0, 1] scale.

    Computed from a 256-bin histogram per channel, so it never materialises a float copy of the
    images; the histogram is counted in slices because `np.bincount` widens its input to int64
    (eight bytes per pixel: 440 MB at once for Fashion-MNIST, the loader's peak before).
    """
    if images.dtype != np.uint8 or images.ndim != 4:
        raise DatasetError(f"expected uint8 (N, C, H, W) images, got {images.dtype} {images.shape}")
    values = np.arange(256, dtype=np.float64) / 255.0
    means: list[float] = []
    stds: list[float] = []
    for c in range(images.shape[1]):
        hist = np.zeros(256, dtype=np.float64)
        for start in range(0, len(images), _HIST_ROWS):
            part = images[start : start + _HIST_ROWS, c].reshape(-1)
            hist += np.bincount(part, minlength=256)
        total = hist.sum()
        mean = float((hist * values).sum() / total)
        var = float((hist * (values - mean) ** 2).sum() / total)
        means.append(mean)
        stds.append(max(var, 1e-12) ** 0.5)
    return means, stds


def normalize_uint8(
    images: np.ndarray, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """uint8 (N, C, H, W) → float32 tensor scaled to [0, 1] then normalised per channel."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def image_dataset_from_uint8(
    name: str,
    images: np.ndarray,
    labels: np.ndarray,
    classes: list[str],
    *,
    normalize: bool,
    max_samples: int | None,
    seed: int,
) -> Dataset:
    """Shared tail of the image loaders: stats on the whole pool, subset, scale, normalise.

    The statistics are those of every loaded sample (train and test pooled), computed before
    `max_samples` sub-sampling so the normalisation does not depend on the subset size.
    """
    mean, std = channel_stats_uint8(images)
    keep = stratified_indices(labels, max_samples, seed)
    if len(keep) < len(labels):
        images, labels = images[keep], labels[keep]
    if normalize:
        x = normalize_uint8(images, mean, std)
        norm: dict[str, list[float]] | None = {"mean": mean, "std": std}
    else:
        x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
        norm = None
    y = torch.from_numpy(labels.astype(np.int64))
    logger.info("loaded %s: %d samples, shape %s", name, len(y), tuple(x.shape[1:]))
    return Dataset(
        name=name,
        x=x,
        y=y,
        classes=classes,
        input_shape=tuple(x.shape[1:]),
        normalization=norm,
    )


def unknown_keywords(fn: Callable[..., Any], given: Iterable[str]) -> tuple[list[str], list[str]]:
    """(given names `fn` does not take as keyword-only arguments, the ones it takes)."""
    accepted = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    return sorted(set(given) - set(accepted)), accepted
