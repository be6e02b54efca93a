"""Whether stacking pays, measured per group on the run itself.

Stacking runs a group's ops once for all its clients, but its step is heavier in Python (vmap,
functional calls), which holds the interpreter lock: two stacks on two worker threads barely
run at once, where clients one by one do. So a small group of small models can train faster
one by one, and which way wins depends on the machine and on what else runs on it. Nothing
fixed decides it: each group (algorithm, architecture, config) on the CPU is timed both ways
on its own fits, and trains the faster way. (On a GPU, where stacking measured 3.6-41x faster,
the local fleet does not time it.)

A group's first fit runs stacked and is not counted (it holds one-off costs: building the
stack, warming caches), its second runs one by one, its third stacked; from then on it runs
the way that took fewer seconds per training sample. While the two are within `RETRY_WITHIN`
of each other, the other way is timed again every `RETRY_EVERY`-th fit, so that a load that
comes or goes turns the choice. Stacked and one by one give the same results to float
rounding (`tests/edge_sdk/test_cohort.py`), so the choice changes speed, not what is learnt;
`cohort_auto = false` always stacks, so that two runs take the same path to the bit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["RETRY_EVERY", "RETRY_WITHIN", "Pays"]

log = logging.getLogger(__name__)

RETRY_EVERY = 10  # fits of a group between timings of the way it does not run
RETRY_WITHIN = 2.0  # ... while the slower way took at most this times the faster's


@dataclass
class _Timed:
    label: str
    fits: int = 0
    stacked: float | None = None  # seconds per training sample, the last time it ran that way
    alone: float | None = None
    settled: bool | None = None  # the way it runs once both are timed (retries aside)


class Pays:
    """The choice per group, from its fits' timings. Thread-safe: a fleet runs its groups on
    several threads."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, _Timed] = {}
        self._lock = threading.Lock()

    def stacked(self, group: Hashable, label: str) -> bool:
        """Whether this fit of `group` (`label`: what it is, in words, for the log) runs
        stacked (see the module's docstring); counts it."""
        with self._lock:
            t = self._groups.setdefault(group, _Timed(label))
            t.fits += 1
            if t.fits == 1:
                return True  # warm-up, not counted
            if t.alone is None:
                return False
            if t.stacked is None:
                return True
            faster = t.stacked <= t.alone
            if faster != t.settled:
                t.settled = faster
                log.info(
                    "%s train %s: stacked, a training sample took %.2f× its time one by one",
                    t.label,
                    "stacked" if faster else "one by one",
                    t.stacked / t.alone,
                )
            close = max(t.stacked, t.alone) <= RETRY_WITHIN * min(t.stacked, t.alone)
            return faster != (close and t.fits % RETRY_EVERY == 0)

    def record(self, group: Hashable, stacked: bool, seconds: float, samples: int) -> None:
        """A fit of `group` took `seconds` of its workers' time for `samples` training samples,
        `stacked` or one by one (its first fit's timing is ignored)."""
        with self._lock:
            t = self._groups.get(group)
            if t is None or t.fits < 2 or samples <= 0:
                return
            per = seconds / samples
            if stacked:
                t.stacked = per
            else:
                t.alone = per

    def ratio(self, group: Hashable) -> float | None:
        """Stacked seconds over one-by-one seconds per sample, once both are timed."""
        with self._lock:
            t = self._groups.get(group)
            if t is None or t.stacked is None or t.alone is None:
                return None
            return t.stacked / t.alone
