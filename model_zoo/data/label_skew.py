"""Label-skew and natural partition schemes: iid, shards, dirichlet, label_groups, natural.

"Covers" says whether every sample ends up with some client; the schemes that use a subset say
which part is left unused. All are registered on import and run through `partition`.

- iid: a random permutation cut into equal shards. Covers everything.
- shards [classes_per_client=p]: each client gets p distinct classes; a class's samples are cut
  into one shard per client holding it. Classes are dealt least-used-first with random ties, so
  every class is held by floor or ceil(num_clients*p/C) clients. Covers everything when
  num_clients*p >= C (otherwise the classes nobody holds are unused).
- dirichlet [alpha, size_alpha, min_size]: per class, Dirichlet(alpha) proportions over clients;
  with size_alpha, the proportions are multiplied by client weights ~ Dirichlet(size_alpha)
  (size skew), without it by the usual cap that stops a client from growing past N/num_clients.
  Redrawn, weights too (at most max_attempts times), until every client has min_size samples.
  Covers everything.
- label_groups [num_groups=2]: the classes, in a seeded random order, are cut into disjoint
  groups; clients are assigned to groups round-robin (or a seeded shuffle of that) and the
  group's samples are split equally among its clients. Covers everything.
- natural: one client per natural owner (`groups`), owners in sorted id order; num_clients None
  or 0 takes every owner, otherwise the first num_clients. Covers everything when all owners are
  taken.
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
    log_unused,
    register_scheme,
)

__all__: list[str] = []  # the schemes are reached by name through `partition`

logger = logging.getLogger(__name__)


@register_scheme("iid")
def _iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups: Any) -> Split:
    check_clients(num_clients, len(labels), "iid")
    return list(np.array_split(rng.permutation(len(labels)), num_clients)), {}


@register_scheme("shards")
def _shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    classes_per_client: int = 2,
) -> Split:
    check_clients(num_clients, len(labels), "shards")
    pools = class_pools(labels, rng)
    dealt = deal_classes(list(pools), num_clients, classes_per_client, rng, "shards")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in pools.items():
        holders = [i for i, cls in enumerate(dealt) if c in cls]
        if not holders:  # fewer shards than classes: this class goes unused (logged below)
            continue
        if len(pool) < len(holders):
            raise PartitionError(
                f"shards: class {c} has {len(pool)} samples for {len(holders)} clients; use "
                "fewer clients or fewer classes_per_client"
            )
        for i, shard in zip(holders, np.array_split(pool, len(holders)), strict=False):
            parts[i].append(shard)
    clients = [np.concatenate(p) for p in parts]
    log_unused("shards", sum(len(c) for c in clients), len(labels))
    return clients, {"classes_per_client": classes_per_client, "client_classes": dealt}


@register_scheme("dirichlet")
def _dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    alpha: float = 0.5,
    size_alpha: float | None = None,
    min_size: int = 10,
    max_attempts: int = 100,
) -> Split:
    n = len(labels)
    check_clients(num_clients, n, "dirichlet")
    if alpha <= 0 or (size_alpha is not None and size_alpha <= 0):
        raise PartitionError(
            f"dirichlet: alpha and size_alpha must be > 0, got {alpha}, {size_alpha}"
        )
    if n < num_clients * min_size:
        raise PartitionError(
            f"dirichlet: {n} samples cannot give {num_clients} clients {min_size} each; lower "
            "min_size or num_clients"
        )
    sizes = np.zeros(num_clients, dtype=np.int64)
    for attempt in range(1, max_attempts + 1):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes[:] = 0
        weights = None if size_alpha is None else rng.dirichlet(np.full(num_clients, size_alpha))
        for pool in class_pools(labels, rng).values():
            props = rng.dirichlet(np.full(num_clients, alpha))
            # size skew: scale by the client weights; else cap clients already past N/clients
            props = props * (weights if weights is not None else sizes < n / num_clients)
            total = props.sum()
            props = props / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(props) * len(pool)).astype(np.int64)[:-1]
            for i, chunk in enumerate(np.split(pool, cuts)):
                parts[i].append(chunk)
                sizes[i] += len(chunk)
        if sizes.min() >= min_size:
            logger.debug("dirichlet: accepted draw %d", attempt)
            clients = [np.concatenate(part) for part in parts]
            return clients, {
                "alpha": alpha,
                "size_alpha": size_alpha,
                "min_size": min_size,
                "attempts": attempt,
            }
    raise PartitionError(
        f"dirichlet: no draw in {max_attempts} gave every client >= {min_size} samples "
        f"(smallest: {int(sizes.min())}); raise alpha or size_alpha, or lower min_size or "
        "num_clients"
    )


@register_scheme("label_groups")
def _label_groups(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: Any,
    *,
    num_groups: int = 2,
    assignment: str = "round_robin",
) -> Split:
    check_clients(num_clients, len(labels), "label_groups")
    classes = np.unique(labels)
    if not 1 <= num_groups <= len(classes):
        raise PartitionError(
            f"label_groups: num_groups must be in 1..{len(classes)} (the classes present), "
            f"got {num_groups}"
        )
    if num_clients < num_groups:
        raise PartitionError(
            f"label_groups: {num_clients} clients cannot cover {num_groups} groups; every group "
            "needs at least one client"
        )
    if assignment not in ("round_robin", "random"):
        raise PartitionError(
            f"label_groups: assignment must be 'round_robin' or 'random', got {assignment!r}"
        )
    label_sets = [
        sorted(int(c) for c in g) for g in np.array_split(rng.permutation(classes), num_groups)
    ]
    client_group = np.arange(num_clients) % num_groups
    if assignment == "random":
        client_group = rng.permutation(client_group)
    clients: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_clients
    for g, label_set in enumerate(label_sets):
        members = np.flatnonzero(client_group == g)
        pool = rng.permutation(np.flatnonzero(np.isin(labels, label_set)))
        for i, chunk in zip(members, np.array_split(pool, len(members)), strict=True):
            clients[i] = chunk
    return clients, {
        "num_groups": num_groups,
        "assignment": assignment,
        "label_groups": label_sets,
        "client_groups": client_group.tolist(),
    }


@register_scheme("natural")
def _natural(
    labels: np.ndarray, num_clients: int | None, rng: np.random.Generator, groups: Any
) -> Split:
    if groups is None:
        raise PartitionError(
            "natural: needs the natural owner of every sample (groups=...); datasets with owners "
            "(synthetic, femnist, shakespeare) carry them in Dataset.groups"
        )
    owners = np.unique(groups)
    if num_clients:
        if num_clients > len(owners):
            raise PartitionError(
                f"natural: {num_clients} clients asked but the data has {len(owners)} owners"
            )
        owners = owners[:num_clients]
    clients = [np.flatnonzero(groups == o) for o in owners]
    log_unused("natural", sum(len(c) for c in clients), len(labels))
    return clients, {"owners": owners.tolist()}
