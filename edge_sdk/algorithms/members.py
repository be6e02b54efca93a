"""What an algorithm's round uses where the clients of a stack differ.

The simulator may run one algorithm's round once for many clients of one architecture, on
models whose parameters carry a leading client dimension (`coordinator.stacking`); a device
never does. An algorithm written for it takes no branch on a value that differs
between clients: such a value is a `PerMember` list, which refuses to be decided on, a decision
per client is applied row by row (`take_rows`), and what cannot be is refused with
`CohortUnsupported` (those clients then train one by one). This module is all of it a device
loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["CohortUnsupported", "PerMember", "rows_taken", "take_rows"]


class CohortUnsupported(ValueError):
    """This group cannot train stacked (its members then train one by one)."""


class PerMember(list[Any]):
    """One value per member of a stack (a stacked fit's per-client results). A stacked fit
    cannot take a different branch per member, so deciding on one is refused: the group then
    trains one by one."""

    def _decide(self, *_: object) -> bool:
        raise CohortUnsupported("the algorithm takes a decision per client on a stacked value")

    __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _decide


def take_rows(into: nn.Module, source: nn.Module, which: Sequence[bool | float]) -> None:
    """Stacked modules of one architecture: `into`'s rows become `source`'s for the members
    `which` marks, in place (a decision per member applied row by row)."""
    rows = [i for i, w in enumerate(which) if w]
    if not rows:
        return
    with torch.no_grad():
        for p, q in zip(into.parameters(), source.parameters(), strict=True):
            p[rows] = q[rows]


def rows_taken(
    into: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor], which: Sequence[bool]
) -> dict[str, torch.Tensor]:
    """States of stacked modules: a copy of `into`'s, with `source`'s rows for the members
    `which` marks."""
    rows = [i for i, w in enumerate(which) if w]
    out = {k: v.clone() for k, v in into.items()}
    for k, v in out.items():
        v[rows] = source[k][rows]
    return out
