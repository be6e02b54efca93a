"""Byzantine-robust combination of model updates: what one client with a valid key can do to an
aggregate is bounded here.

A signature proves who sent an update, not that it is honest. These pure functions take the
states a cohort sent (each with the state it started the round from) and bound each one's pull:
- `update_norms` / `clip_scales`: each update's L2 norm (state − start, float tensors, computed
  in float64 so that 3e38 does not overflow) against the cohort's median, relative to the size
  of the model it updates (models of different architectures compare); an update above
  `factor` × the median is scaled down to it (norm bounding, Sun et al. 2019);
- `coordinate_median`, `trimmed_mean` (Yin et al. 2018) and `krum` (Blanchard et al. 2017):
  aggregators that a minority of arbitrary updates cannot drag far.
The coordinator's strategies use them on every aggregate (`coordinator.robust`); a FedeRiCo
client clips the gradients its peers send it with `clip_scales`. Integer tensors (BatchNorm's
step counters) are never clipped and take the largest value, as in `weighted_mean`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "RobustError",
    "clip_scales",
    "clipped",
    "coordinate_median",
    "krum",
    "krum_needs",
    "state_norm",
    "trimmed_mean",
    "update_norms",
]

State = Mapping[str, torch.Tensor]


class RobustError(ValueError):
    """Updates a robust aggregator cannot combine (too few for its setting)."""


def _floats(state: State) -> list[str]:
    return [k for k, t in state.items() if t.is_floating_point()]


# Elements (float64) stacked at once when norms are computed together: a cohort of large models
# goes through in slices of clients, so that a temporary never holds more than ~128 MiB.
_STACK_ELEMENTS = 1 << 24


def state_norm(state: State) -> float:
    """The L2 norm of a state's float tensors together."""
    return update_norms([state], [None])[0]


def update_norms(states: Sequence[State], starts: Sequence[State | None]) -> list[float]:
    """‖state − start‖ over the float tensors of each state (the keys it carries); a start of
    None counts as zero (the state's own norm).

    States of one architecture are stacked, a tensor name at a time (a start shared by all of
    them, as a round's global model is, is broadcast), so that a cohort costs a few operator
    calls per tensor name, not per client and tensor."""
    out = [0.0] * len(states)
    groups: dict[tuple[tuple[str, tuple[int, ...]], ...], list[int]] = {}
    for i, s in enumerate(states):
        groups.setdefault(tuple((k, tuple(s[k].shape)) for k in _floats(s)), []).append(i)
    for layout, members in groups.items():
        size = max(1, sum(math.prod(shape) for _, shape in layout))
        step = max(1, _STACK_ELEMENTS // size)
        for at in range(0, len(members), step):
            rows = members[at : at + step]
            norms = [
                _key_norms([states[i] for i in rows], [starts[i] for i in rows], k)
                for k, _ in layout
            ]
            if norms:
                total = torch.linalg.vector_norm(torch.stack(norms), dim=0).tolist()
                for i, value in zip(rows, total, strict=True):
                    out[i] = value
    return out


def _key_norms(states: Sequence[State], starts: Sequence[State | None], key: str) -> torch.Tensor:
    """Per state, ‖state[key] − start[key]‖ in float64 (finite for any finite float32)."""
    values = torch.stack([s[key] for s in states]).double()
    first = starts[0]
    if all(s is first for s in starts):  # one start for all (or none)
        if first is not None:
            values -= first[key].double()
    else:
        zero = torch.zeros_like(states[0][key])
        values -= torch.stack([zero if s is None else s[key] for s in starts]).double()
    return torch.linalg.vector_norm(values.reshape(len(states), -1), dim=1)  # (0-d tensors too)


def clip_scales(
    norms: Sequence[float], factor: float, sizes: Sequence[float] | None = None
) -> list[float]:
    """Per update, the factor (≤ 1) that bounds its norm at `factor` × the cohort's median.

    With `sizes` (each start's norm), norms compare relative to them, so a cohort of models of
    different architectures shares one median; the bound of update i is then
    factor × median(norm/size) × size_i. `factor` 0 bounds nothing. A cohort of one bounds
    nothing either: there is no one to compare it with."""
    if factor <= 0 or len(norms) < 2:
        return [1.0] * len(norms)
    if sizes is None or any(s <= 0 for s in sizes):
        sizes = [1.0] * len(norms)
    rel = [n / s for n, s in zip(norms, sizes, strict=True)]
    bound = factor * statistics.median(rel)
    return [bound / r if r > bound else 1.0 for r in rel]


def clipped(state: State, start: State, scale: float) -> dict[str, torch.Tensor]:
    """start + scale·(state − start) on the float tensors; `state` itself when scale is 1."""
    if scale >= 1.0:
        return dict(state)
    return {
        k: (start[k].double() + scale * (t.double() - start[k].double())).to(t.dtype)
        if t.is_floating_point()
        else t
        for k, t in state.items()
    }


def _integers(states: Sequence[State]) -> dict[str, torch.Tensor]:
    first = states[0]
    return {
        k: torch.stack([s[k] for s in states]).max(dim=0).values
        for k, t in first.items()
        if not t.is_floating_point()
    }


def _sorted(
    states: Sequence[State], weights: Sequence[float] | None
) -> tuple[State, list[str], torch.Tensor, int]:
    """Checks, and what both order statistics need: the first state, its float keys, the weights
    (float64; ones without `weights`) and their count."""
    if not states:
        raise RobustError("no updates to aggregate")
    w = torch.ones(len(states), dtype=torch.float64)
    if weights is not None:
        w = torch.tensor(list(weights), dtype=torch.float64)
    if not bool((w >= 0).all()) or float(w.sum()) <= 0:
        raise RobustError(f"the weights {w.tolist()} weigh nothing")
    return states[0], _floats(states[0]), w, len(states)


def _runs(first: State, keys: Sequence[str], n: int) -> list[list[str]]:
    """`keys` in runs whose values over `n` states stay within _STACK_ELEMENTS together (a
    tensor larger than that alone): the coordinates of a cohort of small models are ordered in
    one sort, not in one per tensor name."""
    out: list[list[str]] = [[]]
    size = 0
    for k in keys:
        m = first[k].numel() * n
        if out[-1] and size + m > _STACK_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(k)
        size += m
    return [run for run in out if run]


def _columns(states: Sequence[State], keys: Sequence[str]) -> torch.Tensor:
    """The values of tensors `keys`, a row per state, in float64: (states, their elements)."""
    n = len(states)
    return torch.cat([torch.stack([s[k] for s in states]).reshape(n, -1) for k in keys], 1).double()


def _split(row: torch.Tensor, first: State, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """A row of `_columns` back into tensors shaped and typed as `first`'s."""
    parts = row.split([first[k].numel() for k in keys])
    return {
        k: p.reshape(first[k].shape).to(first[k].dtype) for k, p in zip(keys, parts, strict=True)
    }


def _ordered(values: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per column of `values` (a row per state): the values sorted, their weights in that
    order, and the weight up to and including each."""
    values, order = values.sort(dim=0)
    ws = w[order]
    return values, ws, ws.cumsum(dim=0)


def coordinate_median(
    states: Sequence[State], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """Each coordinate's median over the states (Yin et al. 2018), weighted by `weights`: the
    mean of the first value with half the weight at or below it and the first with more than
    half (with equal weights, the middle value, or the mean of the two middle ones). Fewer than
    half of them (by weight), however large, cannot move it past the honest values' range."""
    first, keys, w, n = _sorted(states, weights)
    half, tol = float(w.sum()) / 2, 1e-9 * float(w.sum())
    out = _integers(states)
    for run in _runs(first, keys, n):
        values, _, above = _ordered(_columns(states, run), w)
        low = (above >= half - tol).to(torch.int8).argmax(dim=0, keepdim=True)
        high = (above > half + tol).to(torch.int8).argmax(dim=0, keepdim=True)
        mid = (values.gather(0, low) + values.gather(0, high)) / 2
        out |= _split(mid.squeeze(0), first, run)
    return {k: out[k] for k in first}


def trimmed_mean(
    states: Sequence[State], beta: float, weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """Each coordinate's mean after cutting its ⌊β·n⌋ largest and smallest values; with
    `weights`, its weighted mean after cutting ⌊β·n⌋/n of the weight at each end (a value that
    straddles a cut counts with what is left of its weight)."""
    first, keys, w, n = _sorted(states, weights)
    cut = math.floor(beta * n)
    if n - 2 * cut < 1:
        raise RobustError(f"trimmed_mean(β={beta}) leaves none of {n} updates")
    total = float(w.sum())
    # (cut · total / n, not cut / n · total: with equal weights that is exactly `cut`, where
    # 1/49 · 49 rounds below 1 and left a cut value 1e-16 of its weight: a cut -3e38 moved
    # the mean of 49 by 7e20)
    lo, hi = cut * total / n, (n - cut) * total / n
    out = _integers(states)
    for run in _runs(first, keys, n):
        values, ws, above = _ordered(_columns(states, run), w)
        kept = (above.clamp(max=hi) - (above - ws).clamp(min=lo)).clamp(min=0)
        out |= _split((kept * values).sum(dim=0) / kept.sum(dim=0), first, run)
    return {k: out[k] for k in first}


def krum_needs(f: int) -> int:
    """The fewest updates Krum with `f` attackers can choose among (n ≥ 2f + 3)."""
    return 2 * f + 3


def krum(states: Sequence[State], f: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Krum (Blanchard et al. 2017): the update whose n − f − 2 nearest others are nearest
    (summed squared distances); its index and the state itself. Needs n ≥ 2f + 3."""
    n = len(states)
    if n < krum_needs(f):
        raise RobustError(
            f"krum(f={f}) chooses among at least {krum_needs(f)} updates (2f + 3); "
            f"this round has {n}"
        )
    keys = _floats(states[0])
    flat = _columns(states, keys)
    d2 = torch.cdist(flat, flat).pow(2)  # (n, n)
    nearest = n - f - 2
    scores = [float(d2[i][torch.arange(n) != i].sort().values[:nearest].sum()) for i in range(n)]
    best = min(range(n), key=lambda i: (scores[i], i))
    return best, dict(states[best])
