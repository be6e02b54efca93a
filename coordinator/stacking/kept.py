"""Stacks kept from one fit to the same clients' next, owned by whoever runs the rounds.

A stack built anew every round has new tensors, so its captured step (CUDA) was warmed up and
captured again every round. Where the trainer captures, a fit's stack is kept for the same
members' next fit instead, and its tensors are refilled in place from the members' state: the
step, kept by the stack's trainer (Trainer.run's keep), then replays from its first batch. Each
kept stack holds a copy of its members' state and its graphs' memory: a few per fleet.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from edge_sdk.algorithms.base import ClientAlgorithm

__all__ = ["KeptStacks"]


@dataclass
class _Kept:
    members: list[weakref.ref[ClientAlgorithm]]
    stacked: ClientAlgorithm


class KeptStacks:
    """Up to `limit` stacks, each under the members it trained (by identity, in order), the
    least recently kept let go first. Thread-safe: a fleet trains groups on several threads."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._stacks: OrderedDict[tuple[Any, ...], _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stacks)

    def __iter__(self) -> Iterator[ClientAlgorithm]:
        """The kept stacks, least recently kept first."""
        with self._lock:
            return iter([k.stacked for k in self._stacks.values()])

    def members(self, stacked: ClientAlgorithm) -> list[ClientAlgorithm | None]:
        """The members `stacked` is kept under (None for one that is gone)."""
        with self._lock:
            kept = next(k for k in self._stacks.values() if k.stacked is stacked)
        return [r() for r in kept.members]

    def clear(self) -> None:
        """Let go of every kept stack (and the memory of its captured steps): after a stack ran
        out of GPU memory."""
        with self._lock:
            self._stacks.clear()

    def take(self, members: Sequence[ClientAlgorithm]) -> ClientAlgorithm | None:
        """The stack these very members (in this order) trained in last, taken out of the keep
        while it is in use; None if there is none."""
        with self._lock:
            kept = self._stacks.pop(_key(members), None)
        if kept is None or any(r() is not a for r, a in zip(kept.members, members, strict=True)):
            return None  # (an id reused by another object)
        return kept.stacked

    def put(self, members: Sequence[ClientAlgorithm], stacked: ClientAlgorithm) -> None:
        """Keep `stacked` for these members' next fit."""
        with self._lock:
            # A stack one of whose members is gone (a client parked between its tasks: a
            # population larger than a round's cohort) is never taken again: let it go now.
            for gone in [k for k, v in self._stacks.items() if any(r() is None for r in v.members)]:
                del self._stacks[gone]
            key = _key(members)
            self._stacks[key] = _Kept([weakref.ref(a) for a in members], stacked)
            self._stacks.move_to_end(key)
            while len(self._stacks) > self.limit:
                self._stacks.popitem(last=False)


def _key(members: Sequence[ClientAlgorithm]) -> tuple[Any, ...]:
    return (type(members[0]), *map(id, members))
