"""fedavg_ft: FedAvg, then each client fine-tunes the final global model on its own data.

The FedMe paper found this simple baseline beats most personalized methods; keep it honest.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from edge_sdk.algorithms.base import (
    AlgorithmConfig,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.algorithms.fedavg import FedAvg, FedAvgConfig
from edge_sdk.codec import WireModel

__all__ = ["FedAvgFT", "FedAvgFTConfig"]


class FedAvgFTConfig(FedAvgConfig):
    ft_epochs: int = Field(5, ge=0)  # [ours] fine-tuning epochs after the last round


@register_algorithm
class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    config_cls = FedAvgFTConfig
    config: FedAvgFTConfig
    persistent = ("model", "finetuned")

    def __init__(self, ctx: ClientContext, config: AlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.finetuned = False

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        if self.finetuned:
            return self._scores("personal", self.model)  # the fine-tuned model it deploys
        # Before fine-tuning there is no personalized model yet, only the global one: its score
        # is FedAvg's, and reporting it as this method's personalized accuracy would credit
        # fedavg_ft with models it never deploys.
        scores = super().evaluate(models)
        return {k: v for k, v in scores.items() if k.startswith("global")}

    def finish(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        self._load_global(models)  # fine-tuning starts from the final global model
        scores = self._scores("global", self.model)  # on the client's own test split
        cfg, trainer = self.config, self.ctx.trainer
        opt = trainer.optimizer(self.model.parameters(), cfg, lr=cfg.lr_at(rounds, rounds))
        loss = trainer.train_epochs(
            self.model,
            self.ctx.data,
            cfg,
            optimizer=opt,
            epochs=cfg.ft_epochs,
        )
        self.finetuned = True
        scores |= self._scores("personal", self.model)
        return FitResult(metrics=scores | {"ft_loss": loss}, n_samples=self.ctx.data.n_train)
