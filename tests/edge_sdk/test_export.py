"""ONNX export (both exporters), verification, metadata and the on-device predictor."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from tests_helpers import CHAR_SPEC, IMAGE
from tests_helpers import ZOO_SPECS as SPECS
from tests_helpers import spec_id as _ids
from torch import nn

from edge_sdk.export import (
    META_ARCH_SPEC,
    META_CLASS_NAMES,
    META_EXPORTER,
    META_EXPORTER_FALLBACK,
    META_FORMAT_VERSION,
    META_NORMALIZATION,
    OnnxMetadataError,
    OnnxVerificationError,
    _compare_logits,
    export_onnx,
    read_metadata,
    verify_onnx,
)
from edge_sdk.inference import OnnxPredictor
from model_zoo.models import example_input
from model_zoo.spec import ArchSpec, build

# Tests about metadata, verification and the predictor use the legacy exporter: they do not
# depend on which exporter wrote the graph, and it takes ~0.1 s against the dynamo exporter's
# ~2 s. Both exporters are tested on every family below.
FAST = "legacy"


def _model(spec: ArchSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build(spec).eval()


def _torch_proba(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(model(x), dim=1).numpy()


@pytest.mark.parametrize(
    ("exporter", "expected"), [("auto", "dynamo"), ("legacy", "legacy")], ids=["auto", "legacy"]
)
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_every_family_exports_and_predicts_like_pytorch(
    spec: ArchSpec, exporter: str, expected: str, tmp_path: Path
):
    # Prepare
    model = _model(spec)

    # Execute
    path = export_onnx(model, spec, tmp_path / "model.onnx", exporter=exporter)

    # Assert: the default ("auto") keeps the dynamo graph for every family, the LSTMs included:
    # it verified at batch 1 and 7 (a fallback would record "legacy").
    assert path == tmp_path / "model.onnx" and path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]  # no temp files left
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert props[META_EXPORTER] == expected and META_EXPORTER_FALLBACK not in props

    predictor = OnnxPredictor(path, providers=["CPUExecutionProvider"])
    assert predictor.spec == spec and predictor.exporter == expected
    assert predictor.input_shape == spec.input_shape
    g = torch.Generator().manual_seed(3)
    for batch in (1, 9):  # the batch axis is dynamic
        x = example_input(spec, batch, g)
        expected_proba = _torch_proba(model, x)
        proba = predictor.predict_proba(x)
        assert proba.shape == (batch, spec.num_classes)
        np.testing.assert_allclose(proba, expected_proba, atol=1e-4)
        np.testing.assert_array_equal(predictor.predict(x.numpy()), expected_proba.argmax(axis=1))


class _RefusesTorchExport(nn.Module):
    """A model that torch.export cannot capture but the TorchScript tracer can."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            raise RuntimeError("this model refuses torch.export")
        return self.inner(x)


def test_auto_exporter_falls_back_to_legacy_and_records_why(tmp_path: Path, caplog):
    # Prepare
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=IMAGE)
    model = _model(spec)

    # Execute
    path = export_onnx(_RefusesTorchExport(model), spec, tmp_path / "m.onnx")

    # Assert
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert props[META_EXPORTER] == "legacy"
    assert "this model refuses torch.export" in props[META_EXPORTER_FALLBACK]
    assert read_metadata(path).exporter == "legacy"
    assert "falling back to the legacy exporter" in caplog.text
    x = example_input(spec, 4)
    np.testing.assert_allclose(
        OnnxPredictor(path).predict_proba(x), _torch_proba(model, x), atol=1e-4
    )
    # Asked for by name, the dynamo exporter does not fall back: its failure is the caller's.
    with pytest.raises(Exception, match=r"torch\.export"):
        export_onnx(_RefusesTorchExport(model), spec, tmp_path / "d.onnx", exporter="dynamo")
    assert not (tmp_path / "d.onnx").exists()
    with pytest.raises(ValueError, match="exporter must be one of auto, dynamo, legacy"):
        export_onnx(model, spec, tmp_path / "x.onnx", exporter="torchscript")  # type: ignore[arg-type]


def test_a_stale_shape_annotation_from_the_optimizer_does_not_reach_the_file(tmp_path, monkeypatch):
    # Prepare: an optimizer that leaves an annotation naming the linear layer's weight with its
    # dimensions swapped, as exports with torch 2.11 did
    import onnxscript.optimizer

    from edge_sdk.quantization import quantize_dynamic_int8

    optimize = onnxscript.optimizer.optimize

    def stale(proto, **kwargs):
        folded = optimize(proto, **kwargs)
        weight = next(t for t in folded.graph.initializer if len(t.dims) == 2)
        folded.graph.value_info.append(
            onnx.helper.make_tensor_value_info(weight.name, weight.data_type, weight.dims[::-1])
        )
        return folded

    monkeypatch.setattr(onnxscript.optimizer, "optimize", stale)
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=IMAGE)

    # Execute
    path = export_onnx(_model(spec), spec, tmp_path / "m.onnx", exporter="dynamo")
    quantize_dynamic_int8(path, tmp_path / "m.int8.onnx")

    # Assert: the file passes strict shape inference, as onnxruntime's quantizer demands
    onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    assert (tmp_path / "m.int8.onnx").is_file()


def test_export_leaves_callers_model_alone(tmp_path: Path):
    spec = ArchSpec(family="vgg11", num_classes=10, input_shape=IMAGE, kwargs={"width": 0.125})
    model = _model(spec).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_onnx(model, spec, tmp_path / "vgg.onnx", exporter=FAST)
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_metadata_round_trip_and_normalize(tmp_path: Path):
    spec = ArchSpec(family="lenet5", num_classes=3, input_shape=(3, 28, 28))
    model = _model(spec)
    names = ["cat", "dog", "bird"]
    norm = {"mean": [0.5, 0.4, 0.3], "std": [0.25, 0.2, 0.3]}
    path = export_onnx(
        model, spec, tmp_path / "m.onnx", class_names=names, normalization=norm, exporter=FAST
    )

    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert ArchSpec.from_json(props[META_ARCH_SPEC]) == spec
    assert json.loads(props[META_CLASS_NAMES]) == names
    assert json.loads(props[META_NORMALIZATION]) == norm
    assert props[META_FORMAT_VERSION] == "1"
    assert props[META_EXPORTER] == "legacy"

    meta = read_metadata(path)
    assert (meta.spec, meta.class_names, meta.normalization) == (spec, names, norm)
    predictor = OnnxPredictor(path)
    assert predictor.class_names == names
    assert predictor.normalization == norm
    assert predictor.quantization is None

    raw = torch.rand(4, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    mean = torch.tensor(norm["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(norm["std"]).view(1, 3, 1, 1)
    expected = _torch_proba(model, (raw - mean) / std)
    np.testing.assert_allclose(predictor.predict_proba(raw, normalize=True), expected, atol=1e-4)
    # A single sample without the batch axis is promoted to a batch of one.
    np.testing.assert_allclose(
        predictor.predict_proba(raw[0], normalize=True), expected[:1], atol=1e-4
    )


def test_defaults_and_bad_metadata_arguments(tmp_path: Path):
    spec = ArchSpec(family="mlr", num_classes=4, input_shape=(1, 28, 28))
    path = export_onnx(_model(spec), spec, tmp_path / "m.onnx", exporter=FAST)
    predictor = OnnxPredictor(path)
    assert predictor.class_names == ["0", "1", "2", "3"]
    assert predictor.normalization is None
    with pytest.raises(ValueError, match="normalization"):
        predictor.predict(np.zeros((1, 28, 28), np.float32), normalize=True)
    with pytest.raises(ValueError, match="class_names"):
        export_onnx(_model(spec), spec, tmp_path / "x.onnx", class_names=["a", "b"])
    with pytest.raises(ValueError, match="per channel"):
        export_onnx(
            _model(spec),
            spec,
            tmp_path / "x.onnx",
            normalization={"mean": [0.1, 0.2], "std": [1.0, 1.0]},
        )
    with pytest.raises(ValueError, match="positive stds"):
        export_onnx(
            _model(spec), spec, tmp_path / "x.onnx", normalization={"mean": [0.1], "std": [0.0]}
        )
    other = ArchSpec(family="mlr", num_classes=5, input_shape=(1, 28, 28))
    with pytest.raises(ValueError, match="do not match"):
        export_onnx(_model(spec), other, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def test_compare_helper_raises_on_perturbed_output():
    logits = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    assert _compare_logits(logits, logits.copy(), 1e-4, context="same") == 0.0
    perturbed = logits.copy()
    perturbed[2, 3] += 1e-2
    with pytest.raises(OnnxVerificationError, match=r"up to 0\.01") as info:
        _compare_logits(logits, perturbed, 1e-4, context="perturbed")
    assert info.value.max_abs_diff == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(OnnxVerificationError, match="shape"):
        _compare_logits(logits, logits[:2], 1e-4, context="shape")


def test_verify_against_a_different_model_raises(tmp_path: Path):
    spec = ArchSpec(family="cnn1", num_classes=10, input_shape=IMAGE)
    path = export_onnx(_model(spec, seed=0), spec, tmp_path / "a.onnx", exporter=FAST)
    assert verify_onnx(path, _model(spec, seed=0), spec) <= 1e-4
    with pytest.raises(OnnxVerificationError, match="differ by up to"):
        verify_onnx(path, _model(spec, seed=1), spec)
    sample = example_input(spec, 3)
    with pytest.raises(OnnxVerificationError):
        verify_onnx(path, _model(spec, seed=1), spec, sample_inputs=sample)


class _Drifting(nn.Module):
    """Adds a call counter to its logits: the trace freezes one value, eager calls move on."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x) + float(self.calls)


def test_failed_verification_writes_nothing(tmp_path: Path):
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=IMAGE)
    target = tmp_path / "drift.onnx"
    with pytest.raises(OnnxVerificationError):
        export_onnx(_Drifting(_model(spec)), spec, target, exporter=FAST)
    assert list(tmp_path.iterdir()) == []
    # Without verification the (wrong) graph is written: verification is what catches it.
    export_onnx(_Drifting(_model(spec)), spec, target, verify=False, exporter=FAST)
    assert target.is_file()


def test_predict_input_checks(tmp_path: Path):
    spec = ArchSpec(family="cnn1", num_classes=10, input_shape=IMAGE)
    predictor = OnnxPredictor(export_onnx(_model(spec), spec, tmp_path / "m.onnx", exporter=FAST))
    with pytest.raises(ValueError, match=r"expected input of shape \(batch, 1, 28, 28\).*got"):
        predictor.predict(np.zeros((2, 1, 32, 32), np.float32))
    with pytest.raises(ValueError, match="got"):
        predictor.predict(np.zeros((784,), np.float32))
    # float64 and uint8 inputs are cast; a lone sample is promoted
    assert predictor.predict(np.zeros((1, 28, 28))).shape == (1,)
    assert predictor.logits(np.zeros((3, 1, 28, 28), np.uint8)).shape == (3, 10)

    char = OnnxPredictor(
        export_onnx(_model(CHAR_SPEC), CHAR_SPEC, tmp_path / "c.onnx", exporter=FAST)
    )
    with pytest.raises(ValueError, match="integer token ids"):
        char.predict(np.zeros((2, 12), np.float32))
    with pytest.raises(ValueError, match="normalize"):
        char.predict(np.zeros((2, 12), np.int64), normalize=True)
    assert char.predict(torch.zeros(12, dtype=torch.int32)).shape == (1,)


def test_predictor_refuses_foreign_onnx(tmp_path: Path):
    path = tmp_path / "plain.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            nn.Linear(4, 2),
            (torch.zeros(1, 4),),
            str(path),
            input_names=["input"],
            output_names=["logits"],
            dynamo=False,
        )
    with pytest.raises(OnnxMetadataError, match="export_onnx"):
        OnnxPredictor(path)
    with pytest.raises(FileNotFoundError):
        OnnxPredictor(tmp_path / "missing.onnx")
