"""`load_dataset(name, root, **kwargs)`: one entry point for every data set the SDK knows.

Default roots: Fashion-MNIST where the Debian package `dataset-fashion-mnist` installs it
(`/usr/share/datasets/fashion-mnist`); the other file-based sets under `~/.edgefl/datasets/<name>`.
`digits` and `synthetic` need no files and ignore `root`. Nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .base import Dataset, DatasetError, UnknownDataset, unknown_keywords
from .cifar import load_cifar10, load_cifar100
from .generated import load_digits, load_synthetic
from .idx import FASHION_MNIST_DEFAULT_ROOT, load_fashion_mnist, load_mnist
from .leaf import load_femnist, load_shakespeare

__all__ = ["DATA_HOME", "dataset_names", "default_root", "load_dataset", "register_dataset"]

DATA_HOME = Path("~/.edgefl/datasets")

Loader = Callable[..., Dataset]
# name -> (loader, takes a root directory)
_REGISTRY: dict[str, tuple[Loader, bool]] = {}


def register_dataset(name: str, *, needs_root: bool) -> Callable[[Loader], Loader]:
    """Register `loader(root?, **kwargs) -> Dataset` under `name`; duplicate names are refused."""

    def decorator(loader: Loader) -> Loader:
        if name in _REGISTRY:
            raise DatasetError(f"dataset {name!r} is already registered")
        _REGISTRY[name] = (loader, needs_root)
        return loader

    return decorator


def dataset_names() -> list[str]:
    """The registered data set names, sorted."""
    return sorted(_REGISTRY)


def default_root(name: str) -> Path | None:
    """Where `load_dataset(name)` looks when no root is given (None: the set needs no files)."""
    if name not in _REGISTRY:
        raise UnknownDataset(name, dataset_names())
    if not _REGISTRY[name][1]:
        return None
    if name == "fashion_mnist":
        return FASHION_MNIST_DEFAULT_ROOT
    return DATA_HOME.expanduser() / name


def load_dataset(name: str, root: str | Path | None = None, **kwargs: Any) -> Dataset:
    """Load the data set registered as `name` (see `dataset_names()`).

    Common keyword arguments: `max_samples` (a seeded, class-stratified random subset) and
    `seed`; the others are per data set (`label` for cifar100, `max_users` for the LEAF sets,
    `size` for digits, `alpha`/`beta`/`num_users`/`iid` for synthetic, `normalize` for images).
    """
    key = name.lower().replace("-", "_")
    if key not in _REGISTRY:
        raise UnknownDataset(name, dataset_names())
    loader, needs_root = _REGISTRY[key]
    unknown, accepted = unknown_keywords(loader, kwargs)
    if unknown:
        raise DatasetError(
            f"{key}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
        )
    if not needs_root:
        return loader(**kwargs)
    directory = Path(root).expanduser() if root is not None else default_root(key)
    return loader(directory, **kwargs)


register_dataset("fashion_mnist", needs_root=True)(load_fashion_mnist)
register_dataset("mnist", needs_root=True)(load_mnist)
register_dataset("cifar10", needs_root=True)(load_cifar10)
register_dataset("cifar100", needs_root=True)(load_cifar100)
register_dataset("femnist", needs_root=True)(load_femnist)
register_dataset("shakespeare", needs_root=True)(load_shakespeare)
register_dataset("digits", needs_root=False)(load_digits)
register_dataset("synthetic", needs_root=False)(load_synthetic)
