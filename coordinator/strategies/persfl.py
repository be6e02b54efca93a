"""persfl: FedAvg on the global architecture, plus a bounded archive of past global models.

Stage 1 of PersFL is plain FedAvg; the clients keep their own teachers, so the server half adds
only the archive the thesis suggests for new participants (section 7.1): the global model after
each of the last `archive_size` rounds. `archived_models()` names them as a finalize task
carries them (`archive_name(round)`), so a client that joins after training can run stage 2
against them. Clients may run any architecture: all train the global one in stage 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from coordinator.strategies.base import FitReply, register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy
from edge_sdk.algorithms.persfl import PersFLConfig, archive_name
from edge_sdk.codec import WireModel


@register_strategy
class PersFLStrategy(FedAvgStrategy):
    """FedAvg (stage 1), whatever each client's own architecture: every client trains the
    global one, keeping its teacher and its own student on the device."""

    name = "persfl"
    one_architecture = False
    config: PersFLConfig

    def setup(self) -> None:
        super().setup()
        self.archive: list[tuple[int, dict[str, torch.Tensor]]] = []

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        super().aggregate_fit(round_, replies)
        self._archive(round_)

    def _archive(self, round_: int) -> None:
        keep = self.config.archive_size
        if keep == 0:
            return
        self.archive.append((round_, dict(self.global_weights)))
        del self.archive[:-keep]

    def late_joiner_models(self) -> dict[str, WireModel]:
        return self.archived_models()

    def archived_models(self) -> dict[str, WireModel]:
        """The archived global models, oldest first, named as a finalize task carries them."""
        assert self.global_spec is not None
        return {archive_name(r): WireModel(self.global_spec, w) for r, w in self.archive}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "archive_rounds": [r for r, _ in self.archive],
            "archive": {str(r): dict(w) for r, w in self.archive},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.archive = [
            (r, {k: v.clone() for k, v in state["archive"][str(r)].items()})
            for r in state["archive_rounds"]
        ]
