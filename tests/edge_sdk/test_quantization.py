"""Int8 quantization (dynamic and static QDQ) of exported models, and parity on real images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from tests_helpers import IMAGE
from torch import nn

from edge_sdk.export import META_QUANTIZATION, export_onnx, read_metadata
from edge_sdk.inference import OnnxPredictor
from edge_sdk.quantization import quantize_dynamic_int8, quantize_static_int8
from model_zoo.models import example_input
from model_zoo.spec import ArchSpec, build


def _model(spec: ArchSpec, seed: int = 0) -> nn.Module:
    return build(spec, seed=seed).eval()


def _session_predictions(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x.numpy()})
    return logits.argmax(axis=1)


@pytest.mark.parametrize(
    "spec",
    [
        ArchSpec(family="mlp", num_classes=10, input_shape=IMAGE),
        ArchSpec(family="lenet5", num_classes=10, input_shape=IMAGE),
        ArchSpec(family="lstm", num_classes=10, input_shape=IMAGE),
    ],
    ids=lambda s: s.family,
)
def test_dynamic_int8_shrinks_every_weight_and_keeps_predictions(spec: ArchSpec, tmp_path: Path):
    # The legacy exporter is ~20x faster; the dynamo export of an LSTM, whose weights the
    # quantizer could miss, is quantized in the real-data test below.
    # Prepare
    model = _model(spec)
    src = export_onnx(
        model, spec, tmp_path / "fp32.onnx", class_names=list("abcdefghij"), exporter="legacy"
    )
    x = example_input(spec, 64, torch.Generator().manual_seed(5))
    with torch.no_grad():
        labels = model(x).argmax(dim=1)  # fp32 scores 1.0 by construction

    # Execute
    report = quantize_dynamic_int8(src, tmp_path / "int8.onnx", eval_inputs=x, eval_labels=labels)

    # Assert
    assert report.fp32_accuracy == 1.0
    assert report.int8_accuracy is not None and report.int8_accuracy >= 0.8
    assert report.accuracy_delta == pytest.approx(report.int8_accuracy - report.fp32_accuracy)
    assert report.fp32_bytes == src.stat().st_size
    assert report.int8_bytes == (tmp_path / "int8.onnx").stat().st_size
    assert report.size_ratio < 1 / 3  # every weight matrix went to int8

    quantized = OnnxPredictor(tmp_path / "int8.onnx")
    assert quantized.spec == spec
    assert quantized.class_names == list("abcdefghij")
    assert quantized.quantization == "dynamic-int8"
    assert quantized.exporter == "legacy"
    assert quantized.predict(x).shape == (64,)

    no_eval = quantize_dynamic_int8(src, tmp_path / "again.onnx")
    assert no_eval.fp32_accuracy is None and no_eval.accuracy_delta is None
    with pytest.raises(ValueError, match="already quantized"):
        quantize_dynamic_int8(tmp_path / "int8.onnx", tmp_path / "twice.onnx")
    with pytest.raises(ValueError, match="both"):
        quantize_dynamic_int8(src, tmp_path / "x.onnx", eval_inputs=x)


def test_static_int8_writes_a_calibrated_qdq_graph(tmp_path: Path):
    # Prepare (legacy exporter: this test is about the quantizer, and it is 20x faster)
    spec = ArchSpec(family="lenet5", num_classes=10, input_shape=IMAGE)
    model = _model(spec)
    src = export_onnx(model, spec, tmp_path / "fp32.onnx", exporter="legacy")
    calibration = example_input(spec, 96, torch.Generator().manual_seed(1))
    x = example_input(spec, 64, torch.Generator().manual_seed(2))
    with torch.no_grad():
        labels = model(x).argmax(dim=1)

    # Execute
    report = quantize_static_int8(
        src, tmp_path / "static.onnx", calibration, eval_inputs=x, eval_labels=labels
    )

    # Assert: QDQ pairs around the convolutions, int8 weights with one scale per out channel.
    graph = onnx.load(str(tmp_path / "static.onnx"))
    ops = [n.op_type for n in graph.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops and "Conv" in ops
    inits = {i.name: i for i in graph.graph.initializer}
    int8_weights = [i for i in inits.values() if i.data_type == onnx.TensorProto.INT8]
    conv_weights = [i for i in int8_weights if len(i.dims) == 4]
    assert sorted(w.dims[0] for w in conv_weights) == [6, 16]  # LeNet-5's two convs
    dequantized = {n.input[0]: n for n in graph.graph.node if n.op_type == "DequantizeLinear"}
    for w in conv_weights:  # per channel: one scale per output channel
        assert list(inits[dequantized[w.name].input[1]].dims) == [w.dims[0]]
    float_params = [i for i in inits.values() if i.data_type == onnx.TensorProto.FLOAT]
    assert sum(int(np.prod(i.dims)) for i in float_params) < 1000  # scales and biases only
    props = {p.key: p.value for p in graph.metadata_props}
    assert props[META_QUANTIZATION] == "static-int8-qdq"
    assert OnnxPredictor(tmp_path / "static.onnx").spec == spec
    assert report.fp32_accuracy == 1.0
    assert report.int8_accuracy is not None and report.int8_accuracy >= 0.8
    assert report.size_ratio < 1 / 3


def test_static_int8_refuses_bad_calibration_and_writes_nothing(tmp_path: Path):
    spec = ArchSpec(family="cnn1", num_classes=10, input_shape=IMAGE)
    src = export_onnx(_model(spec), spec, tmp_path / "fp32.onnx", exporter="legacy")
    target = tmp_path / "static.onnx"
    with pytest.raises(
        ValueError, match=r"calibration_inputs must have shape \(n, \*\(1, 28, 28\)"
    ):
        quantize_static_int8(src, target, torch.zeros(8, 1, 32, 32))
    with pytest.raises(ValueError, match="calibration_inputs is empty"):
        quantize_static_int8(src, target, torch.zeros(0, 1, 28, 28))
    with pytest.raises(FileNotFoundError, match="export_onnx"):
        quantize_static_int8(tmp_path / "missing.onnx", target, torch.zeros(8, 1, 28, 28))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32.onnx"]


def _train_briefly(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """One pass of Adam (lr 5e-3) over (x, y) in batches of 64; a plain loop, not the SDK's."""
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    for start in range(0, len(y), 64):
        idx = order[start : start + 64]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("family", ["lenet5", "lstm"])
def test_onnx_predicts_like_pytorch_on_real_test_images(
    family: str, real_images: dict[str, Any], tmp_path: Path
):
    # Prepare: a model trained briefly on real training images, real held-out test images.
    x_train, y_train = real_images["x_train"][:2000], real_images["y_train"][:2000]
    x_test, y_test = real_images["x_test"][:1000], real_images["y_test"][:1000]
    spec = ArchSpec(family=family, num_classes=10, input_shape=tuple(x_train.shape[1:]))
    model = _train_briefly(build(spec, seed=0), x_train, y_train)
    with torch.no_grad():
        torch_pred = model(x_test).argmax(dim=1).numpy()
    torch_acc = float((torch_pred == y_test.numpy()).mean())
    assert torch_acc > 0.4, f"the model learnt too little on {real_images['name']} to compare"

    # Execute: the default export, then both int8 variants (static needs convolutions).
    fp32 = export_onnx(model, spec, tmp_path / "fp32.onnx")
    int8 = {"dynamic": quantize_dynamic_int8(fp32, tmp_path / "dynamic.onnx")}
    if family == "lenet5":
        int8["static"] = quantize_static_int8(fp32, tmp_path / "static.onnx", x_train[:256])

    # Assert: fp32 predicts exactly what PyTorch predicts on every image; int8 loses at most
    # one point of accuracy. Every weight matrix went to int8, the dynamo-exported LSTM's too
    # (the exporter must leave them as plain initializers for the quantizer to find).
    assert read_metadata(fp32).exporter == "dynamo"
    np.testing.assert_array_equal(_session_predictions(fp32, x_test), torch_pred)
    for kind, report in int8.items():
        assert report.size_ratio < 1 / 3, f"{kind} int8 is {report.size_ratio:.2f} of fp32"
        pred = _session_predictions(tmp_path / f"{kind}.onnx", x_test)
        acc = float((pred == y_test.numpy()).mean())
        assert acc >= torch_acc - 0.01, f"{kind} int8: {acc:.3f} vs PyTorch {torch_acc:.3f}"
        assert (pred == torch_pred).mean() > 0.9  # the same model, not merely as accurate
