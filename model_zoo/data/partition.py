"""Federated partitions: which sample indices each client holds, split into train/val/test.

`partition(labels, scheme, num_clients, seed=..., split=..., **params)` first hands samples to
clients with one of the schemes in `label_skew.py` and `persfl_splits.py` (their docstrings give
each scheme's rule and whether it covers the whole data set), then splits every client's samples
into train / validation / test by `split` (default 60/20/20, the PersFL split).

The per-client split is stratified by label: the client's samples, shuffled and then sorted by
label, are dealt to the three parts with each part's positions spread evenly along that order,
so every part gets each class in proportion; the part sizes are exact (`round(n * fraction)`
for val and test, the rest for train; always within 1 of n * fraction). Every client needs at
least 3 samples and gets at least one train and one test sample. The same seed always gives
the same partition.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import label_skew, persfl_splits  # noqa: F401  (registers the built-in schemes)
from .schemes import PartitionError, run_scheme, scheme_names

__all__ = [
    "MIN_CLIENT_SAMPLES",
    "ClientSplit",
    "Partition",
    "PartitionError",
    "partition",
    "partition_schemes",
]

logger = logging.getLogger(__name__)

MIN_CLIENT_SAMPLES = 3
_SPLIT_STREAM = 0x5B1  # second seed word of the generator used for train/val/test splits


@dataclass(eq=False)
class ClientSplit:
    """One client's sample indices (int64, into the partitioned data set)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    @property
    def indices(self) -> np.ndarray:
        """All of the client's indices: train, then val, then test."""
        return np.concatenate([self.train, self.val, self.test])

    def __len__(self) -> int:
        return len(self.train) + len(self.val) + len(self.test)

    def to_dict(self) -> dict[str, list[int]]:
        return {"train": self.train.tolist(), "val": self.val.tolist(), "test": self.test.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Sequence[int]]) -> ClientSplit:
        return cls(**{k: np.asarray(data[k], dtype=np.int64) for k in ("train", "val", "test")})


@dataclass(eq=False)
class Partition:
    """The result of `partition`: a split per client plus the effective parameters (defaults
    filled in, seed and split included) so a run record can say exactly what was used."""

    scheme: str
    clients: list[ClientSplit]
    params: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.clients)

    def client_indices(self, i: int) -> np.ndarray:
        """All indices of client `i` (train, val, test concatenated)."""
        return self.clients[i].indices

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (see `from_dict`)."""
        return {
            "scheme": self.scheme,
            "params": self.params,
            "clients": [c.to_dict() for c in self.clients],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Partition:
        return cls(
            scheme=str(data["scheme"]),
            clients=[ClientSplit.from_dict(c) for c in data["clients"]],
            params=dict(data.get("params", {})),
        )


def partition_schemes() -> list[str]:
    """The names `partition` accepts, sorted."""
    return scheme_names()


def _as_int_array(values: np.ndarray | torch.Tensor | Sequence[int], what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise PartitionError(f"{what} must be one-dimensional, got shape {arr.shape}")
    return arr


def _check_split(split: Sequence[float]) -> tuple[float, float, float]:
    if len(split) != 3:
        raise PartitionError(f"split must be (train, val, test) fractions, got {tuple(split)}")
    train, val, test = (float(f) for f in split)
    if min(train, val, test) < 0 or abs(train + val + test - 1.0) > 1e-6:
        raise PartitionError(
            f"split fractions must be >= 0 and sum to 1, got {tuple(split)} "
            f"(sum {train + val + test:g})"
        )
    if train <= 0 or test <= 0:
        raise PartitionError(
            f"split needs train > 0 and test > 0 (every client trains and is tested), got "
            f"{tuple(split)}; use e.g. (0.75, 0.0, 0.25) for no validation"
        )
    return train, val, test


def _half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def _part_sizes(n: int, val_frac: float, test_frac: float) -> tuple[int, int, int]:
    """(train, val, test) counts for n samples: round-half-up for val and test, one test and one
    train sample guaranteed."""
    n_test = max(_half_up(n * test_frac), 1)
    n_val = _half_up(n * val_frac)
    while n - n_val - n_test < 1:  # only for tiny clients: give train the sample back
        if n_val > 0:
            n_val -= 1
        else:
            n_test -= 1
    return n - n_val - n_test, n_val, n_test


def _deal(sizes: tuple[int, int, int]) -> np.ndarray:
    """Part id (0 train, 1 val, 2 test) for each of sum(sizes) positions: part p gets exactly
    sizes[p] positions, spread evenly along the sequence (its j-th position sits near
    (j + 1/2) * n / sizes[p])."""
    n = sum(sizes)
    part = np.repeat(np.arange(3), sizes)
    rank = np.concatenate([np.arange(s) for s in sizes])
    ideal = (rank + 0.5) * n / np.repeat(np.maximum(sizes, 1), sizes)
    return part[np.lexsort((part, ideal))]


def _split_client(
    i: int,
    indices: np.ndarray,
    labels: np.ndarray,
    fractions: tuple[float, float, float],
    rng: np.random.Generator,
    scheme: str,
) -> ClientSplit:
    n = len(indices)
    if n < MIN_CLIENT_SAMPLES:
        raise PartitionError(
            f"{scheme}: client {i} has {n} sample(s); every client needs at least "
            f"{MIN_CLIENT_SAMPLES} (one train, one test). Use fewer clients or a scheme setting "
            "that gives small clients more data (min_size, min_per_class, a larger alpha)"
        )
    shuffled = rng.permutation(np.asarray(indices, dtype=np.int64))
    ordered = shuffled[np.argsort(labels[shuffled], kind="stable")]
    parts = _deal(_part_sizes(n, fractions[1], fractions[2]))
    train, val, test = (np.sort(ordered[parts == p]) for p in range(3))
    return ClientSplit(train=train, val=val, test=test)


def partition(
    labels: np.ndarray | torch.Tensor,
    scheme: str,
    num_clients: int | None,
    *,
    seed: int = 0,
    split: tuple[float, float, float] = (0.6, 0.2, 0.2),
    groups: np.ndarray | torch.Tensor | None = None,
    **params: Any,
) -> Partition:
    """Partition the samples with `labels` over `num_clients` clients by `scheme`.

    `params` are the scheme's own settings (see `label_skew.py`, `persfl_splits.py`); an
    unknown one raises `PartitionError` listing those accepted. `groups` (the natural owner of
    each sample) is needed by `natural` only; for it `num_clients` None or 0 takes every owner.
    """
    y = _as_int_array(labels, "labels")
    if not np.issubdtype(y.dtype, np.integer):
        raise PartitionError(f"labels must be integers, got dtype {y.dtype}")
    owners = None if groups is None else _as_int_array(groups, "groups")
    if owners is not None and len(owners) != len(y):
        raise PartitionError(f"groups has {len(owners)} entries for {len(y)} labels")
    fractions = _check_split(split)
    if scheme != "natural" and not num_clients:
        raise PartitionError(f"{scheme}: num_clients must be a positive integer, got {num_clients}")
    rng = np.random.default_rng(seed)
    assigned, effective = run_scheme(scheme, y, num_clients or 0, rng, owners, params)
    seen = np.concatenate(assigned) if assigned else np.zeros(0, dtype=np.int64)
    if len(np.unique(seen)) != len(seen):  # a scheme bug, never the caller's
        raise RuntimeError(f"{scheme}: some sample was given to two clients")
    split_rng = np.random.default_rng([seed, _SPLIT_STREAM])
    clients = [
        _split_client(i, idx, y, fractions, split_rng, scheme) for i, idx in enumerate(assigned)
    ]
    logger.info(
        "partition %s: %d clients, %d of %d samples assigned",
        scheme,
        len(clients),
        len(seen),
        len(y),
    )
    return Partition(
        scheme=scheme,
        clients=clients,
        params={"num_clients": len(clients), "seed": seed, "split": list(fractions), **effective},
    )
