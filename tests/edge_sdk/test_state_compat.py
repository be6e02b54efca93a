"""State files written by an earlier version load and continue as they did then.

The folder data/states-2869461 was written by the code of commit 2869461 (its make.py says how):
each algorithm's state after one round, and what its next round, its finalize and its deployed
model were when that code went on from there. Today's code must resume from the same file to
the same results: a device that updates the SDK between two rounds loses nothing.
"""

from pathlib import Path

import pytest
import torch
from test_persistence import _algorithm, _models, _weights

from edge_sdk.state import load_state

SAVED = Path(__file__).parent / "data" / "states-2869461"
ALGORITHMS = ["local", "fedavg", "fedprox", "fedavg_ft", "fml", "pfml", "persfl", "fedme"]


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_state_saved_by_an_earlier_version_resumes_to_the_same_results(name):
    # Prepare: the saved state loaded into a fresh client, as after an update and a restart.
    # Without the guard's students: since 2026-11-30 a default outside the device's budget is
    # replaced by a student of it, a decision of today's guard (test_deploy_budget), not of the
    # state; the earlier version made no student here. FedMe's guard fine-tuned 5 epochs then
    # (20 since 2026-11-30), weighed its mixture per client (the equal mixture since
    # 2026-11-30, later), gated its KL term on validation and adopted within the budget (the
    # paper's 1:1 and any architecture since 2026-12-01): defaults of the config, not of the
    # state.
    fine_tuning = (
        {
            "guard_ft_epochs": 5,
            "guard_mix_weights": [1, 0.75, 0.5, 0.25, 0],
            "kl_gate": "validation",
            "adopt": "budget",
        }
        if name == "fedme"
        else {}
    )
    algo = _algorithm(name, seed=0, guard_distill_epochs=0, **fine_tuning)
    algo.load_state_dict(load_state(SAVED / f"{name}.state"))
    want = load_state(SAVED / f"{name}.expected")
    best = algo.deployment.guard.best
    kept = {} if best is None else {"label": best.label, "hits": best.hits, "loss": best.loss}

    # Execute: the round that followed, and the finalize
    result = algo.fit(2, 2, _models(name, 2))
    final = algo.finalize(2, 2, _models(name, 2))

    # Assert: what the earlier version's guard had kept, and what it sent, chose, counted and
    # deployed
    assert kept.keys() == want["guard_best"].keys()
    if kept:
        assert (kept["label"], kept["loss"]) == (
            want["guard_best"]["label"],
            want["guard_best"]["loss"],
        )
        assert torch.equal(kept["hits"], want["guard_best"]["hits"])
    _assert_close(_weights(result), want["round2"], f"{name} round 2")
    assert {k: final.details[k] for k in want["details"]} == want["details"]
    _, model = algo.personalized_model()
    _assert_close(dict(model.state_dict()), want["deployed"], f"{name} deployed")
