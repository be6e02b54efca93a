"""The typed results document: what results.json holds, what it means, and that old files read.

`simulate` returns a `Results`; results.json is that document dumped, with the keys and nesting
results.json always had (plus the new ones the README lists).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from tests_helpers import tiny_config

from coordinator.results_model import Results
from coordinator.simulator import simulate

# A results.json as the code before the typed results wrote it (trimmed to two clients).
OLD_FILE: dict[str, Any] = {
    "config": {"algorithm": "fml", "rounds": 2, "data": {"dataset": "digits"}},
    "algorithm": "fml",
    "budget": {"fml": {"local_epochs": 1, "batch_size": 128, "lr": 0.01}},
    "rounds": [
        {
            "round": 1,
            "seconds": 0.0915,
            "mean_personal_acc": 0.474,
            "global_acc": 0.3677,
            "failed": False,
            "replied": 2,
            "trained": 2,
            "client_acc": {"c0": 0.652, "c1": 0.217},
        }
    ],
    "clients": [
        {
            "id": "c0",
            "arch": "mlr",
            "n_train": 275,
            "personal_acc": 0.902,
            "global_acc": 0.533,
            "local_acc": 0.935,
            "fedavg_acc": 0.793,
            "teacher_round": 2,
            "student_init": "teacher",
        },
        {
            "id": "c1",
            "arch": "mlp",
            "n_train": 276,
            "personal_acc": 0.543,
            "global_acc": None,
            "local_acc": 0.598,
            "fedavg_acc": 0.826,
            "error": "no valid finalize reply",
        },
    ],
    "summary": {
        "mean_personal_acc": 0.652,
        "global_acc": 0.604,
        "best_mean_personal_acc": 0.652,
        "best_global_acc": 0.604,
        "failed_rounds": 0,
        "wall_seconds": 0.44,
        "coordinator_bytes_out": 172947,
        "coordinator_bytes_in": 264642,
        "metrics": {"PUI": 25.0, "MPI": None, "fairness_improved": {"AV": 0.0, "JI": 1.0}},
        "metrics_global_from": "fedavg",
    },
    "collaboration_clients": ["c0", "c1"],
    "collaboration": [[0.9, 0.1], [0.2, 0.8]],
    "baselines": {
        "local": {
            "summary": {
                "mean_personal_acc": 0.717,
                "global_acc": None,
                "best_global_acc": None,
                "wall_seconds": 0.17,
            },
            "clients": [{"id": "c0", "arch": "mlr", "personal_acc": 0.935, "global_acc": None}],
        }
    },
    "split": {
        "scheme": "dirichlet",
        "classes": ["0", "1"],
        "clients": [{"id": "c0", "n_train": 3, "n_val": 1, "n_test": 1, "counts": [2, 1]}],
    },
}
NEW_CLIENT_KEYS = {"fedavg_ft_acc", "dataset", "device", "precision"}


def _contains(new: Any, old: Any, where: str = "results") -> None:
    """Every key and value of `old` is in `new`, at the same place."""
    if isinstance(old, dict):
        assert isinstance(new, dict), where
        for key, value in old.items():
            assert key in new, f"{where}[{key!r}] is gone"
            _contains(new[key], value, f"{where}[{key!r}]")
    elif isinstance(old, list):
        assert isinstance(new, list) and len(new) == len(old), where
        for i, (n, o) in enumerate(zip(new, old, strict=True)):
            _contains(n, o, f"{where}[{i}]")
    else:
        assert new == old, f"{where}: {new!r} != {old!r}"


def test_a_results_file_from_before_the_typed_results_reads_and_keeps_its_keys():
    # Execute: read it as the report does, and write it back.
    results = Results.parse(json.dumps(OLD_FILE))
    again = json.loads(results.to_json())

    # Assert: nothing it held is lost or moved; clients gain only the documented keys.
    _contains(again, OLD_FILE)
    for new, old in zip(again["clients"], OLD_FILE["clients"], strict=True):
        assert set(new) - set(old) == NEW_CLIENT_KEYS
    assert results.clients[0].details == {"teacher_round": 2, "student_init": "teacher"}
    assert "error" not in again["clients"][0]  # still left out when there is none
    assert "clients" not in again["rounds"][0]  # no fit details: no key, as before
    # The round's spread follows from its two clients (linear interpolation, by hand).
    low, high = 0.217, 0.652
    assert again["rounds"][0]["acc_spread"] == pytest.approx(
        {
            "n": 2,
            "min": low,
            "p10": low + 0.1 * (high - low),
            "p50": (low + high) / 2,
            "p90": low + 0.9 * (high - low),
            "max": high,
        }
    )


def _percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, written out."""
    v = sorted(values)
    at = q / 100 * (len(v) - 1)
    below = int(at)
    above = min(below + 1, len(v) - 1)
    return v[below] + (at - below) * (v[above] - v[below])


def test_past_client_history_rounds_keep_counts_and_spread_and_the_results_stay_the_same(
    tmp_path,
):
    # Prepare: 5 clients × 3 rounds are 15 client-rounds; the second run keeps at most 14.
    def run(out, **round_):
        cfg = tiny_config(
            algorithm="fedme",
            clients=5,
            models=["mlr", "mlp"],
            out=str(tmp_path / out),
            baselines=[],
            overrides={"fedme.unlabeled_size": 100, "round": round_},
        )
        return simulate(cfg, progress=False)

    # Execute
    full = run("full")
    compact = run("compact", client_history=14)

    # Assert: the same run (the history is what it keeps, not what it does)...
    assert [c.personal_acc for c in compact.clients] == [c.personal_acc for c in full.clients]
    same = {"wall_seconds": compact.summary.wall_seconds}
    assert compact.summary == full.summary.model_copy(update=same)
    for f, c in zip(full.rounds, compact.rounds, strict=True):
        # ...whose rounds keep their counts and means but no client's part...
        assert f.client_acc and f.clients and not c.client_acc and not c.clients
        assert (c.trained, c.replied, c.mean_personal_acc) == (5, 5, f.mean_personal_acc)
        # ...and the spread of the clients' accuracies, computed here from the full run's.
        accs = list(f.client_acc.values())
        assert c.acc_spread is not None and c.acc_spread.n == 5
        assert c.acc_spread.min == min(accs) and c.acc_spread.max == max(accs)
        for q in (10, 50, 90):
            assert getattr(c.acc_spread, f"p{q}") == pytest.approx(_percentile(accs, q))
    # The report says why the rounds have no per-client parts, and draws the band.
    text = (tmp_path / "compact" / "report.md").read_text()
    assert "exceed `round.client_history`" in text
    assert "exceed `round.client_history`" not in (tmp_path / "full" / "report.md").read_text()
    a = compact.rounds[-1].acc_spread
    assert f"| {100 * a.p10:.2f}%–{100 * a.p90:.2f}% (5 clients) |" in text


def test_results_json_is_the_document_simulate_returns(tmp_path):
    # Prepare / Execute
    cfg = tiny_config(algorithm="fml", models=["mlr", "mlp"], rounds=2, out=str(tmp_path))
    results = simulate(cfg, progress=False)

    # Assert: what was written validates back into the same typed results.
    assert Results.read(tmp_path / "results.json") == results
    assert [c.arch for c in results.clients] == ["mlr", "mlp", "mlr", "mlp"]


def test_one_global_accuracy_the_mean_over_clients_in_every_place_it_is_shown(tmp_path):
    # Prepare: clients of very different sizes, so that a mean over clients and an accuracy
    # pooled over all test samples differ.
    cfg = tiny_config(
        algorithm="fml",
        models=["mlr", "mlp"],
        global_model="mlr",
        rounds=2,
        out=str(tmp_path),
        **{"data.partition": "dirichlet", "data.partition_params": {"alpha": 0.3}},
    )

    # Execute
    results = simulate(cfg, progress=False)

    # Assert: computed here from each client's own accuracy and test-split size.
    assert results.split is not None
    accs = [c.global_acc for c in results.clients]
    sizes = [c.n_test for c in results.split.clients]
    assert all(a is not None for a in accs)
    mean = sum(accs) / len(accs)
    pooled = sum(a * n for a, n in zip(accs, sizes, strict=True)) / sum(sizes)
    assert abs(mean - pooled) > 1e-3  # the two definitions differ here
    assert results.summary.global_acc == pytest.approx(mean, abs=1e-12)
    assert results.rounds[-1].global_acc == pytest.approx(mean, abs=1e-12)
    assert results.summary.best_global_acc == max(r.global_acc for r in results.rounds)
    # The report shows that one number at the top and in the summary, named the same way.
    text = (tmp_path / "report.md").read_text()
    shown = f"{100 * mean:.2f}%"
    assert f"| fml global model (final) | {shown} |" in text
    assert f"| Mean fml global-model accuracy, final | global_acc | {shown} |" in text
    assert f"{100 * pooled:.2f}%" not in text


def test_fedavg_ft_is_a_baseline_of_each_client_and_the_verdict_takes_the_best(tmp_path):
    # Prepare
    cfg = tiny_config(
        algorithm="fml",
        models=["mlr", "mlp"],
        global_model="mlr",
        rounds=2,
        baselines=["local", "fedavg", "fedavg_ft"],
        out=str(tmp_path),
        overrides={"fedavg_ft.ft_epochs": 3},
        **{"data.partition": "dirichlet", "data.partition_params": {"alpha": 0.3}},
    )

    # Execute
    results = simulate(cfg, progress=False)

    # Assert: each client's FedAvg+FT accuracy is the fine-tuned model of the fedavg_ft run,
    # and the verdict compares with the best of the three, computed here.
    ft = {c.id: c.personal_acc for c in results.baselines["fedavg_ft"].clients}
    local = {c.id: c.personal_acc for c in results.baselines["local"].clients}
    fedavg = {c.id: c.global_acc for c in results.baselines["fedavg"].clients}
    text = (tmp_path / "report.md").read_text()
    bests = []
    for c in results.clients:
        assert c.fedavg_ft_acc == ft[c.id] and c.fedavg_ft_acc is not None
        candidates = {"local": local[c.id], "FedAvg": fedavg[c.id], "FedAvg+FT": ft[c.id]}
        best = max(candidates.values())
        name = next(k for k, v in candidates.items() if v == best)
        assert c.best_baseline() == (name, best)
        bests.append(name)
        row = text.split(f"| {c.id} | {c.arch} |", 1)[1].split("\n", 1)[0]
        assert f"best baseline** ({name}, " in row or f"best baseline ({name}" in row
    assert "FedAvg+FT" in bests  # FedAvg+FT is some client's best here: the case is exercised
    assert "| FedAvg+FT: FedAvg fine-tuned on each client (baseline) |" in text
    assert results.budget["fedavg_ft"]["ft_epochs"] == 3


def test_simulate_records_the_device_it_trained_on_and_why(tmp_path):
    cfg = tiny_config(algorithm="fedavg", rounds=1, clients=2, device="cpu", out=str(tmp_path))
    results = simulate(cfg, progress=False)

    assert results.device is not None
    assert results.device.model_dump() == {
        "requested": "cpu",
        "used": "cpu",
        "reason": "asked for cpu",
        "precision": "float32",
    }
    assert [(c.device, c.precision, c.dataset) for c in results.clients] == [
        ("cpu", "float32", "digits")
    ] * 2
    assert "Device: `cpu` (asked for cpu), float32." in (tmp_path / "report.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA on this machine")
def test_auto_without_cuda_says_it_fell_back_to_the_cpu():
    results = simulate(tiny_config(algorithm="local", rounds=1, clients=2, device="auto"))
    assert results.device is not None
    assert (results.device.used, results.device.reason) == ("cpu", "auto: CUDA is not available")


def test_metrics_skipped_says_which_baseline_would_give_them(tmp_path, caplog):
    # federico has no global model: the metrics need FedAvg's, and the warning says so.
    cfg = tiny_config(
        algorithm="federico", rounds=1, clients=2, baselines=["local"], out=str(tmp_path)
    )

    with caplog.at_level("WARNING", logger="coordinator.results"):
        results = simulate(cfg, progress=False)

    assert results.summary.metrics is None
    skipped = [r.getMessage() for r in caplog.records if "metrics skipped" in r.getMessage()]
    assert len(skipped) == 1 and "add fedavg to the baselines" in skipped[0], skipped
