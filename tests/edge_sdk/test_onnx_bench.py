"""The inference benchmark on already-exported files: rows, accuracy, sizes, timing counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tests_helpers import IMAGE
from torch import nn

from edge_sdk.export import export_onnx
from edge_sdk.onnx_bench import BenchSettings, benchmark_onnx, format_rows
from edge_sdk.quantization import quantize_dynamic_int8, quantize_static_int8
from model_zoo.models import example_input
from model_zoo.spec import ArchSpec, build

SPEC = ArchSpec(family="lenet5", num_classes=10, input_shape=IMAGE)
# Few repetitions: the test checks what is measured, not how fast anything is.
TINY = BenchSettings(warmup=1, rounds=2, latency_calls=3, throughput_batches=1)


@pytest.fixture
def exported(tmp_path: Path) -> tuple[nn.Module, list[Path]]:
    """LeNet-5 as fp32, dynamic int8 and static int8 files (legacy exporter: it is faster, and
    the benchmark reads files whichever exporter wrote them)."""
    model = build(SPEC, seed=0).eval()
    fp32 = export_onnx(model, SPEC, tmp_path / "fp32.onnx", exporter="legacy")
    quantize_dynamic_int8(fp32, tmp_path / "dynamic.onnx")
    calibration = example_input(SPEC, 64, torch.Generator().manual_seed(1))
    quantize_static_int8(fp32, tmp_path / "static.onnx", calibration)
    return model, [fp32, tmp_path / "dynamic.onnx", tmp_path / "static.onnx"]


def _labelled(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """40 inputs labelled so that PyTorch is right on exactly 30 of them."""
    x = example_input(SPEC, 40, torch.Generator().manual_seed(2))
    with torch.no_grad():
        labels = model(x).argmax(dim=1)
    labels[:10] = (labels[:10] + 1) % 10
    return x, labels


def _ort_accuracy(path: Path, x: torch.Tensor, labels: torch.Tensor) -> float:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x.numpy()})
    return float((logits.argmax(axis=1) == labels.numpy()).mean())


def test_benchmark_measures_torch_and_every_file_side_by_side(exported):
    # Prepare
    model, files = exported
    model.train()  # the caller's mode must survive the benchmark
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, labels = _labelled(model.eval())
    model.train()

    # Execute
    torch.set_num_threads(2)  # the benchmark's own count applies inside it, this one after
    rows = benchmark_onnx(files, x, labels, model=model, settings=TINY)

    # Assert
    assert [r.variant for r in rows] == ["torch", "ort_fp32", "ort_int8_dynamic", "ort_int8_static"]
    by = {r.variant: r for r in rows}
    assert by["torch"].accuracy == 0.75 and by["ort_fp32"].accuracy == 0.75
    assert by["ort_fp32"].accuracy_delta == 0.0 and by["ort_fp32"].agreement_with_torch == 1.0
    for variant, path in zip(["ort_int8_dynamic", "ort_int8_static"], files[1:], strict=True):
        expected = _ort_accuracy(path, x, labels)
        assert by[variant].accuracy == pytest.approx(expected)
        assert by[variant].accuracy_delta == pytest.approx(expected - 0.75)
    for row, path in zip(rows[1:], files, strict=True):
        assert row.size_bytes == path.stat().st_size and row.path == str(path)
        assert row.exporter == "legacy" and row.provider == "CPUExecutionProvider"
    weight_bytes = sum(v.numel() * v.element_size() for v in before.values())
    assert weight_bytes < by["torch"].size_bytes < weight_bytes + 4096  # + safetensors header
    assert by["torch"].provider == "torch:cpu" and by["torch"].exporter is None
    for row in rows:
        assert row.family == "lenet5" and row.spec == str(SPEC)
        assert row.eval_samples == 40 and row.threads == 1 and row.device == "cpu"
        assert row.latency_calls_b1 == TINY.rounds * TINY.latency_calls
        assert 0 < row.latency_p50_ms_b1 <= row.latency_p99_ms_b1
        assert row.throughput_b64 > 0
        assert row.latency_ratio_vs_torch == pytest.approx(
            row.latency_p50_ms_b1 / by["torch"].latency_p50_ms_b1, rel=1e-2, abs=1e-4
        )
    assert torch.get_num_threads() == 2
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    table = format_rows(rows)
    assert "ort_int8_static" in table and "75.00" in table


def test_benchmark_deltas_and_agreement_are_relative_to_the_torch_model(exported):
    # Prepare: a PyTorch model that is not the one in the file, so everything differs.
    model, files = exported
    x, labels = _labelled(model)
    other = build(SPEC, seed=1).eval()
    with torch.no_grad():
        other_pred = other(x).argmax(dim=1)
        file_pred = model(x).argmax(dim=1)  # what the fp32 file predicts
    other_acc = float((other_pred == labels).float().mean())

    # Execute
    rows = benchmark_onnx(files[0], x, labels, model=other, settings=TINY)

    # Assert
    torch_row, fp32 = rows
    assert torch_row.accuracy == pytest.approx(other_acc) and fp32.accuracy == 0.75
    assert fp32.accuracy_delta == pytest.approx(0.75 - other_acc) != 0
    agreement = float((file_pred == other_pred).float().mean())
    assert fp32.agreement_with_torch == pytest.approx(agreement) and agreement < 1


def test_benchmark_without_a_torch_model_measures_files_alone(exported):
    model, files = exported
    x, labels = _labelled(model)

    rows = benchmark_onnx(files[1], x.numpy(), labels.tolist(), settings=TINY)

    assert len(rows) == 1
    (row,) = rows
    assert row.variant == "ort_int8_dynamic"
    assert row.accuracy == pytest.approx(_ort_accuracy(files[1], x, labels))
    assert row.accuracy_delta is None and row.agreement_with_torch is None
    assert row.latency_ratio_vs_torch is None
    assert "—" in format_rows(rows)


def test_benchmark_refuses_mismatched_inputs(exported, tmp_path: Path):
    model, files = exported
    x, labels = _labelled(model)
    other_spec = ArchSpec(family="mlr", num_classes=10, input_shape=IMAGE)
    other = export_onnx(build(other_spec), other_spec, tmp_path / "mlr.onnx", exporter="legacy")
    with pytest.raises(ValueError, match="one model at once"):
        benchmark_onnx([files[0], other], x, labels, settings=TINY)
    with pytest.raises(ValueError, match="same variant"):
        benchmark_onnx([files[0], files[0]], x, labels, settings=TINY)
    with pytest.raises(ValueError, match=r"eval_inputs must have shape \(n, \*\(1, 28, 28\)\)"):
        benchmark_onnx(files[0], np.zeros((4, 28, 28), np.float32), labels[:4], settings=TINY)
    with pytest.raises(ValueError, match="as many eval_labels"):
        benchmark_onnx(files[0], x, labels[:5], settings=TINY)
    with pytest.raises(FileNotFoundError):
        benchmark_onnx(tmp_path / "missing.onnx", x, labels, settings=TINY)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        BenchSettings(rounds=0)


def test_edgefl_bench_onnx_measures_the_files_a_user_exported_fp16_included(exported, tmp_path):
    # Before: `edgefl bench onnx` measured only the zoo's own models, and benchmark_onnx refused
    # `edgefl export`'s fp16 files ("unknown quantization 'fp16' in the file's metadata").
    import json

    from typer.testing import CliRunner

    from coordinator.cli import app
    from edge_sdk.quantization import convert_fp16

    model, files = exported
    fp16 = tmp_path / "fp16.onnx"
    convert_fp16(files[0], fp16)
    x, labels = _labelled(model)
    np.savez(tmp_path / "test.npz", x=x.numpy(), y=labels.numpy())

    res = CliRunner().invoke(
        app,
        [
            *("bench", "onnx", str(files[0]), str(fp16), str(files[1])),
            *("--data", str(tmp_path / "test.npz"), "--quick", "--device", "cpu"),
        ],
    )

    assert res.exit_code == 0, res.output
    report = json.loads(res.output[: res.output.index("\n}\n") + 2])
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"ort_fp32", "ort_fp16", "ort_int8_dynamic"}
    assert rows["ort_fp16"]["accuracy"] == pytest.approx(_ort_accuracy(fp16, x, labels))
    assert rows["ort_fp32"]["eval_samples"] == 40


def test_where_int8_is_offered_the_help_says_it_may_be_slower_at_batch_1():
    from typer.testing import CliRunner

    from coordinator.cli import app

    for command, flag in (["export", "--format"], ["simulate", "--onnx-int8"]):
        text = " ".join(CliRunner().invoke(app, [command, "-h"]).output.split())
        at = text.index(flag)
        assert "at batch 1 not always faster than fp32" in text[at : at + 700], command
