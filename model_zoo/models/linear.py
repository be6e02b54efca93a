"""Fully connected families: multinomial logistic regression (`mlr`) and the multilayer
perceptron (`mlp`).

Both are the convex / shallow baselines of the federated-learning literature: MLR is the convex
model of FedAvg-style experiments (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017) and the MLP sizes follow the Synthetic (60-20-10)
and MNIST (784-100-10) set-ups used by Per-FedAvg (Fallah et al., NeurIPS 2020) and by the
FML / PFML papers (Shen et al., "Federated Mutual Learning", 2020).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from model_zoo.models._shapes import flat_features
from model_zoo.spec import ModelZooError, register

__all__ = ["MLP", "MultinomialLogisticRegression", "build_mlp", "build_mlr"]


class MultinomialLogisticRegression(nn.Module):
    """Flatten, then one affine map to class logits (softmax regression)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.linear = nn.Linear(flat_features(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.flatten(x, 1))


class MLP(nn.Module):
    """Flatten, then `hidden` Linear+ReLU layers, then a Linear layer to class logits."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int]):
        super().__init__()
        widths = [flat_features(input_shape), *hidden]
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(torch.flatten(x, 1))


@register("mlr")
def build_mlr(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Any input shape: it is flattened."""
    return MultinomialLogisticRegression(input_shape, num_classes)


@register("mlp")
def build_mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (100,)
) -> nn.Module:
    """Any input shape: it is flattened. `hidden` lists the hidden layer widths (may be empty)."""
    if isinstance(hidden, int) or not all(isinstance(h, int) and h >= 1 for h in hidden):
        raise ModelZooError(
            f"mlp kwarg 'hidden' must be a list of positive ints such as [100], got {hidden!r}"
        )
    return MLP(input_shape, num_classes, tuple(hidden))
