"""`edgefl bench onnx` and the zoo benchmark behind it (quick mode, tiny subsets)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from coordinator.bench import _has_convolutions, check_goals
from coordinator.cli import app
from edge_sdk.onnx_bench import BenchRow
from model_zoo import ArchSpec, build, families

runner = CliRunner()
REQUIRED = {
    "family",
    "variant",
    "latency_p50_ms_b1",
    "latency_p99_ms_b1",
    "throughput_b64",
    "size_bytes",
    "accuracy_delta",
}


def test_bench_onnx_quick_writes_rows_for_every_variant(tmp_path: Path):
    # Prepare: an empty data root, so the run falls back to digits (and must say so).
    out = tmp_path / "bench.json"

    # Execute
    res = runner.invoke(
        app,
        [
            "bench",
            "onnx",
            "--quick",
            "--families",
            "lenet5",
            "--device",
            "cpu",
            "--data-root",
            str(tmp_path),
            "--json-out",
            str(out),
        ],
    )

    # Assert
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["family"], r["variant"]) for r in rows] == [
        ("lenet5", "torch"),
        ("lenet5", "ort_fp32"),
        ("lenet5", "ort_int8_dynamic"),
        ("lenet5", "ort_int8_static"),
    ]
    for r in rows:
        assert set(r) >= REQUIRED, REQUIRED - set(r)
        assert r["latency_p50_ms_b1"] > 0 and r["throughput_b64"] > 0 and r["size_bytes"] > 0
        assert r["provider"] in ("torch:cpu", "CPUExecutionProvider")
        assert r["exporter"] == (None if r["variant"] == "torch" else "dynamo")
        assert r["path"] is None  # the files lived in a temporary directory
    fp32 = [r for r in rows if r["variant"] == "ort_fp32"]
    assert all(r["accuracy_delta"] == 0.0 and r["agreement_with_torch"] == 1.0 for r in fp32)
    assert all(r["accuracy"] > 0.5 for r in rows)  # trained briefly, but trained
    machine = report["machine"]
    assert machine["torch_threads"] == 1 and machine["ort_intra_op_threads"] == 1
    assert machine["ort_providers_used"] == ["CPUExecutionProvider"]
    assert {"torch", "onnxruntime", "onnx"} <= set(machine["versions"])
    assert "digits" in report["data"]["images"]
    assert "Fashion-MNIST is not installed" in report["data"]["images"]
    assert report["settings"]["quick"] is True
    assert {g["family"] for g in report["goals"]} == {"lenet5"}
    stdout = res.stdout  # progress lines go to stderr
    assert json.loads(stdout[: stdout.index("\n}\n") + 2]) == report  # JSON first
    assert "ort_int8_static" in res.output and "goals:" in res.output


def test_static_int8_is_for_families_with_convolutions():
    image = (1, 28, 28)
    specs = [ArchSpec(family=f, num_classes=10, input_shape=image) for f in families()]
    with_conv = {s.family for s in specs if _has_convolutions(build(s))}
    assert with_conv == {"cnn1", "cnn2", "lenet5", "vgg11", "vgg13", "vgg16", "vgg19"}


def test_bench_onnx_refuses_an_unknown_family():
    res = runner.invoke(app, ["bench", "onnx", "--quick", "--families", "resnet50"])
    assert res.exit_code == 2
    assert "unknown families resnet50" in res.output and "lstm-char" in res.output


def _row(variant: str, *, size: int, p50: float, delta: float | None) -> BenchRow:
    return BenchRow(
        family="cnn1",
        variant=variant,
        spec="cnn1",
        exporter="dynamo",
        provider="CPUExecutionProvider",
        device="cpu",
        threads=1,
        latency_p50_ms_b1=p50,
        latency_p99_ms_b1=p50,
        latency_calls_b1=10,
        throughput_b64=100.0,
        size_bytes=size,
        accuracy=0.8,
        accuracy_delta=delta,
        agreement_with_torch=1.0,
        eval_samples=100,
        latency_ratio_vs_torch=p50 / 2.0,
    )


def test_goals_compare_latency_size_and_accuracy_with_their_targets():
    rows = [
        _row("torch", size=1000, p50=2.0, delta=0.0),
        _row("ort_fp32", size=1200, p50=1.0, delta=0.0),  # exactly half: met
        _row("ort_int8_dynamic", size=400, p50=1.5, delta=-0.011),  # 3x smaller, 1.1 pts lost
        _row("ort_int8_static", size=401, p50=0.5, delta=-0.01),  # 2.99x smaller, 1 pt lost
    ]

    goals = {g["goal"]: (g["value"], g["met"]) for g in check_goals(rows)}

    assert goals == {
        "ort_fp32 p50 latency at batch 1 / torch's": (0.5, True),
        "ort_int8_dynamic: fp32 size / int8 size": (3.0, True),
        "ort_int8_dynamic: accuracy minus torch's (points)": (-1.1, False),
        "ort_int8_static: fp32 size / int8 size": (round(1200 / 401, 3), False),
        "ort_int8_static: accuracy minus torch's (points)": (-1.0, True),
    }
