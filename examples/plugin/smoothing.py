"""A plugin algorithm that trains stacked in a simulation: FedAvg with label smoothing,
(1 − s)·CE(z, y) + s·KL(uniform ‖ softmax(z)), written once, for one client.

    edgefl simulate --plugin examples/plugin/smoothing.py --algorithm smoothing
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field
from torch import nn

from coordinator.strategies import register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy
from edge_sdk.algorithms import (
    AlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.codec import WireModel
from edge_sdk.losses import cross_entropy, kl_distill
from model_zoo import ArchSpec


class SmoothingConfig(AlgorithmConfig):
    smoothing: float = Field(0.1, ge=0, lt=1)  # --set smoothing.smoothing=0.2


@register_algorithm
class Smoothing(ClientAlgorithm):
    name = "smoothing"
    config_cls = SmoothingConfig
    config: SmoothingConfig
    persistent = ("model",)

    def __init__(self, ctx: ClientContext, config: SmoothingConfig) -> None:
        super().__init__(ctx, config)
        self.model = self._build(ctx.spec)

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        self.model.load_state_dict(self._require(models, "global").weights)
        trainer, cfg, data, s = self.ctx.trainer, self.config, self.ctx.data, self.config.smoothing
        opt = trainer.optimizer(self.model.parameters(), cfg, cfg.lr_at(round_, rounds))
        self.model.train()

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
            z = self.model(x)  # the uniform distribution's logits are zeros
            loss = (1 - s) * cross_entropy(z, y) + s * kl_distill(z, torch.zeros_like(z))
            return (trainer.step(loss, [opt]),)

        batches = trainer.epochs(data.x_train, data.y_train, cfg.batch_size, cfg.local_epochs)
        (loss,) = trainer.run(step, batches)
        model = WireModel.of(self.ctx.spec, self.model)
        return FitResult({"model": model}, {"train_loss": loss}, n_samples=data.n_train)

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        return self.ctx.spec, self.model


@register_strategy
class SmoothingStrategy(FedAvgStrategy):
    name = "smoothing"  # the server half: FedAvg's
