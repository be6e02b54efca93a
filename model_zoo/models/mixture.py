"""A mixture of models (`mixture`): the predictor of FedeRiCo (Find Your Friends, paper 003).

`p(y|x) = Σ_k w_k · p(y|x; θ_k)` over member models that may have different architectures (they
share the input shape and the classes). The forward pass returns log p(y|x), so the output plays
the role of logits everywhere else in the SDK: its argmax is the mixture's prediction and its
softmax the mixture's probabilities. As a zoo family it travels and exports like any model:
`ArchSpec(family="mixture", kwargs={"members": [spec, ...], "weights": [w, ...]})`, with the
members' weights under `members.<k>.` in its state dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_zoo.spec import ArchSpec, ModelZooError, build, input_dtype, register

__all__ = ["Mixture", "build_mixture", "mixture_spec"]


class Mixture(nn.Module):
    def __init__(self, members: list[nn.Module], weights: list[float]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        w = torch.tensor(weights, dtype=torch.float32)
        self.log_weights: torch.Tensor
        self.register_buffer("log_weights", torch.log(w / w.sum()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (K, ..., C): the members' log-probabilities over the last dimension, so that members
        # stacked over clients (coordinator.stacking: (clients, B, C)) mix as one member does
        logp = torch.stack([F.log_softmax(member(x), dim=-1) for member in self.members])
        shape = (-1,) + (1,) * (logp.dim() - 1)
        return torch.logsumexp(logp + self.log_weights.view(shape), dim=0)  # (..., C)


def _member_specs(input_shape: tuple[int, ...], num_classes: int, members: Any) -> list[ArchSpec]:
    if not isinstance(members, list) or not members:
        raise ModelZooError("a mixture needs a non-empty list of member specs")
    specs = [ArchSpec.model_validate(m) for m in members]
    for s in specs:
        if s.family == "mixture":
            raise ModelZooError("a mixture's members cannot be mixtures")
        if tuple(s.input_shape) != tuple(input_shape) or s.num_classes != num_classes:
            raise ModelZooError(
                f"mixture member {s} does not take {input_shape} to {num_classes} classes"
            )
    if len({input_dtype(s) for s in specs}) > 1:
        raise ModelZooError("mixture members must take the same input dtype")
    return specs


@register("mixture", input_dtype=lambda spec: input_dtype(_first_member(spec)), composite=True)
def build_mixture(
    input_shape: tuple[int, ...], num_classes: int, members: Any, weights: Any
) -> Mixture:
    specs = _member_specs(input_shape, num_classes, members)
    if not isinstance(weights, list) or len(weights) != len(specs):
        raise ModelZooError(f"a mixture of {len(specs)} members needs {len(specs)} weights")
    if not all(isinstance(w, int | float) and math.isfinite(w) and w > 0 for w in weights):
        raise ModelZooError(f"mixture weights must be finite and positive, got {weights}")
    return Mixture([build(s) for s in specs], [float(w) for w in weights])


def _first_member(spec: ArchSpec) -> ArchSpec:
    return ArchSpec.model_validate(spec.kwargs["members"][0])


def mixture_spec(members: list[ArchSpec], weights: list[float]) -> ArchSpec:
    """The spec of the mixture of `members` with `weights` (they need not sum to 1)."""
    first = members[0]
    return ArchSpec(
        family="mixture",
        num_classes=first.num_classes,
        input_shape=first.input_shape,
        kwargs={"members": [m.model_dump(mode="json") for m in members], "weights": weights},
    )
