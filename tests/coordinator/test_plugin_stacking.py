"""A plugin algorithm that inherits `stackable` is told that its clients train stacked.

Before, a user's FedAvg subclass ran stacked (vmapped) without a word; PyTorch's warning about a
missing vmap batching rule was the only hint.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from tests_helpers import tiny_config

from coordinator.simulator import simulate
from coordinator.strategies import register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy
from edge_sdk.algorithms import register_algorithm
from edge_sdk.algorithms.fedavg import FedAvg, FedAvgConfig


@pytest.mark.usefixtures("scoped_registrations")
def test_a_plugin_that_inherits_stackable_is_told_it_trains_stacked(caplog):
    # Prepare: what a plugin does, a FedAvg subclass (stackable by inheritance) and its strategy.
    @register_algorithm
    class Inheriting(FedAvg):
        name = "inheriting_stackable"
        config_cls: ClassVar[type[FedAvgConfig]] = FedAvgConfig

    @register_strategy
    class InheritingStrategy(FedAvgStrategy):
        name = "inheriting_stackable"

    cfg = tiny_config(algorithm="inheriting_stackable", rounds=1, local_epochs=1)

    with caplog.at_level(logging.WARNING, logger="coordinator.stacking"):
        simulate(cfg, progress=False)

    said = [r for r in caplog.records if "train stacked" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING  # once, however many phases
    text = said[0].getMessage()
    assert text.startswith("inheriting_stackable: 4 clients of one architecture train stacked")
    assert "inherited from FedAvg" in text and "stackable = False" in text
