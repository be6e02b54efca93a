"""PersFL (both losses) and FedMe end to end: a coordinator and EdgeClients with mixed
architectures over the in-memory transport, with their per-client outputs in results.json; and
over a broker, with FML's guard students learning on the coordinator's unlabeled inputs."""

import json

import pytest
from tests_helpers import tiny_config, to_rounding

from coordinator.simulator import simulate

CHANCE = 0.1  # ten digit classes


@pytest.mark.parametrize("loss", ["kl", "gd"])
def test_persfl_federation_with_mixed_architectures_learns(loss, tmp_path):
    # Prepare: 4 clients (mlr, mlp) on 8×8 digits; stage 1 trains the global mlr.
    cfg = tiny_config(
        algorithm="persfl",
        models=["mlr", "mlp"],
        global_model="mlr",
        out=str(tmp_path),
        overrides={
            "persfl.distill_loss": loss,
            "persfl.distill_epochs": 3,
            "persfl.distill_lambdas": [0.0, 0.5],
            "persfl.distill_temperatures": [1.0, 4.0],
        },
    )

    # Execute
    results = simulate(cfg, progress=False)

    # Assert: well above chance, and each client says which teacher and (λ, T) it used.
    assert not any(r.failed for r in results.rounds)
    assert results.summary.mean_personal_acc > 4 * CHANCE
    for c in results.clients:
        d = c.details
        assert c.personal_acc > 3 * CHANCE
        assert 1 <= d["teacher_round"] <= 3  # a trained global model, never the initial one
        assert (d["distill_lambda"], d["distill_T"]) in {(0.0, 1.0), (0.5, 1.0), (0.5, 4.0)}
        assert d["student_init"] == ("teacher" if c.arch == "mlr" else "scratch")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["clients"][1]["teacher_round"] == results.clients[1].details["teacher_round"]
    report = (tmp_path / "report.md").read_text()
    assert "## Client details" in report and "distill_lambda" in report


def test_fedme_federation_with_mixed_architectures_learns(tmp_path):
    # Prepare: 4 clients (mlr, mlp); the coordinator clusters on 100 held-out digits.
    cfg = tiny_config(
        algorithm="fedme",
        models=["mlr", "mlp"],
        rounds=4,
        out=str(tmp_path),
        overrides={"fedme.unlabeled_size": 100, "fedme.lr": 0.05},
    )

    # Execute
    results = simulate(cfg, progress=False)

    # Assert: well above chance; the start and end architecture of every client, and the
    # architecture each client held after every round.
    assert not any(r.failed for r in results.rounds)
    assert results.summary.mean_personal_acc > 4 * CHANCE
    for c in results.clients:
        assert c.personal_acc > 3 * CHANCE
        assert c.details["arch_start"] == c.arch
        assert c.details["arch_end"] in {"mlr", "mlp"}
        last = results.rounds[-1].clients[c.id]["arch"]
        assert last == c.details["arch_end"]
    assert all(set(r.clients) == {"c0", "c1", "c2", "c3"} for r in results.rounds)
    report = (tmp_path / "report.md").read_text()
    assert "## Architectures over rounds" in report and "arch_end" in report


@pytest.mark.parametrize(
    ("algorithm", "overrides"),
    [
        (
            "persfl",
            {
                "persfl.distill_epochs": 2,
                "persfl.distill_lambdas": [0.0, 0.5],
                "persfl.distill_temperatures": [2.0],
            },
        ),
        (
            "fedme",
            {"fedme.unlabeled_size": 100, "fedme.lr": 0.05, "fedme.guard_distill_unlabeled": 200},
        ),
        # (the coordinator's inputs for the guard's students, held out for FML alone)
        ("fml", {"fml.guard_distill_unlabeled": 100, "fml.guard_distill_epochs": 3}),
    ],
)
def test_over_mosquitto_gives_the_in_memory_simulators_results(algorithm, overrides, mosquitto):
    # Per-client tasks, per-client details and FedMe's shared (exchanged) models over a real broker.
    def run(**kw):
        cfg = tiny_config(
            algorithm=algorithm,
            models=["mlr", "mlp"],
            global_model="mlr",
            rounds=2,
            overrides=overrides,
            **kw,
        )
        res = simulate(cfg, progress=False)
        details = [c.model_dump(exclude={"n_train"}) for c in res.clients]
        return details, [r.clients for r in res.rounds]

    over_mqtt = run(**{"broker.url": mosquitto.url})
    assert over_mqtt == to_rounding(run())  # (in memory, clients train stacked)
    assert all(c["personal_acc"] > 3 * CHANCE for c in over_mqtt[0])
    if algorithm != "persfl":  # every finalize carried all 100 unlabeled inputs over the broker
        assert {c["guard_distill_unlabeled"] for c in over_mqtt[0]} == {100}
        # ... and each says how many of its students kept them (of at most two)
        assert all(c["guard_distill_unlabeled_kept"] in (0, 1, 2) for c in over_mqtt[0])
