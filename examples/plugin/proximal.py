"""An algorithm of your own, both halves, written against the contract: FedAvg with a proximal
term, μ/2·‖w − w_global‖² added to every batch's loss (what FedProx does; here from scratch).

    edgefl simulate --plugin examples/plugin/proximal.py --algorithm proximal --set proximal.mu=0.1
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import Field
from torch import nn

from coordinator.strategies import FitReply, register_strategy, weighted_mean
from coordinator.strategies.base import GlobalModelStrategy
from edge_sdk.algorithms import (
    AlgorithmConfig,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.codec import WireModel
from model_zoo import ArchSpec


class ProximalConfig(AlgorithmConfig):  # epochs, batch size, optimizer, lr... and μ
    mu: float = Field(0.1, ge=0)  # the run config's [proximal] section: --set proximal.mu=0.01


@register_algorithm
class Proximal(ClientAlgorithm):
    """The device half: one round = the global model, trained on this client's data."""

    name = "proximal"
    config_cls: ClassVar[type[AlgorithmConfig]] = ProximalConfig
    config: ProximalConfig
    persistent: ClassVar[tuple[str, ...]] = ("model",)  # saved after every task, restored

    def __init__(self, ctx: ClientContext, config: BaseAlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.model = self._build(ctx.spec)  # the client's architecture, seeded per client

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        glob = self._require(models, "global")  # the task's incoming model is named "global"
        self._require_same_arch(glob)
        self.model.load_state_dict(glob.weights)
        anchor = [p.detach().clone() for p in self.model.parameters()]
        mu = self.config.mu

        def proximal(model: nn.Module) -> torch.Tensor:  # added to every batch's loss
            terms = [(p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor, strict=True)]
            return (mu / 2) * torch.stack(terms).sum()

        trainer, cfg = self.ctx.trainer, self.config
        opt = trainer.optimizer(self.model.parameters(), cfg, cfg.lr_at(round_, rounds))
        data = self.ctx.data
        loss = trainer.train_epochs(self.model, data, cfg, optimizer=opt, extra_loss=proximal)
        return FitResult(
            # The reply's model, named as the server half expects it (expected_models)
            models={"model": WireModel.of(self.ctx.spec, self.model)},
            metrics={"train_loss": loss},
            n_samples=self.ctx.data.n_train,  # the weight of this reply in the average
        )

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:  # what the client deploys
        return self.ctx.spec, self.model


@register_strategy
class ProximalStrategy(GlobalModelStrategy):
    """The server half: the global model is the sample-weighted mean of the replies' models."""

    name = "proximal"  # the same name as the device half

    def setup(self) -> None:
        super().setup()
        self._require_same_arch()  # one architecture: the models are averaged

    def expected_models(self, client_id: str) -> dict[str, ArchSpec]:
        assert self.global_spec is not None
        return {"model": self.global_spec}  # a reply without exactly this is not counted

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        states = [r.models["model"].weights for r in replies.values()]
        self.global_weights = weighted_mean(states, self._weights(replies))
