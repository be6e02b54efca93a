"""Tests for coordinator.report: report.md and its PNG plots from a results dict."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.metrics import METRIC_KEYS, personalization_metrics
from coordinator.report import (
    CLIENT_PLOT_NAME,
    HTML_NAME,
    REPORT_NAME,
    ROUND_PLOT_NAME,
    ReportError,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _client(cid: str, arch: str, n: int, p: float, g: float | None, loc: float | None) -> dict:
    return {
        "id": cid,
        "arch": arch,
        "n_train": n,
        "personal_acc": p,
        "global_acc": g,
        "local_acc": loc,
    }


def _results_with_baselines() -> dict[str, Any]:
    clients = [
        _client("c0", "lenet5", 812, 0.93, 0.61, 0.88),
        _client("c1", "mlp", 640, 0.71, 0.75, 0.52),
        _client("c2", "cnn1", 455, 0.80, 0.66, 0.80),
    ]
    metrics = personalization_metrics(
        [c["personal_acc"] for c in clients],
        [c["global_acc"] for c in clients],
        [c["local_acc"] for c in clients],
    )
    return {
        "config": {
            "data": {"dataset": "mnist", "partition": {"name": "dirichlet", "alpha": 0.5}},
            "models": ["lenet5", "mlp", "cnn1"],
            "num_clients": 3,
            "rounds": 2,
            "seed": 7,
        },
        "algorithm": "fml",
        "rounds": [
            {"round": 1, "seconds": 0.8, "mean_personal_acc": 0.71, "global_acc": 0.55},
            {"round": 2, "seconds": 0.7, "mean_personal_acc": 0.8133, "global_acc": 0.6733},
        ],
        "clients": clients,
        "summary": {
            "mean_personal_acc": 0.8133,
            "global_acc": 0.6733,
            "wall_seconds": 3.2,
            "metrics": metrics,
        },
        "baselines": {
            "local": {
                "summary": {"mean_personal_acc": 0.7333, "global_acc": None, "wall_seconds": 1.1},
                "clients": [
                    _client("c0", "lenet5", 812, 0.88, None, None),
                    _client("c1", "mlp", 640, 0.52, None, None),
                    _client("c2", "cnn1", 455, 0.80, None, None),
                ],
            },
            "fedavg": {
                "summary": {"mean_personal_acc": 0.6733, "global_acc": 0.6733, "wall_seconds": 2},
                "clients": [
                    _client("c0", "lenet5", 812, 0.61, None, None),
                    _client("c1", "mlp", 640, 0.75, None, None),
                    _client("c2", "cnn1", 455, 0.66, None, None),
                ],
            },
        },
    }


def _results_without_baselines() -> dict[str, Any]:
    return {
        "config": {"seed": 3},
        "algorithm": "pfml",
        "rounds": [
            {"round": 1, "seconds": 0.5, "mean_personal_acc": 0.4, "global_acc": None},
            {"round": 2, "seconds": 0.6, "mean_personal_acc": 0.5, "global_acc": None},
        ],
        "clients": [
            _client("dev-a", "vgg11", 100, 0.55, None, None),
            _client("dev-b", "lstm", 90, 0.45, None, None),
        ],
        "summary": {"mean_personal_acc": 0.5, "global_acc": None, "wall_seconds": 1.5},
    }


def _assert_outputs(report: Path, out_dir: Path) -> str:
    assert report == out_dir / REPORT_NAME
    for name in (ROUND_PLOT_NAME, CLIENT_PLOT_NAME):
        assert (out_dir / name).read_bytes().startswith(PNG_SIGNATURE)
    leftovers = [p.name for p in out_dir.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
    return report.read_text(encoding="utf-8")


def test_write_report_with_baselines_writes_report_and_plots(tmp_path: Path) -> None:
    # Prepare
    results = _results_with_baselines()

    # Execute
    report = write_report(results, tmp_path)

    # Assert
    text = _assert_outputs(report, tmp_path)
    assert text.startswith("# Results report: fml")
    assert "| c0 | lenet5 | 812 | 93.00% | 88.00% | 61.00% | — | +5.00 pp |" in text
    assert "| c1 | mlp | 640 | 71.00% | 52.00% | 75.00% | — | -4.00 pp |" in text
    assert "| c2 | cnn1 | 455 | 80.00% | 80.00% | 66.00% | — | +0.00 pp |" in text
    for key in METRIC_KEYS:
        assert f"| {key} |" in text
    assert "| PUI | 33.33% |" in text
    assert "| MPD | -4.00 pp |" in text
    assert "### Fairness over QoI" in text
    assert "| Dataset | mnist |" in text
    assert '| Partition | dirichlet {"alpha": 0.5} |' in text
    assert "| Models | lenet5, mlp, cnn1 |" in text
    assert "| Seed | 7 |" in text
    assert "| 2 | 0.70 | 81.33% | 67.33% |" in text
    assert "## Baselines" in text
    assert "| local | 73.33% | — | 1.10 s |" in text
    assert "| c1 | 52.00% | 75.00% |" in text
    assert f"]({ROUND_PLOT_NAME})" in text
    assert f"]({CLIENT_PLOT_NAME})" in text


def test_write_report_without_baselines_renders_nulls_as_dash(tmp_path: Path) -> None:
    report = write_report(_results_without_baselines(), tmp_path / "new" / "dir")

    text = _assert_outputs(report, tmp_path / "new" / "dir")
    assert "| dev-a | vgg11 | 100 | 55.00% | — | — | — |" in text
    assert "| 1 | 0.50 | 40.00% | — |" in text
    assert "| global_acc | — |" in text
    assert "| Dataset | — |" in text
    assert "| Models | lstm, vgg11 |" in text  # falls back to the clients' architectures
    assert "| Clients | 2 |" in text
    assert "## Personalization metrics" not in text
    assert "## Baselines" not in text


def test_write_report_with_null_metrics_and_no_improved_clients(tmp_path: Path) -> None:
    # Prepare: everyone worsened, so MPI/API and fairness over U+ are null.
    results = _results_with_baselines()
    results["summary"]["metrics"] = personalization_metrics([0.5, 0.5], [0.6, 0.6], [0.7, 0.5])
    results["summary"]["metrics"] = json.loads(json.dumps(results["summary"]["metrics"]))

    # Execute
    text = write_report(results, tmp_path).read_text(encoding="utf-8")

    # Assert
    assert "| MPI | — |" in text
    assert "| PUD | 100.00% |" in text
    assert "| JI | — | 0.9000 |" in text  # U+ empty, |U−| = [20, 10]


def test_write_report_minimal_results(tmp_path: Path) -> None:
    report = write_report({}, tmp_path)

    text = _assert_outputs(report, tmp_path)
    assert "# Results report: unknown algorithm" in text
    assert "No rounds were recorded." in text
    assert "No clients were recorded." in text


def test_write_report_overwrites_previous_report(tmp_path: Path) -> None:
    write_report(_results_without_baselines(), tmp_path)

    text = write_report(_results_with_baselines(), tmp_path).read_text(encoding="utf-8")

    assert "# Results report: fml" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [REPORT_NAME, HTML_NAME, ROUND_PLOT_NAME, CLIENT_PLOT_NAME]
    )


def test_write_report_escapes_pipes_in_cells(tmp_path: Path) -> None:
    results = _results_without_baselines()
    results["clients"][0]["id"] = "a|b"

    text = write_report(results, tmp_path).read_text(encoding="utf-8")

    assert "| a\\|b | vgg11 |" in text


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(rounds="oops"), r"results\['rounds'\] must be a list"),
        (lambda r: r["clients"].append(3), r"results\['clients'\]\[2\] must be an object"),
        (
            lambda r: r["clients"][0].update(personal_acc="93%"),
            r"results\['clients'\]\[0\]\['personal_acc'\] must be a number or null",
        ),
        (lambda r: r.update(summary=[1]), r"results\['summary'\] must be an object"),
    ],
)
def test_write_report_rejects_malformed_results(tmp_path: Path, mutate, message) -> None:
    results = copy.deepcopy(_results_without_baselines())
    mutate(results)

    with pytest.raises(ReportError, match=message):
        write_report(results, tmp_path)
    assert not (tmp_path / REPORT_NAME).exists()


def test_write_report_rejects_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="must be a dict"):
        write_report([], tmp_path)  # type: ignore[arg-type]


def test_client_qoi_uses_the_fedavg_baseline_when_it_ran(tmp_path: Path) -> None:
    # Prepare: this run's global model is poor, FedAvg's is strong: QoI must compare to FedAvg.
    results = _results_with_baselines()
    results["clients"][0]["fedavg_acc"] = 0.95

    # Execute
    text = write_report(results, tmp_path).read_text()

    # Assert
    assert "| c0 | lenet5 | 812 | 93.00% | 88.00% | 61.00% | 95.00% | -2.00 pp |" in text


def test_report_lists_the_algorithms_hyperparameters(tmp_path: Path) -> None:
    results = _results_with_baselines()
    results["config"] = {"algorithm": "fml", "fml": {"alpha": 0.5, "beta": 0.3}}
    text = write_report(results, tmp_path).read_text()
    assert "| fml settings | alpha=0.5, beta=0.3 |" in text
