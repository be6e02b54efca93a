"""A plugin algorithm that inherits `stackable` is told that its clients train stacked.

Before, a user's FedAvg subclass ran stacked (vmapped) without a word; PyTorch's warning about a
missing vmap batching rule was the only hint.
"""

from __future__ import annotations

import logging
import re
import runpy
from pathlib import Path
from typing import ClassVar

import pytest
from tests_helpers import tiny_config, to_rounding

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
    # (as many as a stack holds: the fleet deals its four clients into a stack per worker)
    assert re.match(r"inheriting_stackable: [24] clients of one architecture train stacked", text)
    assert "inherited from FedAvg" in text and "stackable = False" in text


@pytest.mark.usefixtures("scoped_registrations")
def test_a_plugin_that_does_not_declare_stackable_is_told_why_its_clients_train_one_by_one(
    caplog,
):
    # Prepare: a plugin's algorithm that opts out, as the example plugin does
    @register_algorithm
    class OneByOne(FedAvg):
        name = "one_by_one"
        config_cls: ClassVar[type[FedAvgConfig]] = FedAvgConfig
        stackable = False

    @register_strategy
    class OneByOneStrategy(FedAvgStrategy):
        name = "one_by_one"

    cfg = tiny_config(algorithm="one_by_one", rounds=1, local_epochs=1)

    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        simulate(cfg, progress=False)

    # Assert: said once, with the reason; nothing said of stacking
    said = [r.getMessage() for r in caplog.records if r.name.startswith("coordinator.stacking")]
    assert said == [
        "one_by_one: 4 clients of one architecture train one by one: the algorithm does not "
        "declare stackable = True (a round written with the context's trainer, model builders, "
        "losses and per-client values can: docs, Extending edgefl)"
    ]


@pytest.mark.usefixtures("scoped_registrations")
def test_a_plugin_written_for_one_client_trains_stacked_to_the_results_of_one_by_one(caplog):
    # Prepare: the example plugin (about 40 lines: FedAvg with label smoothing, written for
    # one client with the context's trainer and the shared losses), registered in-process
    runpy.run_path(str(Path(__file__).parents[2] / "examples" / "plugin" / "smoothing.py"))
    flags = dict(algorithm="smoothing", models=["mlp"], rounds=2, local_epochs=1, threads=1)

    # Execute: stacked (told so), and client by client
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        stacked = simulate(tiny_config(**flags), progress=False)
    told = [r.getMessage() for r in caplog.records if "train stacked" in r.getMessage()]
    alone = simulate(tiny_config(**flags, cohort=False), progress=False)

    # Assert: its four clients trained as one stack, to client by client's accuracies
    assert len(told) == 1 and told[0].startswith("smoothing: 4 clients of one architecture")
    acc = {c.id: c.personal_acc for c in stacked.clients}
    assert acc == to_rounding({c.id: c.personal_acc for c in alone.clients})
    assert stacked.summary.mean_personal_acc > 0.3  # it learns (chance: 0.1)
