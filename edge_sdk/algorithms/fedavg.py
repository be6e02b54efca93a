"""fedavg: train the received global model locally, send it back to be averaged (McMahan et al.)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Literal

import torch
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

__all__ = ["FedAvg", "FedAvgConfig"]


class FedAvgConfig(AlgorithmConfig):
    # Server-side: average weighted by client sample counts (McMahan) or uniformly.
    weighting: Literal["uniform", "by_samples"] = "by_samples"


@register_algorithm
class FedAvg(ClientAlgorithm):
    """The client's model is the global model: personalized accuracy = global model, own test.

    To subclass it: `self.model` is the client's network (its ArchSpec's, persistent), loaded
    with the task's `"global"` weights at the start of `train_round` (`_load_global`); a fit
    sends it back as `"model"`, the name `FedAvgStrategy.expected_models` asks for and averages.
    Override `_extra_loss` to add a term to every batch's loss (FedProx does), `train_round` for
    more.
    """

    name = "fedavg"
    config_cls: ClassVar[type[AlgorithmConfig]] = FedAvgConfig
    config: FedAvgConfig
    persistent: ClassVar[tuple[str, ...]] = ("model",)
    opt: torch.optim.Optimizer | None = None  # per round (restarted in place), not persistent

    def __init__(self, ctx: ClientContext, config: AlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.model = self._build(ctx.spec)

    def _load_global(self, models: Mapping[str, WireModel]) -> None:
        glob = self._require(models, "global")
        self._require_same_arch(glob)
        self.model.load_state_dict(glob.weights)

    def _extra_loss(self) -> Callable[[nn.Module], torch.Tensor] | None:
        """A term added to each batch's loss, built once the global model is loaded (FedProx)."""
        return None

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        self._load_global(models)
        cfg, trainer = self.config, self.ctx.trainer
        lr = cfg.lr_at(round_, rounds)
        # A new optimizer each round (kept and restarted in place: Trainer.fresh_optimizer).
        opt = self.opt = trainer.fresh_optimizer(self.opt, self.model.parameters(), cfg, lr)
        loss = trainer.train_epochs(
            self.model, self.ctx.data, cfg, optimizer=opt, extra_loss=self._extra_loss()
        )
        return FitResult(
            models={"model": WireModel.of(self.ctx.spec, self.model)},
            metrics={"train_loss": loss},
            n_samples=self.ctx.data.n_train,
        )

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        # The client's model is the global model: score the one received, keep nothing of it.
        model = self.model
        if "global" in models:
            glob = self._require(models, "global")
            self._require_same_arch(glob)
            model = self._materialize(glob)
        scores = self._scores("personal", model)
        return scores | {k.replace("personal", "global"): v for k, v in scores.items()}

    def finish(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        if "global" in models:  # what this client deploys (and exports) is the final global model
            self._load_global(models)
        return super().finish(round_, rounds, models)

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        return self.ctx.spec, self.model
