"""pfml: w ← (1−β)·w + β·mean_{i∈U}(w_i) over the sampled clients U (β = 1 is FedAvg)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.strategies.base import (
    FitReply,
    GlobalModelStrategy,
    StrategyError,
    register_strategy,
)
from edge_sdk.algorithms.pfml import PFMLConfig
from edge_sdk.codec import WireModel
from model_zoo import ArchSpec


@register_strategy
class PFMLStrategy(GlobalModelStrategy):
    name = "pfml"
    config: PFMLConfig

    def setup(self) -> None:
        super().setup()
        self._require_classes()
        self._aggregate_ids: list[str] = []

    def configure_fit(self, round_: int) -> dict[str, dict[str, WireModel]]:
        # "sampled": only U trains (Algorithm 1); "all": everyone trains, only U is aggregated.
        self._aggregate_ids = self.sample(round_)
        train = self.online() if self.config.participation == "all" else self._aggregate_ids
        return {cid: self.eval_models() for cid in train}

    def quorum_clients(self, plan: Mapping[str, object]) -> set[str]:
        # Only the sampled U are aggregated: replies from the others cannot make a round count.
        return set(self._aggregate_ids)

    def expected_models(self, client_id: str) -> dict[str, ArchSpec]:
        assert self.global_spec is not None
        return {"local": self.global_spec}

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        chosen = {cid: r for cid, r in replies.items() if cid in self._aggregate_ids}
        if not chosen:
            raise StrategyError(
                f"pfml round {round_}: no reply from the aggregated clients {self._aggregate_ids}"
            )
        mean = self._aggregate(
            {cid: r.models["local"].weights for cid, r in chosen.items()}, self._weights(chosen)
        )
        beta = self.config.beta
        self.global_weights = {
            k: ((1 - beta) * w + beta * mean[k]) if w.is_floating_point() else mean[k]
            for k, w in self.global_weights.items()
        }

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"aggregate_ids": list(self._aggregate_ids)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._aggregate_ids = list(state.get("aggregate_ids", []))
