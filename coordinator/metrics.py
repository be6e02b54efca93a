"""Personalization metrics of the PersFL thesis (paper 002, section 5.2.3).

Per client i, with P_i the personalized accuracy, G_i the global FedAvg accuracy and L_i the
local-only accuracy, the Quantum of Improvement is (Eq. 5.2)::

    QoI_i = P_i - max(G_i, L_i)

Performance metrics are computed on the QoI (Eq. 5.3-5.6), fairness metrics on a distribution of
non-negative values F_1..F_K (Eq. 5.7-5.13).

Scales. Inputs are accuracies as fractions in [0, 1], as the SDK reports them. :func:`qoi`
returns QoI on that same fraction scale. :func:`personalization_metrics` reports on the thesis's
percent scale so that its numbers read like the thesis's tables (e.g. "MPI 38.74"): PUI and PUD
in percent of clients, MPI/API/MPD/APD in percentage points, AV in squared percentage points.
CS, Entropy and JI do not depend on the scale.

Decisions where the thesis leaves room:

* Signs: MPD and APD are the median and mean of U- "the QoI of the set of users whose performance
  decreased" (Eq. 5.6 sums QoI_i over U-), so they are negative numbers.
* A client with QoI exactly 0 is in neither U+ nor U- but counts in COUNT(U), so
  PUI + PUD <= 100.
* AV is the population variance, "AV = 1/K sum (F_i - F_bar)^2" (Eq. 5.8).
* Entropy uses the natural logarithm (Eq. 5.12 writes an unqualified "log"); its maximum, for K
  equal values, is ln K. Terms with F_i = 0 contribute 0 (the limit of p log p).
* The top-level AV/CS/Entropy/JI are computed over the per-client personalized accuracies, "the
  performance distribution among K users represented by {F_1(t), ..., F_K(t)}" for technique t.
  This is also the reading under which the thesis's motivating example (Table 5.1) holds:
  "Alg.1 is the fairest among all the algorithms" - Alg.1 has the lowest AV and the highest CS,
  Entropy and JI over its accuracies, but not over its QoI.
* The thesis also applies fairness to the QoI, and since "the QoI can have negative values ...
  split the QoI into two sets: a set of QoI values made up of users who have experienced an
  increase (U+), and a set of absolute QoI values made up of users who have experienced a
  decrease (U-). Then the fairness metrics can be applied to both these sets independently".
  Those are the extra keys ``fairness_improved`` (over U+) and ``fairness_worsened`` (over |U-|),
  each a fairness dict or None when its set is empty. When every client improved (the thesis's
  chapter 6 case), ``fairness_improved`` is fairness over all the QoI.
"""

from __future__ import annotations

import logging
import math
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "FAIRNESS_KEYS",
    "METRIC_DESCRIPTIONS",
    "METRIC_KEYS",
    "PERFORMANCE_KEYS",
    "fairness",
    "personalization_metrics",
    "qoi",
]

logger = logging.getLogger(__name__)

PERFORMANCE_KEYS: Final[tuple[str, ...]] = ("PUI", "PUD", "MPI", "API", "MPD", "APD")
FAIRNESS_KEYS: Final[tuple[str, ...]] = ("AV", "CS", "Entropy", "JI")
METRIC_KEYS: Final[tuple[str, ...]] = PERFORMANCE_KEYS + FAIRNESS_KEYS

METRIC_DESCRIPTIONS: Final[dict[str, str]] = {
    "PUI": "percent of clients whose personalized model beats both local and global (QoI > 0)",
    "PUD": "percent of clients whose personalized model is worse than local or global (QoI < 0)",
    "MPI": "median QoI over improved clients, in percentage points",
    "API": "mean QoI over improved clients, in percentage points",
    "MPD": "median QoI over worsened clients, in percentage points (negative)",
    "APD": "mean QoI over worsened clients, in percentage points (negative)",
    "AV": "population variance of the values (lower is fairer)",
    "CS": "cosine similarity with the all-ones vector, mean / root-mean-square (1 is fairest)",
    "Entropy": "natural-log entropy of the normalised values (ln K is fairest)",
    "JI": "Jain's index (sum)^2 / (K * sum of squares), in [1/K, 1] (1 is fairest)",
}

_PERCENT: Final[float] = 100.0

Values = npt.ArrayLike


def _as_vector(name: str, values: Values) -> np.ndarray:
    """Convert ``values`` to a finite, non-empty 1-D float array, or raise ValueError."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} must be a sequence of numbers, one per client; got {values!r}"
        ) from exc
    if array.ndim != 1:
        raise ValueError(
            f"{name} must be one-dimensional (one value per client); got shape {array.shape}"
        )
    if array.size == 0:
        raise ValueError(f"{name} is empty; metrics need at least one client")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size and isinstance(values, list | tuple):
        # numpy turns None into NaN; name it, since it usually means "baseline not run".
        missing = [i for i in bad.tolist() if values[i] is None]
        if missing:
            raise ValueError(
                f"{name} has missing (None) values at client positions {missing}; every client "
                "needs a number (run the local and global baselines for all clients)"
            )
    if bad.size:
        raise ValueError(
            f"{name} has non-finite values at client positions {bad.tolist()}: "
            f"{array[bad].tolist()}"
        )
    return array


def _as_accuracies(name: str, values: Values) -> np.ndarray:
    """Like :func:`_as_vector`, and also require accuracies as fractions in [0, 1]."""
    array = _as_vector(name, values)
    bad = np.flatnonzero((array < 0.0) | (array > 1.0))
    if bad.size:
        raise ValueError(
            f"{name} must hold accuracies as fractions in [0, 1]; positions {bad.tolist()} "
            f"hold {array[bad].tolist()} (divide percentages by 100)"
        )
    return array


def qoi(personal: Values, global_: Values, local: Values) -> np.ndarray:
    """Quantum of Improvement per client, ``P_i - max(G_i, L_i)`` (thesis Eq. 5.2).

    Args:
        personal: personalized-model accuracy per client, fractions in [0, 1].
        global_: global (FedAvg) model accuracy per client, same order and scale.
        local: local-only model accuracy per client, same order and scale.

    Returns:
        A float array of QoI on the input's fraction scale, in [-1, 1].

    Raises:
        ValueError: if an input is empty, not 1-D, non-numeric, non-finite, outside [0, 1], or
            the three lengths differ.
    """
    p = _as_accuracies("personal", personal)
    g = _as_accuracies("global_", global_)
    loc = _as_accuracies("local", local)
    if not p.size == g.size == loc.size:
        raise ValueError(
            "personal, global_ and local must have one value per client in the same order; got "
            f"lengths {p.size}, {g.size} and {loc.size}"
        )
    return p - np.maximum(g, loc)


def fairness(values: Values) -> dict[str, float]:
    """Fairness of a distribution of non-negative values (thesis Eq. 5.8, 5.10, 5.12, 5.13).

    ``values`` may be accuracies or QoI magnitudes, on any scale; AV scales with the square of
    the unit, CS, Entropy and JI are scale-free.

    Returns:
        ``{"AV": population variance, "CS": mean / root-mean-square,
        "Entropy": -sum(p_i ln p_i) with p_i = F_i / sum(F), "JI": (sum F)^2 / (K sum F^2)}``.

    Raises:
        ValueError: if ``values`` is empty, not 1-D, non-finite, has a negative value (split
            QoI into U+ and |U-| first, as the thesis prescribes) or is all zeros (CS, Entropy
            and JI are 0/0 then).
    """
    f = _as_vector("values", values)
    negative = np.flatnonzero(f < 0.0)
    if negative.size:
        raise ValueError(
            f"fairness needs non-negative values; positions {negative.tolist()} are negative. "
            "For QoI, apply it to the improved values and to the absolute worsened values "
            "separately (see personalization_metrics)"
        )
    total = float(f.sum())
    if total == 0.0:
        raise ValueError(
            "fairness is undefined when every value is 0 (CS, Entropy and JI divide by zero)"
        )
    k = f.size
    sum_sq = float(np.square(f).sum())
    shares = f[f > 0.0] / total
    return {
        "AV": float(np.mean(np.square(f - f.mean()))),
        "CS": float((total / k) / math.sqrt(sum_sq / k)),
        "Entropy": 0.0 - float(np.sum(shares * np.log(shares))),  # 0.0 - x: never -0.0
        "JI": float(total * total / (k * sum_sq)),
    }


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if values.size else None


def _mean(values: np.ndarray) -> float | None:
    return float(np.mean(values)) if values.size else None


def personalization_metrics(
    personal: Values, global_: Values, local: Values
) -> dict[str, float | dict[str, float] | None]:
    """All thesis metrics for one run, on the thesis's percent scale (see the module docstring).

    Args:
        personal: personalized-model accuracy per client, fractions in [0, 1].
        global_: global (FedAvg) model accuracy per client, same order and scale.
        local: local-only model accuracy per client, same order and scale.

    Returns:
        A JSON-ready dict with the keys of :data:`METRIC_KEYS` plus ``fairness_improved`` and
        ``fairness_worsened``. PUI/PUD are percent of clients; MPI/API (MPD/APD) are the median
        and mean QoI over improved (worsened) clients in percentage points, None when no client
        is in that set; AV/CS/Entropy/JI are fairness over the personalized accuracies in
        percent (CS/Entropy/JI are None when every accuracy is 0); ``fairness_improved`` is
        fairness over U+ and ``fairness_worsened`` over |U-|, each None when the set is empty.

    Raises:
        ValueError: on invalid inputs, as for :func:`qoi`.
    """
    improvement = qoi(personal, global_, local) * _PERCENT
    accuracy = _as_accuracies("personal", personal) * _PERCENT
    k = improvement.size
    improved = improvement[improvement > 0.0]
    worsened = improvement[improvement < 0.0]

    metrics: dict[str, float | dict[str, float] | None] = {
        "PUI": _PERCENT * improved.size / k,
        "PUD": _PERCENT * worsened.size / k,
        "MPI": _median(improved),
        "API": _mean(improved),
        "MPD": _median(worsened),
        "APD": _mean(worsened),
    }
    if np.any(accuracy > 0.0):
        metrics.update(fairness(accuracy))
    else:
        logger.warning(
            "every personalized accuracy is 0: AV is 0 and CS, Entropy and JI are undefined"
        )
        metrics.update({"AV": 0.0, "CS": None, "Entropy": None, "JI": None})
    metrics["fairness_improved"] = fairness(improved) if improved.size else None
    metrics["fairness_worsened"] = fairness(np.abs(worsened)) if worsened.size else None
    return metrics
