"""The shipped example configs stay valid as the config schema evolves."""

from pathlib import Path

import pytest

from coordinator.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config(path)
    budget = cfg.algorithm_config().model_dump()
    assert budget.get("local_epochs", budget.get("local_iterations")) >= 1


def test_pfml_example_carries_the_paper_settings():
    cfg = load_config(EXAMPLES / "pfml_synthetic.toml")
    p = cfg.algorithm_config()
    assert (p.k_steps, p.lam, p.beta, p.lr, p.batch_size) == (3, 20.0, 2.0, 0.01, 200)
    assert p.local_iterations == 10
    assert (cfg.clients, cfg.clients_per_round, cfg.data.partition) == (100, 10, "natural")
