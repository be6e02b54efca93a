"""What each device deploys, end to end: the budget from config, CLI and `EdgeClient`, kept by
every personalized algorithm, and reported per device."""

import pytest
from tests_helpers import tiny_config
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.config import load_config
from coordinator.federation import build_node, prepare_federation
from coordinator.simulator import simulate
from edge_sdk.budget import DeployBudget

PERSONALIZED = ["fml", "pfml", "persfl", "fedme", "federico"]


def _run(algorithm, **overrides):
    """Four clients of two architectures (mlr, mlp) on 8×8 digits, the mlr global, 3 rounds."""
    rounds = 6 if algorithm == "federico" else 3  # (one gradient step a round)
    cfg = tiny_config(
        algorithm=algorithm,
        models=["mlr", "mlp"],
        global_model="mlp",
        rounds=rounds,
        data={"dataset": "digits", "options": {"size": 8}, "max_samples": 400,
              "partition": "label_groups", "partition_params": {"num_groups": 2}},
        overrides={"fedme.unlabeled_size": 100, **overrides},
    )  # fmt: skip
    return simulate(cfg, progress=False)


@pytest.mark.parametrize("algorithm", PERSONALIZED)
def test_with_the_default_budget_every_device_deploys_its_own_architecture(algorithm):
    results = _run(algorithm)
    for c in results.clients:
        d = c.details
        assert d["deployed_arch"] == c.arch, (c.id, d["deployed"], d["deployed_reason"])
        assert d["deployed_params"] == d["own_params"] > 0
        assert isinstance(d["deployed_reason"], str) and d["deployed_reason"].endswith(".")


def test_a_budget_that_allows_any_model_lets_federico_deploy_its_predictor():
    # The paper's predictor is a mixture of its collaborators' models, of any architecture.
    results = _run("federico", **{"deploy.allow": ["any"], "federico.guard": False})
    for c in results.clients:
        assert c.details["deployed_arch"].startswith("mixture of "), c.details["deployed_arch"]
    own = _run("federico", **{"federico.guard": False})
    for c in own.clients:  # the same algorithm within the default budget: a student of it
        assert c.details["deployed"] == f"distilled (final, {c.arch})"
        assert c.details["deployed_outside_budget"].endswith(
            "; a student of its own architecture learnt from it."
        )
        assert "is a mixture of" in c.details["deployed_outside_budget"]
    # ... or without students, its model of its own architecture
    plain = _run("federico", **{"federico.guard": False, "federico.guard_distill_epochs": 0})
    for c in plain.clients:
        assert c.details["deployed"] in (f"own (final, {c.arch})", f"peer (final, {c.arch})")
        assert c.details["deployed_reason"].endswith(
            "the first within its budget (the guard is off)."
        )


def test_the_budget_comes_from_config_flags_and_per_device_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[deploy]\nallow = ["own", "lenet5"]\n[deploy.clients.c1]\nallow = ["any"]\n')
    cfg = load_config(toml)
    assert cfg.deploy.for_client("c0") == DeployBudget(allow=("own", "lenet5"))
    assert cfg.deploy.for_client("c1") == DeployBudget(allow=("any",))
    flagged = load_config(toml, {"deploy.allow": "own,mixture", "deploy.max_params": 5000})
    assert flagged.deploy.for_client("c0") == DeployBudget(allow="own,mixture", max_params=5000)
    # and it reaches each device of a simulation
    tiny = tiny_config(overrides={"deploy.clients": {"c2": {"allow": ["mlp"]}}})
    fed = prepare_federation(tiny)
    assert build_node(tiny, fed, 0).budget == DeployBudget()
    assert build_node(tiny, fed, 2).budget == DeployBudget(allow=("mlp",))


def test_the_cli_takes_a_budget_and_refuses_an_unknown_architecture(tmp_path):
    res = CliRunner().invoke(
        app, ["simulate", "--rounds", "1", "--deploy", "own,lenet7", "-o", str(tmp_path)]
    )
    assert res.exit_code != 0
    assert "cannot allow 'lenet7'" in res.output
