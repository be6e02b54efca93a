"""fedavg_ft: FedAvg rounds; the final global model goes out with the finalize task to fine-tune."""

from __future__ import annotations

from coordinator.strategies.base import register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy


@register_strategy
class FedAvgFTStrategy(FedAvgStrategy):
    name = "fedavg_ft"
