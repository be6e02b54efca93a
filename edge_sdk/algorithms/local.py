"""local: each client trains only on its own data (the baseline QoI compares against)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from edge_sdk.algorithms.base import (
    AlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.codec import WireModel
from model_zoo import ArchSpec

__all__ = ["Local", "LocalConfig"]


class LocalConfig(AlgorithmConfig):
    """Same local-training budget as the federated methods, no communication of weights."""


@register_algorithm
class Local(ClientAlgorithm):
    name = "local"
    persistent = ("model", "optimizer")
    config_cls = LocalConfig
    config: LocalConfig

    def __init__(self, ctx: ClientContext, config: AlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.model = self._build(ctx.spec)
        # One optimizer for the whole run: momentum carries over between rounds.
        self.optimizer = ctx.trainer.optimizer(self.model.parameters(), config)

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        cfg, trainer = self.config, self.ctx.trainer
        trainer.set_lr(self.optimizer, cfg.lr_at(round_, rounds))
        loss = trainer.train_epochs(self.model, self.ctx.data, cfg, optimizer=self.optimizer)
        return FitResult(metrics={"train_loss": loss}, n_samples=self.ctx.data.n_train)

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        return self.ctx.spec, self.model
