"""fml: average the clients' meme models (uniform by default); optionally only a shared backbone."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.strategies.base import (
    FitReply,
    GlobalModelStrategy,
    StrategyError,
    register_strategy,
)
from edge_sdk.algorithms.fml import FMLConfig, shared_keys
from model_zoo import ArchSpec


@register_strategy
class FMLStrategy(GlobalModelStrategy):
    name = "fml"
    config: FMLConfig

    def setup(self) -> None:
        super().setup()
        prefixes = self.config.shared_prefixes
        if prefixes and self.config.guard_peers:
            raise StrategyError(
                "fml: guard_peers mixes whole trained copies of the global model, and with "
                f"shared_prefixes {prefixes} the clients send only those tensors: set "
                "fml.guard_peers = 0 or shared_prefixes = []"
            )
        if prefixes:
            # Only the backbone is global; each client's head fits its own classes.
            self.global_weights = shared_keys(self.global_weights, prefixes)
            if not self.global_weights:
                raise ValueError(
                    f"fml: shared_prefixes {prefixes} match no tensor of the global model"
                )
        else:
            self._require_classes()

    @property
    def partial_models(self) -> frozenset[str]:
        return frozenset({"meme"}) if self.config.shared_prefixes else frozenset()

    def expected_models(self, client_id: str) -> dict[str, ArchSpec]:
        assert self.global_spec is not None
        spec = self.global_spec
        if self.config.shared_prefixes:
            spec = spec.with_(num_classes=self.clients[client_id].capabilities.num_classes)
        return {"meme": spec}

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        memes = {
            cid: shared_keys(r.models["meme"].weights, self.config.shared_prefixes)
            for cid, r in replies.items()
        }
        if any(set(m) != set(self.global_weights) for m in memes.values()):
            raise ValueError("fml: a meme reply does not carry exactly the shared tensors")
        self.global_weights = self._aggregate(memes, self._weights(replies))
