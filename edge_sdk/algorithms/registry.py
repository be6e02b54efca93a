"""Algorithms by name: the built-in ones (every module of this package) and plugins'."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge_sdk.algorithms.context import AlgorithmError

if TYPE_CHECKING:
    from edge_sdk.algorithms.base import ClientAlgorithm

__all__ = ["algorithm_class", "algorithm_names", "register_algorithm"]

_REGISTRY: dict[str, type[ClientAlgorithm]] = {}


def register_algorithm(cls: type[ClientAlgorithm]) -> type[ClientAlgorithm]:
    if cls.name in _REGISTRY:
        raise ValueError(f"client algorithm {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def algorithm_class(name: str) -> type[ClientAlgorithm]:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AlgorithmError(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def algorithm_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def _load() -> None:
    import edge_sdk.algorithms  # noqa: F401  (importing the package registers every algorithm)
