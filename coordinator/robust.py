"""What the coordinator does so that no client with a valid key can wreck the federation.

`robust.*` settings (`RobustConfig`), applied to every algorithm that aggregates (FedAvg and
FedProx, FML's meme, PFML's global model, PersFL's teachers, FedMe's models; FedeRiCo's clients
bound what their peers send them on the device):
- a reply holding a non-finite value, or one larger than `max_abs`, is rejected with the
  reason (every fleet checks it as it takes the reply in: `edge_sdk.codec.check_weights`, given
  `RunInfo.max_abs`);
- sample weights are capped at `weight_cap` × the round's median, and at `max_samples`;
- each update (the reply's state minus the state the round started from) is bounded at `clip` ×
  the cohort's median update norm, then pulled in to `center_clip` × the median distance from
  the coordinate-wise median of its aggregate's contributions, and counts the less in a mean
  the more it was scaled; the client is flagged in the round's record;
- the clipped updates are combined by `aggregator`: `mean` (weighted, as before), `median`,
  `trimmed_mean` (cutting `trim` of them at each end) or `krum` (tolerating `krum_f`);
- a round whose evaluation shows most clients much worse than the last evaluation is rolled
  back (`rolled_back`, in `coordinator.server`), when some client's update stands out from the
  others' (`standing_out`) and the suspects moved the aggregate (`moved_by`); a drop nobody's
  update explains (training itself, a learning rate too large for the data) would only repeat
  if undone, and stands.
With the defaults, a round in which no update is clipped and no weight capped aggregates exactly
as the plain weighted mean did. Honest clients are not always spared: on unequal splits the
weight cap binds on the largest ones every round, and clipping on a large honest update (their
cost, measured: docs/benchmarks/attacks.md).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.config_sections import RobustConfig
from edge_sdk.robust import (
    RobustError,
    clip_scales,
    clipped,
    coordinate_median,
    krum,
    trimmed_mean,
    update_norms,
)

__all__ = [
    "Contribution",
    "RobustConfig",
    "cap_weights",
    "combine",
    "flagged_before",
    "moved_by",
    "rolled_back",
    "standing_out",
    "suspects",
]

CENTER_MIN = 5  # contributions an aggregate needs for centered clipping
# A round's suspects who moved its aggregates by less than this share of the round's update
# (`moved_by`) did not cause its drop: it is not undone for them.
MOVED_MIN = 0.1


@dataclass(frozen=True)
class Contribution:
    """One state a client sent for one aggregate, the state it started from, and its weight."""

    client: str
    state: Mapping[str, torch.Tensor]
    start: Mapping[str, torch.Tensor]
    weight: float = 1.0


def cap_weights(
    weights: Mapping[str, float], cfg: RobustConfig, flags: dict[str, str]
) -> list[float]:
    """Each client's weight, capped at `weight_cap` × the median and at `max_samples`; capped
    clients are flagged."""
    limit = float("inf")
    if cfg.weight_cap > 0 and len(weights) > 1:
        limit = cfg.weight_cap * statistics.median(weights.values())
    if cfg.max_samples is not None:
        limit = min(limit, float(cfg.max_samples))
    out = []
    for cid, w in weights.items():
        if w > limit:
            _flag(flags, cid, f"sample weight {w:g} capped at {limit:g}")
            w = limit
        out.append(w)
    return out


def combine(
    groups: Mapping[str, Sequence[Contribution]], cfg: RobustConfig, flags: dict[str, str]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per group (one aggregate each: the global model, or each of FedMe's models), its
    contributions bounded and combined by `cfg.aggregator`:
    1. each update's norm at `clip` × the median of the cohort's updates of its architecture (of
       the whole cohort, relative to each model's size, for architectures of fewer than three);
    2. each state's distance from its group's coordinate-wise median at `center_clip` × the
       median distance (centered clipping, Karimireddy et al. 2021): a reversed or inflated
       update bounded in norm still pulls a mean backwards, pulled in to the center it is at
       most a few typical updates away from the honest ones. In a group of fewer than
       CENTER_MIN the median distance says little (of three, the farthest is often twice the
       median away): it is left to step 1;
    3. the mean weighs a contribution by its weight times the square of what it was scaled by:
       one that had to be pulled in far counts little (in FedMe's aggregates of two or three
       copies, a reversed copy clipped to 3x the median still weighed a third); nothing changes
       where nothing was clipped. The median and the trimmed mean weigh it by that square alone
       (ignoring sample weights): three attackers of ten, always on one side of each coordinate,
       no longer shift the median by three places (measured: 35 points lost under Dirichlet
       label skew, none weighted).
    Flags the clients bounded (and, under krum, those not chosen)."""
    bounded: dict[int, tuple[Mapping[str, torch.Tensor], float]] = {}
    for every in _cohorts(groups):
        norms = update_norms([c.state for c in every], [c.start for c in every])
        sizes = _sizes([c.start for c in every])
        for c, norm, scale in zip(every, norms, clip_scales(norms, cfg.clip, sizes), strict=True):
            if scale < 1.0:
                _flag(flags, c.client, f"update norm {norm:.3g} clipped by {scale:.3g}")
                bounded[id(c)] = (clipped(c.state, c.start, scale), scale**2)
            else:
                bounded[id(c)] = (c.state, 1.0)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, group in groups.items():
        states = [bounded[id(c)][0] for c in group]
        trust = [bounded[id(c)][1] for c in group]
        if cfg.center_clip > 0 and len(group) >= CENTER_MIN:
            center = coordinate_median(states)
            dist = update_norms(states, [center] * len(states))
            for i, (d, scale) in enumerate(
                zip(dist, clip_scales(dist, cfg.center_clip), strict=True)
            ):
                if scale < 1.0:
                    _flag(
                        flags, group[i].client, f"{d:.3g} from the median pulled in by {scale:.3g}"
                    )
                    states[i], trust[i] = clipped(states[i], center, scale), trust[i] * scale**2
        out[name] = _aggregate(name, group, states, trust, cfg, flags)
    return out


def _sizes(starts: Sequence[Mapping[str, torch.Tensor]]) -> list[float]:
    """Each start's norm, computed once per distinct start (a round's contributions mostly
    share one: the global model)."""
    unique = {id(s): s for s in starts}
    norms = update_norms(list(unique.values()), [None] * len(unique))
    by_id = dict(zip(unique, norms, strict=True))
    return [by_id[id(s)] for s in starts]


def _cohorts(groups: Mapping[str, Sequence[Contribution]]) -> list[list[Contribution]]:
    """The contributions whose update norms compare: those of one architecture (the same
    tensor names and shapes), when it has three or more; the rest together, relative to each
    model's size."""
    by_arch: dict[tuple[tuple[str, tuple[int, ...]], ...], list[Contribution]] = {}
    for group in groups.values():
        for c in group:
            arch = tuple((k, tuple(t.shape)) for k, t in c.start.items())
            by_arch.setdefault(arch, []).append(c)
    out = [cs for cs in by_arch.values() if len(cs) >= 3]
    rest = [c for cs in by_arch.values() if len(cs) < 3 for c in cs]
    return [*out, rest] if rest else out


def _aggregate(
    name: str,
    group: Sequence[Contribution],
    states: Sequence[Mapping[str, torch.Tensor]],
    trust: Sequence[float],
    cfg: RobustConfig,
    flags: dict[str, str],
) -> dict[str, torch.Tensor]:
    # (imported here: the strategies' base imports this module)
    from coordinator.strategies.base import StrategyError, weighted_mean

    try:
        if cfg.aggregator == "mean":
            weights = [c.weight * t for c, t in zip(group, trust, strict=True)]
            return weighted_mean(states, weights)
        if cfg.aggregator == "median":
            return coordinate_median(states, trust)
        if cfg.aggregator == "trimmed_mean":
            return trimmed_mean(states, cfg.trim, trust)
        chosen, state = krum(states, cfg.krum_f)
    except RobustError as exc:
        raise StrategyError(f"{name}: {exc}") from exc
    for i, c in enumerate(group):
        if i != chosen:
            _flag(flags, c.client, "not chosen by krum")
    return state


def _flag(flags: dict[str, str], cid: str, why: str) -> None:
    flags[cid] = f"{flags[cid]}; {why}" if cid in flags else why


def flagged_before(seen: dict[tuple[str, str], int], r: int, cid: str, why: str) -> int | None:
    """The round `cid` was first flagged in for every reason of `why` (its words, the numbers
    aside: "sample weight # capped at #"), or None where one of them is new in round `r`;
    records the new ones in `seen`. An honest client much larger than the others has its weight
    capped every round of a natural split: the log warns of it once."""
    kinds = [re.sub(r"[-+]?[0-9][0-9.e+-]*", "#", part) for part in why.split("; ")]
    first = [seen.setdefault((cid, k), r) for k in kinds]
    return None if r in first else min(first)


def rolled_back(
    before: Mapping[str, float],
    after: Mapping[str, float | None],
    cfg: RobustConfig,
) -> list[str] | None:
    """The clients much worse after the round than before it (accuracy down by `rollback_drop`
    or more, or no evaluation at all), when they are more than `rollback_share` of the clients
    evaluated both times; else None (the round stands)."""
    if not cfg.rollback:
        return None
    both = sorted(set(before) & set(after))
    if not both:
        return None
    worse = [c for c in both if (a := after[c]) is None or before[c] - a >= cfg.rollback_drop]
    return worse if len(worse) > cfg.rollback_share * len(both) else None


def _distances(groups: Mapping[str, Sequence[Contribution]]) -> dict[str, float]:
    """Each client's farthest contribution from its group's coordinate-wise median, relative to
    the model's size."""
    far: dict[str, float] = {}
    for group in groups.values():
        if not group:
            continue
        center = coordinate_median([c.state for c in group])
        sizes = [max(size, 1e-12) for size in _sizes([c.start for c in group])]
        dist = update_norms([c.state for c in group], [center] * len(group))
        for c, d, size in zip(group, dist, sizes, strict=True):
            far[c.client] = max(far.get(c.client, 0.0), d / size)
    return far


def standing_out(groups: Mapping[str, Sequence[Contribution]]) -> list[str]:
    """The clients whose contribution lies farther from its group's coordinate-wise median than
    twice the typical distance: an update unlike the others'."""
    far = _distances(groups)
    if not far:
        return []
    typical = statistics.median(far.values())
    return sorted(c for c, d in far.items() if d > 2 * typical)


def suspects(groups: Mapping[str, Sequence[Contribution]], flags: Mapping[str, str]) -> list[str]:
    """Who most likely poisoned a round: the clients flagged in it, and those whose update
    stands out (`standing_out`); the farthest one when nobody does."""
    out = set(flags) | set(standing_out(groups))
    if out:
        return sorted(out)
    far = _distances(groups)
    return [max(far, key=far.__getitem__)] if far else []


def moved_by(
    groups: Mapping[str, Sequence[Contribution]], who: Sequence[str], cfg: RobustConfig
) -> float:
    """How far the contributions of `who` moved the round's aggregates: over the groups, the
    largest distance between the aggregate with them and the aggregate without them, relative
    to the latter's update (its distance from the state the round started from). Near 0 when
    their updates were bounded to nearly nothing; inf where a group has no one else, or cannot
    be combined without them."""
    if not who:
        return 0.0
    rest = {name: [c for c in g if c.client not in who] for name, g in groups.items()}
    if any(g and not rest[name] for name, g in groups.items()):
        return math.inf
    scratch: dict[str, str] = {}  # (flags of these recomputations: not the round's)
    try:
        with_them = combine(groups, cfg, scratch)
        without = combine({n: g for n, g in rest.items() if g}, cfg, scratch)
    except ValueError:  # (StrategyError and RobustError are ValueErrors): cannot tell
        return math.inf
    far = 0.0
    for name, state in without.items():
        moved, step = update_norms([with_them[name], state], [state, groups[name][0].start])
        far = max(far, moved / max(step, 1e-12))
    return far
