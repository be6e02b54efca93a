"""The simulator's speed and memory work must not change what a federation computes.

The expected values were recorded from the simulator before that work (commit 6091666's runtime
merged with main at ac23b99), for the same seed: per-client personalized accuracies and every
round's mean training metrics (the losses are floats; any change in the arithmetic shows there).
PFML's were recorded again when its batches came to be drawn another way (see there).
"""

import pytest
from tests_helpers import tiny_config

from coordinator.federation import prepare_federation
from coordinator.simulator import run_federation

PRE_CHANGE = {
    # Re-recorded when PFML's fresh batches came to be drawn as the top D of uniform keys, all
    # of a round's at once (Trainer.index_draws), instead of a permutation per batch: the same
    # distribution, another stream (before: acc [0.7, 0.6, 0.75, 0.75], losses 4.2844, 3.0561).
    # test_update_rules.py pins PFML's arithmetic against a reference drawing the same way.
    "pfml": {
        "acc": [0.75, 0.7, 0.825, 0.675],
        "metrics": [{"train_loss": 4.266862154006958}, {"train_loss": 3.0496358275413513}],
    },
    "fml": {
        "acc": [0.675, 0.575, 0.825, 0.65],
        "metrics": [
            {"loss_meme": 1.1854508817195892, "loss_personal": 1.1829951703548431, "alpha": 0.5},
            {"loss_meme": 0.8995947539806366, "loss_personal": 0.8871442824602127, "alpha": 0.5},
        ],
    },
    "fedavg": {
        "acc": [0.8, 0.85, 0.875, 0.875],
        "metrics": [{"train_loss": 2.1501966565847397}, {"train_loss": 1.2622811272740364}],
    },
}

FLAGS = {
    "pfml": {
        "lr": 0.05,
        # The guard off: these are the algorithm's own models, as before it existed.
        "overrides": {"pfml.lam": 1.0, "pfml.local_iterations": 10, "pfml.guard": False},
        "models": ["mlr", "mlp"],
        "global_model": "mlr",
    },
    "fml": {
        "models": ["mlr", "mlp"],
        "global_model": "mlr",
        "local_epochs": 1,
        # the settings of the recording (β was 0.5 by default then)
        "overrides": {"fml.guard": False, "fml.alpha_gate": "off", "fml.beta": 0.5},
    },
    "fedavg": {"local_epochs": 1},
}


@pytest.mark.parametrize("algorithm", sorted(PRE_CHANGE))
def test_simulator_gives_the_pre_change_results_for_the_same_seed(algorithm):
    # Prepare: 4 clients on 8×8 digits, 2 rounds, seed 0 (tiny_config's defaults).
    cfg = tiny_config(algorithm=algorithm, rounds=2, **FLAGS[algorithm])

    # Execute
    res = run_federation(cfg, prepare_federation(cfg), algorithm)

    # Assert: the same accuracies, and training losses equal to float rounding.
    expected = PRE_CHANGE[algorithm]
    assert [c.personal_acc for c in res.clients] == expected["acc"]
    got = [r.train_metrics for r in res.rounds]
    assert len(got) == len(expected["metrics"])
    for g, e in zip(got, expected["metrics"], strict=True):
        assert g == pytest.approx(e, rel=1e-6, abs=1e-9)
