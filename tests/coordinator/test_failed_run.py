"""A run whose rounds miss their quorum says so: a closing line, a non-zero exit status, and
results.json's `summary.outcome`.

The rounds fail for the reason a new plugin author's did: a device half that sends its model
back under the wrong name, so that the coordinator refuses every reply.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.results_model import EXIT_CODES, Results

runner = CliRunner()

# A FedAvg whose replies carry the model under "global" (the task's key) instead of "model"
# (what the server half expects), in the rounds listed in BAD_ROUNDS.
PLUGIN = """
from typing import ClassVar

from coordinator.strategies import register_strategy
from coordinator.strategies.fedavg import FedAvgStrategy
from edge_sdk.algorithms import register_algorithm
from edge_sdk.algorithms.fedavg import FedAvg, FedAvgConfig

BAD_ROUNDS = {bad}


@register_algorithm
class Misnamed(FedAvg):
    name = "misnamed_{tag}"
    config_cls: ClassVar[type[FedAvgConfig]] = FedAvgConfig

    def train_round(self, round_, rounds, models):
        result = super().train_round(round_, rounds, models)
        if round_ in BAD_ROUNDS:
            result.models = {{"global": result.models["model"]}}
        return result


@register_strategy
class MisnamedStrategy(FedAvgStrategy):
    name = "misnamed_{tag}"
"""


def _simulate(tmp_path, bad_rounds, tag):
    plugin = tmp_path / f"misnamed_{tag}.py"
    plugin.write_text(textwrap.dedent(PLUGIN.format(bad=set(bad_rounds), tag=tag)))
    out = tmp_path / "run"
    args = ["simulate", "--plugin", str(plugin), "--algorithm", f"misnamed_{tag}"]
    args += ["--models", "mlr", "--clients", "3", "--rounds", "2", "--local-epochs", "1"]
    args += ["--device", "cpu", "--out", str(out), "--quiet"]
    args += ["--set", 'data.options={"size": 8}', "--set", "round.retries=0"]
    return runner.invoke(app, args), out


@pytest.mark.usefixtures("scoped_registrations")
@pytest.mark.parametrize(
    ("bad_rounds", "outcome", "closing"),
    [
        ({1, 2}, "failed", "RUN FAILED: none of the 2 rounds got its quorum"),
        ({1}, "partial", "RUN INCOMPLETE: 1 of 2 rounds missed their quorum"),
        (set(), "complete", None),
    ],
)
def test_a_run_that_loses_rounds_ends_saying_so(tmp_path, bad_rounds, outcome, closing):
    # Execute
    res, out = _simulate(tmp_path, bad_rounds, outcome)

    # Assert: the exit status, the last line and results.json agree.
    assert res.exit_code == EXIT_CODES[outcome], res.output
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["outcome"] == outcome
    assert results["summary"]["failed_rounds"] == len(bad_rounds)
    last = res.output.strip().splitlines()[-1]
    if closing is None:
        assert not last.startswith("RUN ")
    else:
        assert last.startswith(closing) and f"exit code {EXIT_CODES[outcome]}" in last
        assert "round.quorum 0.5" in last


def test_outcome_is_read_back_and_old_results_count_as_complete():
    # A results.json of before the field: no outcome, exit status 0, no closing line.
    old = Results.parse({"algorithm": "fml", "summary": {"failed_rounds": 0}})
    assert old.summary.outcome is None and old.exit_code == 0 and old.closing_line() is None
    failed = Results.parse(
        {
            "algorithm": "fml",
            "config": {"round": {"quorum": 1.0}},
            "rounds": [{"round": 1, "failed": True}, {"round": 2, "failed": True}],
            "summary": {"failed_rounds": 2, "outcome": "failed"},
        }
    )
    assert failed.exit_code == 3
    assert "none of the 2 rounds got its quorum (round.quorum 1)" in str(failed.closing_line())
