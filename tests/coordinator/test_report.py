"""Tests for coordinator.report: report.md and its PNG plots from typed results.

The results are written here as the dicts results.json holds, then validated into `Results`
(`Results.parse`) as reading a results.json file does.
"""

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
    write_report,
)
from coordinator.results_model import Results, ResultsError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write(results: dict[str, Any], out_dir: Path) -> Path:
    return write_report(Results.parse(results), out_dir)


def _client(cid: str, arch: str, n: int, p: float, g: float | None, loc: float | None) -> dict:
    return {
        "id": cid,
        "arch": arch,
        "n_train": n,
        "personal_acc": p,
        "global_acc": g,
        "local_acc": loc,
    }


def _baseline_client(cid: str, arch: str, p: float) -> dict:
    return {"id": cid, "arch": arch, "personal_acc": p, "global_acc": None}


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
                    _baseline_client("c0", "lenet5", 0.88),
                    _baseline_client("c1", "mlp", 0.52),
                    _baseline_client("c2", "cnn1", 0.80),
                ],
            },
            "fedavg": {
                "summary": {"mean_personal_acc": 0.6733, "global_acc": 0.6733, "wall_seconds": 2},
                "clients": [
                    _baseline_client("c0", "lenet5", 0.61),
                    _baseline_client("c1", "mlp", 0.75),
                    _baseline_client("c2", "cnn1", 0.66),
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
    report = _write(results, tmp_path)

    # Assert
    text = _assert_outputs(report, tmp_path)
    assert text.startswith("# Results report: fml")
    better = "better than the best baseline"
    assert f"| c0 | lenet5 | 812 | 93.00% | 88.00% | 61.00% | {better} (local, +5.00 pp) |" in text
    assert f"| c1 | mlp | 640 | 71.00% | 52.00% | 75.00% | {better} (local, +19.00 pp) |" in text
    assert (
        "| c2 | cnn1 | 455 | 80.00% | 80.00% | 66.00% | same as the best baseline (local) |" in text
    )
    assert "| Personalized | Local | fml global | Verdict | QoI |" in text  # no FedAvg columns
    assert (
        "(local, +5.00 pp) | +5.00 pp |" in text and "(local, +19.00 pp) | -4.00 pp |" in text
    )  # QoI
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
    report = _write(_results_without_baselines(), tmp_path / "new" / "dir")

    text = _assert_outputs(report, tmp_path / "new" / "dir")
    assert "| dev-a | vgg11 | 100 | 55.00% | no baseline ran | — |" in text
    assert "| 1 | 0.50 | 40.00% | — |" in text
    assert "| Mean pfml global-model accuracy, final | global_acc | — |" in text
    assert "| Dataset | — |" in text
    assert "| Models | vgg11, lstm |" in text  # the clients' architectures, in their order
    assert "| Clients | 2 |" in text
    assert "## Personalization metrics" not in text
    assert "## Baselines" not in text


def test_write_report_with_null_metrics_and_no_improved_clients(tmp_path: Path) -> None:
    # Prepare: everyone worsened, so MPI/API and fairness over U+ are null.
    results = _results_with_baselines()
    results["summary"]["metrics"] = personalization_metrics([0.5, 0.5], [0.6, 0.6], [0.7, 0.5])
    results["summary"]["metrics"] = json.loads(json.dumps(results["summary"]["metrics"]))

    # Execute
    text = _write(results, tmp_path).read_text(encoding="utf-8")

    # Assert
    assert "| MPI | — |" in text
    assert "| PUD | 100.00% |" in text
    assert "| JI | — | 0.9000 |" in text  # U+ empty, |U−| = [20, 10]


def test_write_report_minimal_results(tmp_path: Path) -> None:
    report = _write({"algorithm": "pfml"}, tmp_path)

    text = _assert_outputs(report, tmp_path)
    assert "# Results report: pfml" in text
    assert "No rounds were recorded." in text
    assert "No clients were recorded." in text


def test_write_report_overwrites_previous_report(tmp_path: Path) -> None:
    _write(_results_without_baselines(), tmp_path)

    text = _write(_results_with_baselines(), tmp_path).read_text(encoding="utf-8")

    assert "# Results report: fml" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [REPORT_NAME, HTML_NAME, ROUND_PLOT_NAME, CLIENT_PLOT_NAME]
    )


def test_write_report_escapes_pipes_in_cells(tmp_path: Path) -> None:
    results = _results_without_baselines()
    results["clients"][0]["id"] = "a|b"

    text = _write(results, tmp_path).read_text(encoding="utf-8")

    assert "| a\\|b | vgg11 |" in text


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(rounds="oops"), r"results['rounds']: Input should be a valid array"),
        (
            lambda r: r["clients"].append(3),
            r"results['clients'][2]: Input should be an object",
        ),
        (
            lambda r: r["clients"][0].update(personal_acc="93%"),
            r"results['clients'][0]['personal_acc']: Input should be a valid number",
        ),
        (
            lambda r: r["clients"][0].update(personal_acc=1.5),
            r"results['clients'][0]['personal_acc']: Input should be less than or equal to 1",
        ),
        (
            lambda r: r.update(summary=[1]),
            r"results['summary']: Input should be an object",
        ),
        (lambda r: r.pop("algorithm"), r"results['algorithm']: Field required"),
    ],
)
def test_a_malformed_results_file_is_refused_naming_the_field(
    tmp_path: Path, mutate, message
) -> None:
    # Prepare: a results.json file with one bad field.
    results = copy.deepcopy(_results_without_baselines())
    mutate(results)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))

    # Execute / Assert: reading it names the file and the field; nothing is written.
    with pytest.raises(ResultsError) as caught:
        Results.read(path)
    assert str(caught.value).startswith(f"{path}: {message}")
    assert not (tmp_path / REPORT_NAME).exists()


def test_write_report_takes_typed_results_only(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^write_report takes a Results \(Results.parse"):
        write_report({"algorithm": "fml"}, tmp_path)  # type: ignore[arg-type]


def test_client_qoi_uses_the_fedavg_baseline_when_it_ran(tmp_path: Path) -> None:
    # Prepare: this run's global model is poor, FedAvg's is strong: QoI must compare to FedAvg.
    results = _results_with_baselines()
    results["clients"][0]["fedavg_acc"] = 0.95

    # Execute
    text = _write(results, tmp_path).read_text()

    # Assert
    assert "| c0 | lenet5 | 812 | 93.00% | 88.00% | 95.00% | 61.00% |" in text
    assert "(FedAvg, -2.00 pp) | -2.00 pp |" in text


def test_report_lists_the_algorithms_hyperparameters(tmp_path: Path) -> None:
    results = _results_with_baselines()
    results["config"] = {"algorithm": "fml", "fml": {"alpha": 0.5, "beta": 0.3}}
    text = _write(results, tmp_path).read_text()
    assert "| fml settings | alpha=0.5, beta=0.3 |" in text


def test_a_deployment_on_mixed_devices_shows_each_clients_device(tmp_path: Path) -> None:
    # Prepare: what a coordinator daemon records from three registrations.
    results = _results_without_baselines()
    results["clients"].append(_client("dev-c", "mlr", 80, 0.5, None, None))
    for c, (device, precision) in zip(
        results["clients"],
        [("cpu", "float32"), ("cuda:0", "bfloat16 autocast"), ("cpu", "float32")],
        strict=True,
    ):
        c.update(device=device, precision=precision, dataset="fashion_mnist")
    results["device"] = {
        "used": "cpu ×2, cuda:0 ×1",
        "reason": "as each client reported when it registered",
        "precision": "bfloat16 autocast, float32",
    }

    # Execute
    text = _write(results, tmp_path).read_text()

    # Assert
    assert (
        "Device: `cpu ×2, cuda:0 ×1` (as each client reported when it registered), "
        "bfloat16 autocast, float32." in text
    )
    assert "| Client | Arch | Device | n_train |" in text
    assert "| dev-b | lstm | cuda:0 (bfloat16 autocast) | 90 |" in text
    assert "trained 3 clients for 2 rounds on fashion_mnist." in text


def test_the_verdict_compares_with_fedavg_ft_when_it_is_the_best_baseline(tmp_path: Path) -> None:
    # Prepare: for c0, FedAvg+FT beats local and FedAvg; for c1, local is best.
    results = _results_with_baselines()
    results["clients"][0].update(fedavg_acc=0.70, fedavg_ft_acc=0.95)
    results["clients"][1].update(fedavg_acc=0.40, fedavg_ft_acc=0.50)

    # Execute
    text = _write(results, tmp_path).read_text()

    # Assert
    assert "**worse than the best baseline** (FedAvg+FT, -2.00 pp)" in text  # c0: 93 vs 95
    assert "better than the best baseline (local, +19.00 pp)" in text  # c1: 71 vs 52
    assert "| FedAvg+FT: FedAvg fine-tuned on each client (baseline) | 72.50% |" in text


def test_each_clients_row_says_what_it_deployed_and_how_big(tmp_path: Path) -> None:
    # Prepare: the clients' finalize replies said what they deployed (c1: a mixture).
    results = _results_with_baselines()
    deployed = {"c0": ("lenet5", 241.04), "c1": ("mixture of mlp+lenet5", 551.5)}
    for c in results["clients"]:
        if c["id"] in deployed:
            arch, kib = deployed[c["id"]]
            c.update(deployed_arch=arch, deployed_kib=kib, deployed_reason="Because.")

    # Execute
    text = _write(results, tmp_path).read_text(encoding="utf-8")

    # Assert: a Deployed column, with the architecture and the size of its weights.
    assert "| Client | Arch | Deployed | n_train |" in text
    assert "| c0 | lenet5 | lenet5, 241 KiB | 812 | 93.00% |" in text
    assert "| c1 | mlp | mixture of mlp+lenet5, 552 KiB | 640 | 71.00% |" in text
    assert "| c2 | cnn1 | — | 455 | 80.00% |" in text  # it said nothing


def test_the_split_plot_of_a_population_draws_the_clients_with_results_first():
    # Prepare: 150 clients, the last 30 with results (a sample evaluated), more than a plot draws
    from coordinator.report.plots import split_figure
    from coordinator.results_model import Split

    ids = [f"c{i:03d}" for i in range(150)]
    split = Split.model_validate(
        {
            "classes": ["a", "b"],
            "clients": [
                {"id": c, "n_train": 3, "n_val": 1, "n_test": 1, "counts": [1, 2]} for c in ids
            ],
        }
    )
    arch = {c: "mlp" for c in ids[120:]}

    # Execute
    (axes,) = split_figure(split, arch).axes

    # Assert: 100 bars, the 30 with results and the first 70 others, in the split's order
    shown = [t.get_text() for t in axes.get_yticklabels()]
    assert shown == ids[:70] + [f"{c} (mlp)" for c in ids[120:]]
    assert axes.get_title().endswith("(100 of 150; split.txt has every one)")
