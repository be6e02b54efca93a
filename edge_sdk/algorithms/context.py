"""What an algorithm is given (its client's context, the task's step) and what it gives back
(a `FitResult`), and the error it raises for a task it cannot run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edge_sdk.budget import DeployBudget
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.peers import Peers
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

__all__ = [
    "SPEC_ATTR",
    "AlgorithmError",
    "ClientContext",
    "Detail",
    "FitResult",
    "TaskInfo",
]

SPEC_ATTR = "_edgefl_spec"  # the ArchSpec a module was built from (what persistence rebuilds)


class AlgorithmError(ValueError):
    """A task this algorithm cannot run (missing model, incompatible architecture...)."""


@dataclass
class TaskInfo:
    """The step of the current task and the parameters the coordinator gave it."""

    step: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ClientContext:
    """What an algorithm may use: its client's id, architecture, data, device and trainer;
    `peers`, the channel to other clients (decentralized algorithms); `task`, the current
    task's step and parameters; `budget`, what the device may deploy (edge_sdk.budget; its
    own architecture by default)."""

    client_id: str
    spec: ArchSpec
    data: ClientData
    device: torch.device
    seed: int
    trainer: Trainer
    peers: Peers | None = None
    task: TaskInfo = field(default_factory=TaskInfo)
    budget: DeployBudget = field(default_factory=DeployBudget)

    def build_model(self, spec: ArchSpec, salt: int) -> nn.Module:
        """A fresh `spec` network on this client's device, seeded by the client and `salt`."""
        model = self.trainer.prepare(build(spec, seed=self.seed * 1009 + salt))
        setattr(model, SPEC_ATTR, spec)  # what persistence rebuilds it from
        return model

    def materialize(self, model: WireModel) -> nn.Module:
        """A received model as a network on this client's device."""
        module = self.trainer.prepare(model.build())
        setattr(module, SPEC_ATTR, model.spec)
        return module


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
