"""The device half of an algorithm: turns a task (round, incoming models) into a reply.

A ClientAlgorithm owns the client's private state (personalized model, auxiliary model, optimizer
momentum) and never touches the network: the EdgeClient decodes tasks, calls it, and encodes
replies. Each algorithm is one file in this package with a frozen config whose defaults come from
`algorithms.md`, registered by name; its server half lives in `coordinator/strategies/` under the
same name and reads the same config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn

from edge_sdk.codec import WireModel
from edge_sdk.trainer import ClientData, OptimConfig, Trainer
from model_zoo import ArchSpec, build

__all__ = [
    "AlgorithmConfig",
    "AlgorithmError",
    "BaseAlgorithmConfig",
    "ClientAlgorithm",
    "ClientContext",
    "Detail",
    "FitResult",
    "algorithm_class",
    "algorithm_names",
    "register_algorithm",
]


class AlgorithmError(ValueError):
    """A task this algorithm cannot run (missing model, incompatible architecture...)."""


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


@dataclass
class ClientContext:
    """What an algorithm may use: its client's id, architecture, data, device and trainer."""

    client_id: str
    spec: ArchSpec
    data: ClientData
    device: torch.device
    seed: int
    trainer: Trainer


# A per-client fact a reply reports as it is (a choice made on the device, an architecture name),
# as opposed to a metric, which the coordinator averages over clients.
Detail = str | int | float | bool | None


@dataclass
class FitResult:
    models: dict[str, WireModel] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    n_samples: int = 0
    # Reaches results.json: from finalize, as fields of the client's entry; from fit, per round.
    details: dict[str, Detail] = field(default_factory=dict)


class ClientAlgorithm(ABC):
    name: ClassVar[str]
    config_cls: ClassVar[type[BaseAlgorithmConfig]]

    def __init__(self, ctx: ClientContext, config: BaseAlgorithmConfig) -> None:
        self.ctx = ctx
        self.config = config

    @property
    def partial_models(self) -> frozenset[str]:
        """Names of incoming models that may carry only a subset of their tensors."""
        return frozenset()

    @abstractmethod
    def fit(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """Train locally for one round; return the models to send back."""

    @abstractmethod
    def personalized_model(self) -> tuple[ArchSpec, nn.Module]:
        """The model this client deploys (and exports to ONNX)."""

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        """Personalized model on the client's own test split, and the global one if given."""
        _, model = self.personalized_model()
        out = self._scores("personal", model)
        glob = models.get("global")
        if glob is not None and glob.spec.num_classes == self.ctx.data.num_classes:
            out |= self._scores("global", self._materialize(glob))
        return out

    def finalize(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """After the last round (fine-tuning, distillation...); default: final evaluation."""
        return FitResult(metrics=self.evaluate(models))

    # -- helpers for subclasses ------------------------------------------------------------
    def _scores(self, prefix: str, model: nn.Module) -> dict[str, float]:
        d = self.ctx.data
        r = self.ctx.trainer.evaluate(model, d.x_test, d.y_test)
        return {
            f"{prefix}_correct": r.correct,
            f"{prefix}_total": r.total,
            f"{prefix}_loss": r.loss,
        }

    def _build(self, spec: ArchSpec, salt: int = 0) -> nn.Module:
        return self.ctx.trainer.prepare(build(spec, seed=self.ctx.seed * 1009 + salt))

    def _materialize(self, model: WireModel) -> nn.Module:
        """A received model as a network on this client's device."""
        return self.ctx.trainer.prepare(model.build())

    def _require(self, models: Mapping[str, WireModel], name: str) -> WireModel:
        if name not in models:
            raise AlgorithmError(f"{self.name}: the task carries no {name!r} model")
        return models[name]

    def _require_same_arch(self, incoming: WireModel) -> None:
        if incoming.spec != self.ctx.spec:
            raise AlgorithmError(
                f"{self.name}: the global model is {incoming.spec} but this client's "
                f"architecture is {self.ctx.spec}; {self.name} needs one architecture everywhere"
            )


_REGISTRY: dict[str, type[ClientAlgorithm]] = {}


def register_algorithm(cls: type[ClientAlgorithm]) -> type[ClientAlgorithm]:
    if cls.name in _REGISTRY:
        raise ValueError(f"client algorithm {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def algorithm_class(name: str) -> type[ClientAlgorithm]:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AlgorithmError(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def algorithm_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def _load() -> None:
    import edge_sdk.algorithms  # noqa: F401  (importing the package registers every algorithm)
