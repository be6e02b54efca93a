"""fedavg: the global model becomes the (sample-weighted or uniform) mean of client models."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.strategies.base import (
    FitReply,
    GlobalModelStrategy,
    register_strategy,
)
from model_zoo import ArchSpec


@register_strategy
class FedAvgStrategy(GlobalModelStrategy):
    name = "fedavg"
    one_architecture = True

    def setup(self) -> None:
        super().setup()
        if self.one_architecture:
            self._require_same_arch()
        else:  # any architecture of its own, as long as the global one fits its classes
            self._require_classes()

    def expected_models(self, client_id: str) -> dict[str, ArchSpec]:
        assert self.global_spec is not None
        return {"model": self.global_spec}

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        states = {cid: r.models["model"].weights for cid, r in replies.items()}
        self.global_weights = self._aggregate(states, self._weights(replies))
