"""The partition-scheme registry and the helpers the schemes share.

A scheme is a function `(labels, num_clients, rng, groups, **params) -> (per-client index arrays,
effective params)` registered by name with `register_scheme`; its keyword-only parameters are the
options `partition(..., **params)` accepts. The built-in schemes live in `label_skew.py` (iid,
shards, dirichlet, label_groups, natural) and `persfl_splits.py` (ds1..ds4); each module's
docstring says, per scheme, whether every sample ends up with some client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import unknown_keywords

__all__ = [
    "PartitionError",
    "Split",
    "check_clients",
    "class_pools",
    "deal_classes",
    "largest_feasible",
    "log_unused",
    "register_scheme",
    "run_scheme",
    "scheme_names",
    "split_by_counts",
]

logger = logging.getLogger(__name__)

Split = tuple[list[np.ndarray], dict[str, Any]]
SchemeFn = Callable[..., Split]
_SCHEMES: dict[str, SchemeFn] = {}


class PartitionError(ValueError):
    """A partition cannot be made as asked; the message says which constraint failed and what
    to change."""


def register_scheme(name: str) -> Callable[[SchemeFn], SchemeFn]:
    """Register a scheme function under `name`; duplicate names are refused."""

    def decorator(fn: SchemeFn) -> SchemeFn:
        if name in _SCHEMES:
            raise PartitionError(f"partition scheme {name!r} is already registered")
        _SCHEMES[name] = fn
        return fn

    return decorator


def scheme_names() -> list[str]:
    return sorted(_SCHEMES)


def run_scheme(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: np.ndarray | None,
    params: dict[str, Any],
) -> Split:
    """Run scheme `name`, checking its parameter names first."""
    if name not in _SCHEMES:
        raise PartitionError(
            f"unknown partition scheme {name!r}; known schemes: {', '.join(scheme_names())}"
        )
    fn = _SCHEMES[name]
    unknown, accepted = unknown_keywords(fn, params)
    if unknown:
        raise PartitionError(
            f"scheme {name!r} takes no parameter(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    return fn(labels, num_clients, rng, groups, **params)


def check_clients(num_clients: int, n_samples: int, scheme: str) -> None:
    if num_clients < 1:
        raise PartitionError(f"{scheme}: num_clients must be >= 1, got {num_clients}")
    if num_clients > n_samples:
        raise PartitionError(
            f"{scheme}: {num_clients} clients for {n_samples} samples; use fewer clients"
        )


def class_pools(labels: np.ndarray, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Shuffled sample indices of every class, keyed by label (sorted)."""
    return {int(c): rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)}


def deal_classes(
    classes: list[int], num_clients: int, per_client: int, rng: np.random.Generator, scheme: str
) -> list[list[int]]:
    """`per_client` distinct classes per client, least-used classes first, random tie-break."""
    if not 1 <= per_client <= len(classes):
        raise PartitionError(
            f"{scheme}: classes_per_client must be in 1..{len(classes)} (the number of classes "
            f"present), got {per_client}"
        )
    used = np.zeros(len(classes), dtype=np.int64)
    dealt = []
    for _ in range(num_clients):
        order = np.lexsort((rng.random(len(classes)), used))
        pick = np.sort(order[:per_client])
        used[pick] += 1
        dealt.append([classes[j] for j in pick])
    return dealt


def split_by_counts(indices: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    return np.split(indices, np.cumsum(counts)[:-1])


def largest_feasible(fits: Callable[[int], bool], low: int, high: int) -> int:
    """Largest v in [low, high] with fits(v) (fits monotone decreasing); low - 1 if none."""
    if high < low or not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def log_unused(scheme: str, used: int, total: int) -> None:
    if used < total:
        logger.info("%s: %d of %d samples assigned, %d unused", scheme, used, total, total - used)
