"""The base of every algorithm's config: frozen, strict, and saying why a setting is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from edge_sdk.optim_config import OptimConfig

__all__ = ["AlgorithmConfig", "BaseAlgorithmConfig"]


class BaseAlgorithmConfig(BaseModel):
    """Base of every algorithm's config: frozen, and a field it does not know is an error.

    An algorithm's config holds only the settings it honours. `refused` names settings users
    often expect but the algorithm does not take, each with the reason, so that setting one
    fails with that reason instead of a bare "extra inputs are not permitted".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    refused: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            bad = [k for k in cls.refused if k in data]
            if bad:
                raise ValueError("; ".join(f"{k}: {cls.refused[k]}" for k in bad))
        return data


class AlgorithmConfig(OptimConfig, BaseAlgorithmConfig):
    """Config of an algorithm that trains whole local epochs with the shared Trainer's optimizer
    (every field of OptimConfig is honoured), plus the algorithm's own fields."""
