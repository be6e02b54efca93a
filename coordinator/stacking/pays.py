"""Whether stacking pays, measured on the run itself.

Stacking runs a group's ops once for all its clients, but its step is heavier in Python (vmap,
functional calls), which holds the interpreter lock: two stacks on two worker threads barely
run at once, where clients one by one do, and a few large jobs fill the workers worse than many
small ones. So a few small groups of small models can train faster one by one, and which way
wins depends on the machine, on what else runs on it, and on the groups beside each other.
Nothing fixed decides it: the groups a fit phase holds on the CPU (each an algorithm,
architecture, config and step) are timed both ways together, and train the faster way. (On a
GPU, where stacking measured 3.6-41x faster, the local fleet does not time it.)

The first two fits run stacked, the next two one by one, and only the second of each pair is
counted: a way's first fit after a switch pays for it (the first builds the stacks, the members'
tensors are laid out again, the other path's caches warm up), and counted, it made the faster
way look the slower on both workloads of benchmarks/stacking_contention.py. From then on the
faster way runs, by seconds of the phase per training sample (the mean of each way's last
`WINDOW` timings: one fit's time varies by about 10%, as much as the two ways differ in the
cases that are close); the evaluation and finalize
phases follow it. While the two are within `RETRY_WITHIN` of each other, the other way runs
again for two fits every `RETRY_EVERY` fits (the second timed), so that a load that comes or
goes turns the choice. Stacked and one by one give the same results to float rounding
(`tests/edge_sdk/test_cohort.py`), so the choice changes speed, not what is learnt;
`cohort_auto = false` always stacks, so that two runs take the same path to the bit.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["RETRY_EVERY", "RETRY_WITHIN", "WINDOW", "Pays"]

log = logging.getLogger(__name__)

RETRY_EVERY = 10  # fits of a group between timings of the way it does not run
RETRY_WITHIN = 2.0  # ... while the slower way took at most this times the faster's
WINDOW = 5  # the timings each way that are compared (their mean): one fit's is noisy (±10%)


@dataclass
class _Timed:
    label: str
    fits: int = 0
    last: bool | None = None  # the way the last fit ran
    streak: int = 0  # fits in a row it ran that way
    # seconds per training sample, its last `WINDOW` timings each way
    times: dict[bool, deque[float]] = field(
        default_factory=lambda: {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}
    )
    settled: bool | None = None  # the faster way, once both are timed

    def mean(self, stacked: bool) -> float | None:
        got = self.times[stacked]
        return sum(got) / len(got) if got else None


class Pays:
    """The choice per group (what is timed together: a fit phase's groups), from its fits'
    timings. Thread-safe."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, _Timed] = {}
        self._lock = threading.Lock()

    def stacked(self, group: Hashable, label: str) -> bool:
        """Whether this fit of `group` (`label`: what it is, in words, for the log) runs
        stacked (see the module's docstring); counts it."""
        with self._lock:
            t = self._groups.setdefault(group, _Timed(label))
            t.fits += 1
            stacked, alone = t.mean(True), t.mean(False)
            if stacked is None:
                way = True
            elif alone is None:
                way = False
            else:
                faster = stacked <= alone
                if faster != t.settled:
                    t.settled = faster
                    log.info(
                        "%s train %s: stacked, a training sample took %.2f× its time one by one",
                        t.label,
                        "stacked" if faster else "one by one",
                        stacked / alone,
                    )
                close = max(stacked, alone) <= RETRY_WITHIN * min(stacked, alone)
                # (the other way two fits in a row: the first after a switch is not counted)
                way = faster != (close and t.fits % RETRY_EVERY in (0, 1))
            t.streak = t.streak + 1 if way == t.last else 1
            t.last = way
            return way

    def settled(self, group: Hashable) -> bool:
        """Whether `group`'s other phases (evaluation, finalize) stack: as its fits settled,
        stacked until they have."""
        with self._lock:
            t = self._groups.get(group)
            return t is None or t.settled is None or t.settled

    def record(self, group: Hashable, stacked: bool, seconds: float, samples: int) -> None:
        """A fit of `group` took `seconds` for `samples` training samples, `stacked` or one by
        one. Only a way's second fit in a row or later is counted: the first after a switch
        pays for it (the members' tensors laid out again, the other path's caches warmed)."""
        with self._lock:
            t = self._groups.get(group)
            if t is None or t.streak < 2 or t.last != stacked or samples <= 0:
                return
            t.times[stacked].append(seconds / samples)

    def ratio(self, group: Hashable) -> float | None:
        """Stacked seconds over one-by-one seconds per sample, once both are timed."""
        with self._lock:
            t = self._groups.get(group)
            stacked, alone = (None, None) if t is None else (t.mean(True), t.mean(False))
            if stacked is None or alone is None:
                return None
            return stacked / alone
