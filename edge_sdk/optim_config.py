"""Local training's settings: whole epochs, the batch size, SGD or Adam and their settings, and
the learning-rate schedule (`OptimConfig`), the fields every algorithm's config that trains with
the shared Trainer honours (`edge_sdk.algorithms.config.AlgorithmConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["OptimConfig"]

_DEFAULT_LR_GAMMA = 0.1


class OptimConfig(BaseModel):
    """Local training in whole epochs with SGD or Adam (defaults: FML's, algorithms.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    local_epochs: int = Field(5, ge=0)
    batch_size: int = Field(128, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    # SGD's momentum; for Adam it is β1 (Adam's betas are (momentum, 0.999)).
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    # "step": lr × lr_gamma every max(1, ⌊rounds/3⌋) rounds (FML's schedule); "none": constant.
    lr_schedule: Literal["none", "step"] = "none"
    lr_gamma: float = Field(_DEFAULT_LR_GAMMA, gt=0)

    @model_validator(mode="after")
    def _gamma_needs_a_schedule(self) -> OptimConfig:
        if self.lr_schedule == "none" and self.lr_gamma != _DEFAULT_LR_GAMMA:
            raise ValueError(
                f"lr_gamma={self.lr_gamma} has no effect with lr_schedule='none'; "
                "set lr_schedule='step' to decay the learning rate"
            )
        return self

    def lr_at(self, round_: int, rounds: int) -> float:
        if self.lr_schedule == "none":
            return self.lr
        step = max(1, rounds // 3)
        return self.lr * self.lr_gamma ** ((max(1, round_) - 1) // step)
