"""The members that sit a stacked step out: which members take the step (`Stepping`), and the
rows of the optimizers' parameters and state that must not change for the others (`Frozen`),
saved before the update and put back after it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Frozen", "Stepping"]


@dataclass
class Stepping:
    rows: int  # the stack's first `rows` members run this step
    active: torch.Tensor | None  # masked: (N,) 1.0 for a member taking it, 0.0 for one that is not


class Frozen:
    """The rows of the optimizers' parameters and state that must not change in this step
    (the members not taking it), saved before the update and put back after it."""

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], stepping: Stepping | None, n: int
    ) -> None:
        self.tensors: list[torch.Tensor] = []
        self.saved: list[torch.Tensor] = []
        self.active = None if stepping is None else stepping.active
        rows = n if stepping is None else stepping.rows
        if self.active is None and rows == n:
            return  # everyone takes this step
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    for t in [p, *state.values()]:
                        if isinstance(t, torch.Tensor) and t.dim() and len(t) == n:
                            self.tensors.append(t if self.active is not None else t[rows:])
        # Few kernels (a masked step on CUDA saves and restores every row of every tensor,
        # each step): one copy for all tensors, then one `where` per tensor, in place.
        with torch.no_grad():
            self.saved = [torch.empty_like(t) for t in self.tensors]
            torch._foreach_copy_(self.saved, self.tensors)

    @torch.no_grad()
    def restore(self) -> None:
        if not self.tensors:
            return
        if self.active is None:
            torch._foreach_copy_(self.tensors, self.saved)
            return
        keep = self.active.bool()
        for t, s in zip(self.tensors, self.saved, strict=True):
            torch.where(keep.view(-1, *[1] * (t.dim() - 1)), t, s, out=t)
