"""fedprox: FedAvg plus μ/2·||w − w_global||² in the local loss (Li et al., 2020)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field
from torch import nn

from edge_sdk.algorithms.base import register_algorithm
from edge_sdk.algorithms.fedavg import FedAvg, FedAvgConfig
from edge_sdk.losses import proximal

__all__ = ["FedProx", "FedProxConfig"]


class FedProxConfig(FedAvgConfig):
    mu: float = Field(0.01, ge=0)


@register_algorithm
class FedProx(FedAvg):
    name = "fedprox"
    config_cls = FedProxConfig
    config: FedProxConfig

    def _extra_loss(self) -> Callable[[nn.Module], torch.Tensor] | None:
        mu = self.config.mu
        if mu == 0:
            return None
        anchor = [p.detach().clone() for p in self.model.parameters()]  # = global, just loaded
        return lambda model: proximal(model.parameters(), anchor, mu)
