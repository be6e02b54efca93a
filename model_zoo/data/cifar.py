"""CIFAR-10 and CIFAR-100 from the "python version" pickle batches.

The batches are Python pickles by format, so loading one runs the unpickler on the file. That is
acceptable only because the file is a local one the user chose to place there (nothing is
downloaded), and even so the unpickler here is restricted: it resolves only the few numpy globals
an array needs and refuses anything else, so a tampered file cannot run code on load.

Layout: CIFAR-10 `data_batch_1`..`data_batch_5`, `test_batch`, `batches.meta` in
`<root>/cifar-10-batches-py/` or directly in `<root>`; CIFAR-100 `train`, `test`, `meta` in
`<root>/cifar-100-python/` or directly in `<root>`. Train and test are pooled into one Dataset.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .base import Dataset, DatasetError, DatasetNotFound, image_dataset_from_uint8

__all__ = ["CIFAR10_FILES", "CIFAR100_FILES", "load_cifar10", "load_cifar100", "read_cifar_pickle"]

logger = logging.getLogger(__name__)

CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
CIFAR100_FILES = ("train", "test", "meta")

# The globals a pickled numpy array may reference (numpy 1.x and 2.x module names).
_ALLOWED_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise DatasetError(
            f"refusing to unpickle {module}.{name}: a CIFAR batch holds only dicts, lists, bytes "
            "and numpy arrays"
        )


def read_cifar_pickle(path: str | Path) -> dict[bytes, Any]:
    """One CIFAR batch file as the dict it pickles (keys are bytes, e.g. b"data")."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            obj = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except DatasetError as exc:
        raise DatasetError(f"{path}: {exc}") from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise DatasetError(f"{path}: not a readable CIFAR pickle ({exc})") from exc
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.encode() if isinstance(k, str) else k: v for k, v in obj.items()}


def _field(batch: dict[bytes, Any], key: bytes, path: Path) -> Any:
    if key not in batch:
        keys = ", ".join(repr(k) for k in batch)
        raise DatasetError(f"{path}: no {key!r} entry (entries: {keys})")
    return batch[key]


def _names(values: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _images(batch: dict[bytes, Any], path: Path) -> np.ndarray:
    data = np.asarray(_field(batch, b"data", path))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DatasetError(
            f"{path}: b'data' must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}"
        )
    return data.reshape(-1, 3, 32, 32)


def _locate(root: Path, subdir: str, files: tuple[str, ...], name: str, hint: str) -> Path:
    candidates = [root / subdir, root]
    for directory in candidates:
        if all((directory / f).is_file() for f in files):
            return directory
    # Report the files missing from the candidate that has most of them.
    best = max(candidates, key=lambda d: sum((d / f).is_file() for f in files))
    missing = [f for f in files if not (best / f).is_file()]
    raise DatasetNotFound(name, missing, candidates, hint)


def _read_batches(
    directory: Path, files: list[str], label_key: bytes, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for fname in files:
        path = directory / fname
        batch = read_cifar_pickle(path)
        imgs = _images(batch, path)
        labs = np.asarray(_field(batch, label_key, path), dtype=np.int64).reshape(-1)
        if len(labs) != len(imgs):
            raise DatasetError(f"{path}: {len(imgs)} images but {len(labs)} labels")
        if len(labs) and (labs.min() < 0 or labs.max() >= num_classes):
            raise DatasetError(
                f"{path}: labels span {labs.min()}..{labs.max()}, outside 0..{num_classes - 1}"
            )
        images.append(imgs)
        labels.append(labs)
    return np.concatenate(images), np.concatenate(labels)


def load_cifar10(
    root: str | Path,
    *,
    max_samples: int | None = None,
    seed: int = 0,
    normalize: bool = True,
) -> Dataset:
    """CIFAR-10, 60 000 images (train + test pooled), (N, 3, 32, 32), 10 classes."""
    root = Path(root)
    hint = (
        "Nothing is downloaded: extract cifar-10-python.tar.gz so that "
        f"{root}/cifar-10-batches-py/ holds {', '.join(CIFAR10_FILES)}."
    )
    directory = _locate(root, "cifar-10-batches-py", CIFAR10_FILES, "cifar10", hint)
    meta_path = directory / "batches.meta"
    classes = _names(_field(read_cifar_pickle(meta_path), b"label_names", meta_path))
    images, labels = _read_batches(directory, list(CIFAR10_FILES[:-1]), b"labels", len(classes))
    return image_dataset_from_uint8(
        "cifar10", images, labels, classes, normalize=normalize, max_samples=max_samples, seed=seed
    )


def load_cifar100(
    root: str | Path,
    *,
    label: Literal["fine", "coarse"] = "fine",
    max_samples: int | None = None,
    seed: int = 0,
    normalize: bool = True,
) -> Dataset:
    """CIFAR-100, 60 000 images (train + test pooled), (N, 3, 32, 32), 100 fine or 20 coarse
    classes (`label`)."""
    if label not in ("fine", "coarse"):
        raise DatasetError(f"cifar100: label must be 'fine' or 'coarse', got {label!r}")
    root = Path(root)
    hint = (
        "Nothing is downloaded: extract cifar-100-python.tar.gz so that "
        f"{root}/cifar-100-python/ holds {', '.join(CIFAR100_FILES)}."
    )
    directory = _locate(root, "cifar-100-python", CIFAR100_FILES, "cifar100", hint)
    meta_path = directory / "meta"
    meta = read_cifar_pickle(meta_path)
    classes = _names(_field(meta, f"{label}_label_names".encode(), meta_path))
    images, labels = _read_batches(
        directory, ["train", "test"], f"{label}_labels".encode(), len(classes)
    )
    return image_dataset_from_uint8(
        "cifar100", images, labels, classes, normalize=normalize, max_samples=max_samples, seed=seed
    )
