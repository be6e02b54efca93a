"""MNIST and Fashion-MNIST from their IDX files (raw or gzip), parsed with numpy.

IDX layout (big-endian): two zero bytes, a type byte (0x08 = unsigned byte), a byte giving the
number of dimensions, one uint32 per dimension, then the data. Images have magic 2051 (0x0803,
three dimensions), labels 2049 (0x0801, one dimension). The train and test files are pooled into
one Dataset: clients get their own train/val/test splits from the partitioner.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from pathlib import Path

import numpy as np

from .base import Dataset, DatasetError, DatasetNotFound, image_dataset_from_uint8

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DEFAULT_ROOT",
    "IDX_FILES",
    "IMAGES_MAGIC",
    "LABELS_MAGIC",
    "load_fashion_mnist",
    "load_mnist",
    "read_idx",
]

logger = logging.getLogger(__name__)

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
IDX_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)
FASHION_MNIST_DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
MNIST_CLASSES = [str(d) for d in range(10)]
_GZIP_SIGNATURE = b"\x1f\x8b"


def read_idx(path: str | Path, expected_magic: int) -> np.ndarray:
    """Parse one IDX file (raw or gzip) into a uint8 array of the shape its header declares."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_SIGNATURE:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DatasetError(f"{path}: corrupt gzip data ({exc}); re-copy the file") from exc
    if len(raw) < 4:
        raise DatasetError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        raise DatasetError(
            f"{path}: bad IDX magic number {magic} (expected {expected_magic}); "
            "is this the right file, or an HTML page saved under its name?"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64))
    got = len(raw) - header
    if got != expected:
        raise DatasetError(
            f"{path}: IDX header declares shape {shape} ({expected} bytes) but the file holds "
            f"{got} bytes of data; the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _find(root: Path, stem: str) -> Path | None:
    for candidate in (
        root / stem,
        root / f"{stem}.gz",
        root / "raw" / stem,
        root / "raw" / f"{stem}.gz",
    ):
        if candidate.is_file():
            return candidate
    return None


def _read_pair(name: str, root: Path, hint: str) -> tuple[np.ndarray, np.ndarray]:
    """Read and pool the train and test image/label files; check they agree with each other."""
    paths: list[tuple[Path, Path]] = []
    missing: list[str] = []
    for image_stem, label_stem in IDX_FILES:
        pair = (_find(root, image_stem), _find(root, label_stem))
        missing += [
            f"{s}(.gz)" for s, p in zip((image_stem, label_stem), pair, strict=True) if p is None
        ]
        if pair[0] is not None and pair[1] is not None:
            paths.append((pair[0], pair[1]))
    if missing:
        raise DatasetNotFound(name, missing, [root, root / "raw"], hint)
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for image_path, label_path in paths:
        imgs = read_idx(image_path, IMAGES_MAGIC)
        labs = read_idx(label_path, LABELS_MAGIC)
        if imgs.ndim != 3:
            raise DatasetError(f"{image_path}: expected 3 dimensions (N, H, W), got {imgs.shape}")
        if labs.ndim != 1:
            raise DatasetError(f"{label_path}: expected 1 dimension (N,), got {labs.shape}")
        if len(imgs) != len(labs):
            raise DatasetError(
                f"{image_path} holds {len(imgs)} images but {label_path} holds {len(labs)} labels"
            )
        if len(labs) and labs.max() >= 10:
            raise DatasetError(f"{label_path}: label {int(labs.max())} outside 0..9")
        images.append(imgs)
        labels.append(labs)
    if images[0].shape[1:] != images[1].shape[1:]:
        raise DatasetError(
            f"{name}: train images are {images[0].shape[1:]} but test images {images[1].shape[1:]}"
        )
    pooled = np.concatenate(images)[:, None, :, :]  # (N, 1, H, W)
    return pooled, np.concatenate(labels).astype(np.int64)


def _load(
    name: str,
    root: Path,
    classes: list[str],
    hint: str,
    *,
    max_samples: int | None,
    seed: int,
    normalize: bool,
) -> Dataset:
    images, labels = _read_pair(name, root, hint)
    return image_dataset_from_uint8(
        name, images, labels, classes, normalize=normalize, max_samples=max_samples, seed=seed
    )


def load_fashion_mnist(
    root: str | Path | None = None,
    *,
    max_samples: int | None = None,
    seed: int = 0,
    normalize: bool = True,
) -> Dataset:
    """Fashion-MNIST, 70 000 images (train + test pooled), (N, 1, 28, 28), 10 named classes.

    Default root is where the Debian package `dataset-fashion-mnist` installs the files.
    """
    directory = Path(root) if root is not None else FASHION_MNIST_DEFAULT_ROOT
    hint = (
        "Install it with `apt-get install -y dataset-fashion-mnist` (files go to "
        f"{FASHION_MNIST_DEFAULT_ROOT}), or place the four IDX files (raw or .gz) in {directory}."
    )
    return _load(
        "fashion_mnist",
        directory,
        FASHION_MNIST_CLASSES,
        hint,
        max_samples=max_samples,
        seed=seed,
        normalize=normalize,
    )


def load_mnist(
    root: str | Path,
    *,
    max_samples: int | None = None,
    seed: int = 0,
    normalize: bool = True,
) -> Dataset:
    """MNIST, 70 000 digits (train + test pooled), (N, 1, 28, 28), classes "0".."9"."""
    directory = Path(root)
    names = ", ".join(stem for pair in IDX_FILES for stem in pair)
    hint = (
        f"Nothing is downloaded: place the MNIST IDX files ({names}; raw or with a .gz suffix) "
        f"in {directory}."
    )
    return _load(
        "mnist",
        directory,
        MNIST_CLASSES,
        hint,
        max_samples=max_samples,
        seed=seed,
        normalize=normalize,
    )
