"""fml: Federated Mutual Learning (Shen et al., FITEE 2023; paper 001).

Each client holds a personalized model (its own architecture, never leaves the device) and a meme
model (the global architecture). Per round the meme is set to the global model with a fresh
optimizer (the personalized optimizer keeps its momentum) and both models learn from the labels
and from each other, stepping together on every batch:

    L_personal = α·CE(z_p, y) + (1−α)·KL(z_m.detach() || z_p)
    L_meme     = β·CE(z_m, y) + (1−β)·KL(z_p.detach() || z_m)

Each loss only reaches its own model's parameters (the other side is detached), so one backward
pass of the sum gives both gradients.

Objective heterogeneity: with `shared_prefixes`, only state-dict keys under those prefixes are
global (a shared backbone); each client's meme keeps its own head sized to its own classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from edge_sdk.algorithms.base import (
    AlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.algorithms.candidates import PERSONAL, Candidate
from edge_sdk.algorithms.guard_config import SHARED, PatientGuardConfig
from edge_sdk.codec import WireModel, state_of
from edge_sdk.losses import mutual_losses
from model_zoo import ArchSpec

__all__ = ["FML", "FMLConfig", "shared_keys"]


class FMLConfig(AlgorithmConfig, PatientGuardConfig):
    # preset = "paper": the authors' α gate-free mutual learning, β and step schedule [code].
    paper: ClassVar[dict[str, Any]] = {"alpha_gate": "off", "beta": 0.5, "lr_schedule": "step"}
    trusted: ClassVar[dict[str, Any]] = SHARED

    alpha: float = Field(0.5, ge=0, le=1)  # personalized model: weight of CE vs KL [code]
    # [ours] meme model: weight of CE vs KL. The authors' code has 0.5, the meme learning from
    # the personalized model too. At 1 it learns from the labels alone, as FedAvg's model does,
    # and the personalized model still learns from it: the guard then fine-tunes a global model
    # trained as FedAvg's is, and FML ends level with FedAvg+FT or above it on the
    # personalization suite, where at 0.5 it ended below it on 5 of 9 splits (docs/algorithms.md).
    beta: float = Field(1.0, ge=0, le=1)
    # [code] decays lr ×0.1 every ⌊R/3⌋ rounds ("step"). Our default is a constant lr, like the
    # baselines it is compared with: at the short runs of a simulation (R = 5 → a decay every
    # round) the step schedule freezes FML after two rounds and it falls below local training.
    lr_schedule: Literal["none", "step"] = "none"
    # Server: meme averaging, uniform by default (the paper drops n_k/n) [paper].
    weighting: Literal["uniform", "by_samples"] = "uniform"
    # State-dict key prefixes that are global (e.g. ["features."]); empty = the whole model.
    shared_prefixes: list[str] = Field(default_factory=list)
    # [ours] "soft": the KL term's weight 1 − α scaled by min(1, L_personal / L_global), the
    # two models' validation losses at the round's start, so that the personalized model learns
    # from the meme as the global model improves. "validation": from the meme (α as set) only
    # when the global model has the lower validation loss, else from the labels alone (α = 1).
    # "off": always α (the paper). Measured at two sizes (docs/algorithms.md): "soft" deployed
    # the best own-architecture models at both, "validation" the worst on the long runs.
    alpha_gate: Literal["validation", "soft", "off"] = "soft"


def shared_keys(
    weights: Mapping[str, torch.Tensor], prefixes: list[str]
) -> dict[str, torch.Tensor]:
    """The part of a state dict that is global under `prefixes` (all of it when empty)."""
    if not prefixes:
        return dict(weights)
    return {k: v for k, v in weights.items() if any(k.startswith(p) for p in prefixes)}


@register_algorithm
class FML(ClientAlgorithm):
    name = "fml"
    persistent = ("personal", "meme", "meme_spec", "opt_personal")
    config_cls = FMLConfig
    config: FMLConfig
    opt_meme: torch.optim.Optimizer | None = None  # per round (restarted in place), not persistent

    def __init__(self, ctx: ClientContext, config: AlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.personal = self._build(ctx.spec)
        self.opt_personal = ctx.trainer.optimizer(self.personal.parameters(), config)
        self.meme: nn.Module | None = None
        self.meme_spec: ArchSpec | None = None

    @property
    def partial_models(self) -> frozenset[str]:
        return frozenset({"global"}) if self.config.shared_prefixes else frozenset()

    def _meme_for(self, glob: WireModel) -> tuple[ArchSpec, nn.Module]:
        # Partial sharing: the meme is the global backbone plus a local head for our classes.
        spec = glob.spec
        if self.config.shared_prefixes:
            spec = spec.with_(num_classes=self.ctx.data.num_classes)
        if self.meme is None or spec != self.meme_spec:
            self.meme, self.meme_spec = self._build(spec, salt=1), spec
        _missing, unexpected = self.meme.load_state_dict(
            glob.weights, strict=not self.config.shared_prefixes
        )
        if unexpected:
            raise ValueError(f"fml: global model has tensors the meme lacks: {unexpected[:5]}")
        return spec, self.meme

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        cfg, trainer, data = self.config, self.ctx.trainer, self.ctx.data
        spec, meme = self._meme_for(self._require(models, "global"))
        lr = cfg.lr_at(round_, rounds)
        # The meme's optimizer starts afresh each round [code] (kept and restarted in place:
        # a device's captured step stays valid from round to round).
        opt_meme = self.opt_meme = trainer.fresh_optimizer(
            self.opt_meme, meme.parameters(), cfg, lr
        )
        trainer.set_lr(self.opt_personal, lr)
        personal, opts = self.personal, [self.opt_personal, opt_meme]
        personal.train()
        meme.train()
        a, b = self._alpha(meme), cfg.beta

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with trainer.autocast():
                z_p, z_m = personal(x), meme(x)
            loss_p, loss_m = mutual_losses(z_p, z_m, y, a, b)
            trainer.step(loss_p + loss_m, opts)
            return loss_p.detach(), loss_m.detach()

        batches = trainer.epochs(data.x_train, data.y_train, cfg.batch_size, cfg.local_epochs)
        keep = (personal, meme, *opts, a, b)
        loss_p, loss_m = trainer.run(step, batches, values=2, keep=keep)
        return FitResult(
            models={"meme": WireModel(spec, shared_keys(state_of(meme), cfg.shared_prefixes))},
            metrics={
                "loss_personal": loss_p,
                "loss_meme": loss_m,
                "alpha": self._reported(a),
            },
            n_samples=data.n_train,
        )

    def _alpha(self, meme: nn.Module) -> float | torch.Tensor:
        """This round's α: the config's, moved towards 1 (the labels alone) by the gate's weight
        of the meme, as the step reads it (`Trainer.held`)."""
        alpha = self.config.alpha
        if self.config.alpha_gate == "off":
            return alpha
        weight = self._teaches(meme, self.personal, self.config.alpha_gate)
        return self.ctx.trainer.held("alpha", 1 - (1 - alpha) * weight)

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        out = self._scores("personal", self.personal)
        glob = models.get("global")
        if glob is not None and not self.config.shared_prefixes:
            out |= self._scores("global", self._materialize(glob))
        return out

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        return self.ctx.spec, self.personal

    def guard_candidates(self) -> dict[str, Candidate]:
        # The meme after this round's training: the global model tuned on this client's data.
        out: dict[str, Candidate] = {PERSONAL: self.trained_model()}
        if self.meme is not None and self.meme_spec is not None:
            out["meme"] = (self.meme_spec, self.meme)
        return out
