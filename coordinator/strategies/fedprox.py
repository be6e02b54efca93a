"""fedprox: server side identical to FedAvg; the proximal term lives on the device."""

from __future__ import annotations

from coordinator.strategies.base import register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy


@register_strategy
class FedProxStrategy(FedAvgStrategy):
    name = "fedprox"
