"""Random ids for blobs, tasks and sessions: one generator per process, reseeded in a fork."""

from __future__ import annotations

import os
import random

__all__ = ["unique_id"]

_IDS = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _IDS.seed(os.urandom(16)))  # no ids shared by forks


def unique_id(bits: int = 128) -> str:
    """A random hex id (blob and task ids), from a generator seeded once per process: a uuid4
    reads the OS's random source every time, a system call that, under a simulation's hundred
    threads, cost ~0.4 ms waiting to get the interpreter back (benchmarks/simulate_scale.py)."""
    return f"{_IDS.getrandbits(bits):0{bits // 4}x}"
