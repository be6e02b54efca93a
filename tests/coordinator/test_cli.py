"""The `edgefl` command line, run in-process with typer's runner."""

import json

import numpy as np
from typer.testing import CliRunner

from coordinator.cli import app
from edge_sdk.budget import arch_name
from edge_sdk.inference import OnnxPredictor

runner = CliRunner()


def test_simulate_writes_results_report_plots_and_onnx(tmp_path):
    # Prepare / Execute
    out = tmp_path / "run"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--algorithm",
            "fml",
            "--dataset",
            "digits",
            "--partition",
            "dirichlet",
            "--models",
            "mlr,mlp",
            "--global-model",
            "mlr",
            "--clients",
            "3",
            "--rounds",
            "2",
            "--local-epochs",
            "1",
            "--batch-size",
            "32",
            "--lr",
            "0.1",
            "--baselines",
            "local,fedavg",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--export-onnx",
            "--quiet",
            "--set",
            'data.options={"size": 8}',
        ],
    )

    # Assert
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["algorithm"] == "fml"
    assert results["config"]["fml"]["lr"] == 0.1 and results["config"]["local"]["lr"] == 0.1
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert {"PUI", "JI"} <= set(results["summary"]["metrics"])
    for c in results["clients"]:
        assert {"id", "arch", "n_train", "personal_acc", "global_acc", "local_acc"} <= set(c)
    assert "c2" in (out / "split.txt").read_text()
    for name in (
        "report.md",
        "personal_acc_per_round.png",
        "client_accuracy.png",
        "label_distribution.png",
    ):
        assert (out / name).stat().st_size > 0
    # Every client's personalized model is on disk and predicts on its own.
    onnx_files = sorted((out / "onnx").glob("*.onnx"))
    assert [p.stem for p in onnx_files] == ["c0", "c1", "c2"]
    predictor = OnnxPredictor(onnx_files[1])
    # c1 (an mlp) deploys what its guard chose: by default the mixture of its own model and the
    # fine-tuned global one, or another model the guard found clearly better.
    assert arch_name(predictor.spec) == results["clients"][1]["deployed_arch"]
    probs = predictor.predict_proba(np.zeros((2, 1, 8, 8), dtype=np.float32))
    assert probs.shape == (2, 10)
    assert "mean personalized accuracy" in res.output
    # The console names the device it used and why, and each mean for what it is.
    assert "device: cpu (asked for cpu), float32" in res.output
    assert results["device"] == {
        "requested": "cpu",
        "used": "cpu",
        "reason": "asked for cpu",
        "precision": "float32",
    }
    assert "FedAvg global model" in res.output and "fml global model" in res.output


def test_simulate_reports_bad_input_cleanly(tmp_path):
    res = runner.invoke(app, ["simulate", "--algorithm", "fedsgd", "--quiet"])
    assert res.exit_code == 2
    assert "unknown algorithm 'fedsgd'" in res.output
    res = runner.invoke(
        app, ["simulate", "--dataset", "mnist", "--data-root", str(tmp_path), "--quiet"]
    )
    assert res.exit_code == 2
    assert "train-images-idx3-ubyte" in res.output


def test_an_architecture_that_cannot_take_the_data_fails_before_any_round():
    res = runner.invoke(
        app,
        [
            "simulate",
            "--dataset",
            "synthetic",
            "--models",
            "lenet5",
            "--rounds",
            "1",
            "--set",
            'data.options={"num_users": 3}',
            "--clients",
            "3",
            "--quiet",
        ],
    )
    assert res.exit_code == 2
    assert "lenet5" in res.output and "registered" not in res.output


def test_zoo_lists_families_and_algorithms():
    res = runner.invoke(app, ["zoo"])
    assert res.exit_code == 0
    assert "lenet5" in res.output and "pfml" in res.output


def test_split_shows_the_partition_without_training(tmp_path):
    png = tmp_path / "labels.png"
    res = runner.invoke(
        app,
        [
            "split",
            "--dataset",
            "digits",
            "--partition",
            "shards",
            "--clients",
            "4",
            "--set",
            "data.partition_params.classes_per_client=2",
            "--plot",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "c3" in res.output and "n_train" in res.output
    assert png.read_bytes().startswith(b"\x89PNG")


def test_simulate_runs_in_process_or_over_the_network_to_the_same_results(tmp_path):
    # Prepare
    def simulate(*extra):
        out = tmp_path / "-".join(extra or ("default",))
        args = ["simulate", "--algorithm", "fml", "--models", "mlr,mlp", "--global-model", "mlr"]
        args += ["--clients", "3", "--rounds", "2", "--local-epochs", "1", "--device", "cpu"]
        args += ["--out", str(out), "--quiet", "--set", 'data.options={"size": 8}', *extra]
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        results = json.loads((out / "results.json").read_text())
        return results["config"]["fleet"], [c["personal_acc"] for c in results["clients"]]

    # Execute
    default, network = simulate(), simulate("--fleet", "network")

    # Assert: in process by default; the same accuracies either way
    assert default[0] == "local" and network[0] == "network"
    assert default[1] == network[1]

    # ... and a fleet that does not exist is a clean error
    res = runner.invoke(app, ["simulate", "--fleet", "cloud", "--quiet"])
    assert res.exit_code == 2 and "fleet" in res.output and "Traceback" not in res.output
