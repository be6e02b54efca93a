"""The data splits DS-1..DS-4 compared by PersFL (thesis 002, section 5.2.1).

"Covers" says whether every sample ends up with some client; the schemes that use a subset say
which part is left unused. All are registered on import and run through `partition`.

- ds1 [classes_per_client=k]: client i holds classes i, i+1, ..., i+k-1 (mod C, sorted class
  order), so neighbouring clients overlap on k-1 classes; every client has the same number of
  samples, spread as evenly as possible over its k classes. Uses a subset: the largest equal size
  the data supports (or samples_per_client).
- ds2 [alpha=0.9]: every class split over all clients by Dirichlet(alpha) proportions, each client
  first getting min_per_class samples of every class; sizes are unequal. Covers everything.
- ds3 [classes_per_client=2, sigma=2.0]: p classes per client (dealt as in shards), client weights
  ~ lognormal(mu, sigma); each client's size is proportional to its weight, on top of
  min_per_class samples per held class, scaled so the most demanded class is used up. Uses a
  subset.
- ds4 [k]: the first ceil(n/2) clients get k samples of each of the first five classes; each other
  client k//2 of one of the first five and 2k of one of the last five (chosen by cycling through
  seeded permutations, so the classes are used evenly). Default k: the largest the data supports.
  Uses a subset.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .schemes import (
    PartitionError,
    Split,
    check_clients,
    class_pools,
    deal_classes,
    largest_feasible,
    log_unused,
    register_scheme,
    split_by_counts,
)

__all__: list[str] = []  # the schemes are reached by name through `partition`

logger = logging.getLogger(__name__)


@register_scheme("ds1")
def _ds1(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    classes_per_client: int = 4,
    samples_per_client: int | None = None,
) -> Split:
    check_clients(num_clients, len(labels), "ds1")
    pools = class_pools(labels, rng)
    classes = list(pools)
    k = classes_per_client
    if not 1 <= k <= len(classes):
        raise PartitionError(f"ds1: classes_per_client must be in 1..{len(classes)}, got {k}")
    windows = [[classes[(i + j) % len(classes)] for j in range(k)] for i in range(num_clients)]

    def quotas(size: int) -> list[list[int]]:
        return [[size // k + (j < size % k) for j in range(k)] for _ in range(num_clients)]

    def fits(size: int) -> bool:
        demand = dict.fromkeys(classes, 0)
        for window, q in zip(windows, quotas(size), strict=True):
            for c, m in zip(window, q, strict=True):
                demand[c] += m
        return all(demand[c] <= len(pools[c]) for c in classes)

    most = largest_feasible(fits, max(k, 3), len(labels) // num_clients)
    size = most if samples_per_client is None else samples_per_client
    if size < max(k, 3) or size > most:
        raise PartitionError(
            f"ds1: samples_per_client={size} is not feasible; with {num_clients} clients and "
            f"{k} classes each the data supports {max(k, 3)}..{most} (use fewer clients or "
            "more data)"
        )
    taken = dict.fromkeys(classes, 0)
    clients = []
    for window, q in zip(windows, quotas(size), strict=True):
        chunks = []
        for c, m in zip(window, q, strict=True):
            chunks.append(pools[c][taken[c] : taken[c] + m])
            taken[c] += m
        clients.append(np.concatenate(chunks))
    log_unused("ds1", size * num_clients, len(labels))
    return clients, {
        "classes_per_client": k,
        "samples_per_client": size,
        "client_classes": windows,
    }


@register_scheme("ds2")
def _ds2(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    alpha: float = 0.9,
    min_per_class: int = 1,
) -> Split:
    check_clients(num_clients, len(labels), "ds2")
    if alpha <= 0:
        raise PartitionError(f"ds2: alpha must be > 0, got {alpha}")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in class_pools(labels, rng).items():
        base = min_per_class if len(pool) >= num_clients * min_per_class else 0
        if base < min_per_class:
            logger.warning(
                "ds2: class %d has %d samples, too few to give %d clients %d each",
                c,
                len(pool),
                num_clients,
                min_per_class,
            )
        rest = len(pool) - base * num_clients
        cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * rest).astype(np.int64)
        counts = base + np.diff(np.concatenate([[0], cuts[:-1], [rest]]))
        for i, chunk in enumerate(split_by_counts(pool, counts)):
            parts[i].append(chunk)
    return [np.concatenate(p) for p in parts], {"alpha": alpha, "min_per_class": min_per_class}


@register_scheme("ds3")
def _ds3(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    classes_per_client: int = 2,
    sigma: float = 2.0,
    mu: float = 0.0,
    min_per_class: int = 2,
) -> Split:
    check_clients(num_clients, len(labels), "ds3")
    pools = class_pools(labels, rng)
    p = classes_per_client
    dealt = deal_classes(list(pools), num_clients, p, rng, "ds3")
    weights = rng.lognormal(mu, sigma, num_clients)
    holders = {c: [i for i, cls in enumerate(dealt) if c in cls] for c in pools}
    spare = {c: len(pools[c]) - min_per_class * len(holders[c]) for c in pools}
    demand = {c: weights[holders[c]].sum() / p for c in pools if holders[c]}
    if any(spare[c] < 0 for c in demand):
        raise PartitionError(
            f"ds3: some class has fewer than {min_per_class} samples per client holding it; use "
            "fewer clients or a smaller min_per_class"
        )
    scale = min(spare[c] / demand[c] for c in demand)
    taken = dict.fromkeys(pools, 0)
    clients = []
    for i, cls in enumerate(dealt):
        chunks = []
        for c in cls:
            m = min_per_class + int(np.floor(weights[i] / p * scale))
            chunks.append(pools[c][taken[c] : taken[c] + m])
            taken[c] += m
        clients.append(np.concatenate(chunks))
    log_unused("ds3", sum(taken.values()), len(labels))
    return clients, {
        "classes_per_client": p,
        "sigma": sigma,
        "mu": mu,
        "min_per_class": min_per_class,
        "client_classes": dealt,
    }


@register_scheme("ds4")
def _ds4(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    k: int | None = None,
) -> Split:
    check_clients(num_clients, len(labels), "ds4")
    pools = class_pools(labels, rng)
    classes = list(pools)
    if len(classes) < 10:
        raise PartitionError(f"ds4 needs at least 10 classes, the labels hold {len(classes)}")
    first, last = classes[:5], classes[5:10]
    n_a = (num_clients + 1) // 2
    perm_first, perm_last = rng.permutation(first), rng.permutation(last)
    pairs = [(int(perm_first[j % 5]), int(perm_last[j % 5])) for j in range(num_clients - n_a)]

    def demand(kk: int) -> dict[int, int]:
        need = dict.fromkeys(classes, 0)
        for c in first:
            need[c] += n_a * kk
        for a, b in pairs:
            need[a] += kk // 2
            need[b] += 2 * kk
        return need

    def fits(kk: int) -> bool:
        return all(m <= len(pools[c]) for c, m in demand(kk).items())

    most = largest_feasible(fits, 2, len(labels))
    kk = most if k is None else k
    if kk < 2 or kk > most:
        raise PartitionError(
            f"ds4: k={kk} is not feasible; with {num_clients} clients the data supports "
            f"k in 2..{most} (use fewer clients or more data)"
        )
    taken = dict.fromkeys(classes, 0)

    def take(c: int, m: int) -> np.ndarray:
        chunk = pools[c][taken[c] : taken[c] + m]
        taken[c] += m
        return chunk

    clients = [np.concatenate([take(c, kk) for c in first]) for _ in range(n_a)]
    clients += [np.concatenate([take(a, kk // 2), take(b, 2 * kk)]) for a, b in pairs]
    log_unused("ds4", sum(taken.values()), len(labels))
    return clients, {
        "k": kk,
        "first_classes": first,
        "last_classes": last,
        "type_a_clients": list(range(n_a)),
        "type_b_classes": [list(pair) for pair in pairs],
    }
