"""A plugin's algorithm trains stacked without declaring anything, checked once against one
client alone; one whose stacked round differs or fails trains client by client, and is told why.

Before, stacking was a class attribute (`stackable`) a plugin had to know of: inherited from
FedAvg, a round that summed over its parameters ran stacked and silently scaled each client's
proximal gradient by the number of clients.
"""

from __future__ import annotations

import logging
import math
import runpy
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from tests_helpers import tiny_config, to_rounding

import coordinator.stacking.groups as groups
from coordinator.simulator import simulate
from coordinator.stacking.groups import disagreement
from coordinator.strategies import register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy
from edge_sdk.algorithms import FitResult, register_algorithm
from edge_sdk.algorithms.fedavg import FedAvg, FedAvgConfig
from edge_sdk.codec import WireModel
from model_zoo import ArchSpec

PLUGINS = Path(__file__).parents[2] / "examples" / "plugin"


def _phases_stacked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The phases the fleet runs stacked from now on, in order (a spy on `run_stacked`)."""
    calls: list[str] = []
    run_stacked = groups.run_stacked

    def counted(algos, phase, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(phase)
        return run_stacked(algos, phase, *args, **kwargs)

    monkeypatch.setattr(groups, "run_stacked", counted)
    return calls


def _said(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name.startswith("coordinator.stacking") and r.getMessage().startswith(f"{name}: ")
    ]


@pytest.mark.usefixtures("scoped_registrations")
def test_a_plugin_written_for_one_client_trains_stacked_to_the_results_of_one_by_one(caplog):
    # Prepare: the example plugin (about 40 lines: FedAvg with label smoothing, written for
    # one client with the context's trainer and the shared losses, declaring nothing about
    # stacking), registered in-process
    runpy.run_path(str(PLUGINS / "smoothing.py"))
    flags = dict(algorithm="smoothing", models=["mlp"], rounds=2, local_epochs=1, threads=1)

    # Execute: stacked (told so), and client by client
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        stacked = simulate(tiny_config(**flags), progress=False)
    alone = simulate(tiny_config(**flags, cohort=False), progress=False)

    # Assert: its four clients trained as one stack, checked, to client by client's accuracies
    (told,) = _said(caplog, "smoothing")
    assert told.levelno == logging.INFO
    assert told.getMessage().startswith("smoothing: 4 clients of one architecture train stacked")
    assert "checked once against one client alone" in told.getMessage()
    acc = {c.id: c.personal_acc for c in stacked.clients}
    assert acc == to_rounding({c.id: c.personal_acc for c in alone.clients})
    assert stacked.summary.mean_personal_acc > 0.3  # it learns (chance: 0.1)


@pytest.mark.usefixtures("scoped_registrations")
def test_a_plugin_whose_stacked_round_differs_from_one_client_alone_trains_one_by_one(
    caplog, monkeypatch
):
    # Prepare: the example written from scratch, whose proximal term sums over the model's
    # parameters: over a stack, that is every client's term, so each client's pull would be
    # the number of clients times its own
    runpy.run_path(str(PLUGINS / "proximal.py"))
    flags = dict(algorithm="proximal", models=["mlp"], rounds=3, local_epochs=1, threads=1)
    calls = _phases_stacked(monkeypatch)
    # Execute: tried stacked, and client by client
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        tried = simulate(tiny_config(**flags), progress=False)
    alone = simulate(tiny_config(**flags, cohort=False), progress=False)

    # Assert: refused at its first stacked fit, said at WARNING with how far the check was
    warned = [r.getMessage() for r in _said(caplog, "proximal") if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith(
        "proximal: its clients train one by one for the rest of the run: its stacked fit does "
        "not give what one client's gives alone (its model 'model' is "
    )
    assert "of its norm away" in warned[0] and "self._alone(why)" in warned[0]
    assert calls.count("fit") == 1  # never tried again
    # ... and every client, the checked one too, as client by client (put back, then alone)
    acc = {c.id: c.personal_acc for c in tried.clients}
    assert acc == {c.id: c.personal_acc for c in alone.clients}


@pytest.mark.usefixtures("scoped_registrations")
def test_a_plugin_whose_stacked_round_fails_is_not_tried_again(caplog, monkeypatch):
    # Prepare: a round that reads its sample count as one number (a stack holds one per client)
    @register_algorithm
    class Counting(FedAvg):
        name = "counting"
        config_cls: ClassVar[type[FedAvgConfig]] = FedAvgConfig

        def train_round(self, round_, rounds, models):
            self.seen = int(self.ctx.data.n_train)
            return super().train_round(round_, rounds, models)

    @register_strategy
    class CountingStrategy(FedAvgStrategy):
        name = "counting"

    flags = dict(algorithm="counting", rounds=2, local_epochs=1, threads=1)
    calls = _phases_stacked(monkeypatch)
    # Execute
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        tried = simulate(tiny_config(**flags), progress=False)
    alone = simulate(tiny_config(**flags, cohort=False), progress=False)

    # Assert: refused with its error, tried once, every client as alone
    warned = [r.getMessage() for r in _said(caplog, "counting") if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "its stacked fit failed (" in warned[0]
    assert "PerMember" in warned[0]
    assert calls.count("fit") == 1
    acc = {c.id: c.personal_acc for c in tried.clients}
    assert acc == {c.id: c.personal_acc for c in alone.clients}


def test_clients_that_read_each_others_models_are_told_they_train_one_by_one(caplog):
    # Execute: FedeRiCo, whose clients exchange models within a round
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        simulate(tiny_config(algorithm="federico", rounds=1, local_epochs=1), progress=False)

    # Assert: said once, with why
    assert [r.getMessage() for r in _said(caplog, "federico")] == [
        "federico: 4 clients of one architecture train one by one: they read each other's "
        "models during a round (exchanges_models)"
    ]


def test_the_sdks_own_algorithms_stack_unchecked(monkeypatch):
    # Prepare: a spy on the check
    checked = []
    monkeypatch.setattr(groups.Stacking, "_agrees", lambda *a: checked.append(a) or True)

    # Execute
    simulate(tiny_config(algorithm="fedavg", rounds=1, local_epochs=1), progress=False)

    # Assert: their tests hold them to client by client; the fleet does not check them
    assert checked == []


def _wire(*values: float) -> WireModel:
    spec = ArchSpec(family="mlr", num_classes=2, input_shape=(2,))
    return WireModel(spec, {"w": torch.tensor(values[:2]), "b": torch.tensor(values[2:])})


def test_a_disagreement_is_the_models_distance_over_its_norm_or_a_metric_beyond_rounding():
    alone = FitResult({"m": _wire(3.0, 4.0, 0.0)}, {"loss": 0.5, "correct": 40.0}, n_samples=9)

    def stacked(**change):
        kw = dict(models=alone.models, metrics=alone.metrics, n_samples=9) | change
        return FitResult(**kw)

    # The distance: ‖(3, 4.003, 0.004) − (3, 4, 0)‖ / ‖(3, 4, 0)‖ = 0.005 / 5 = 1e-3
    far = stacked(models={"m": _wire(3.0, 4.003, 0.004)})
    assert disagreement(far, alone, tol=1e-4) == "its model 'm' is 0.001 of its norm away"
    assert disagreement(far, alone, tol=math.nextafter(1e-3, 1)) is None
    # A count may tip by one; a loss may not move beyond the tolerance (of at least 1)
    assert disagreement(stacked(metrics={"loss": 0.5, "correct": 41.0}), alone, 1e-4) is None
    assert disagreement(stacked(metrics={"loss": 0.5, "correct": 42.0}), alone, 1e-4) == (
        "its correct is 42 stacked, 40 alone"
    )
    assert disagreement(stacked(metrics={"loss": 0.50005, "correct": 40.0}), alone, 1e-4) is None
    assert disagreement(stacked(metrics={"loss": 0.5002, "correct": 40.0}), alone, 1e-4) == (
        "its loss is 0.5002 stacked, 0.5 alone"
    )
    nan = stacked(metrics={"loss": math.nan, "correct": 40.0})
    assert disagreement(nan, alone, 1e-4) == "its loss is nan stacked, 0.5 alone"
    # What it replies and reports
    assert disagreement(stacked(n_samples=8), alone, 1e-4) == (
        "it reports 8 samples stacked, 9 alone"
    )
    assert disagreement(stacked(models={}), alone, 1e-4) == "it replies [] stacked, ['m'] alone"
    spec = ArchSpec(family="mlr", num_classes=2, input_shape=(3,))
    other = WireModel(spec, alone.models["m"].weights)
    assert disagreement(stacked(models={"m": other}), alone, 1e-4) == (
        "its model 'm' differs in architecture"
    )
