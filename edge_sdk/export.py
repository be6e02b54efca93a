"""Export a zoo model to a self-describing ONNX file, verify it, and quantize it for devices.

`export_onnx` writes a single .onnx file that carries everything a device application needs
besides the runtime: the `ArchSpec`, the class names and the input normalisation live in the
file's metadata_props (keys `edgefl.*`, read back by `read_metadata` and by
`edge_sdk.inference.OnnxPredictor`). The file is exported with the legacy TorchScript exporter
(`dynamo=False`, which handles LSTMs with a dynamic batch axis), written atomically, and checked
against PyTorch with onnxruntime before it replaces anything at the destination.

`quantize_dynamic_int8` applies onnxruntime's dynamic int8 weight quantization and reports the
size and, given labelled data, the accuracy cost.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic
from torch import nn

from model_zoo.models import example_input
from model_zoo.spec import ArchSpec, input_dtype

__all__ = [
    "DEFAULT_QUANTIZED_OPS",
    "FORMAT_VERSION",
    "INPUT_NAME",
    "META_ARCH_SPEC",
    "META_CLASS_NAMES",
    "META_FORMAT_VERSION",
    "META_NORMALIZATION",
    "META_QUANTIZATION",
    "OUTPUT_NAME",
    "OnnxMetadata",
    "OnnxMetadataError",
    "OnnxVerificationError",
    "QuantizationReport",
    "export_onnx",
    "metadata_from_props",
    "quantize_dynamic_int8",
    "read_metadata",
    "verify_onnx",
]

logger = logging.getLogger(__name__)
_EXPORT_LOCK = threading.Lock()

FORMAT_VERSION = "1"
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
META_ARCH_SPEC = "edgefl.arch_spec"
META_CLASS_NAMES = "edgefl.class_names"
META_NORMALIZATION = "edgefl.normalization"
META_FORMAT_VERSION = "edgefl.format_version"
META_QUANTIZATION = "edgefl.quantization"

# Op types whose dynamic int8 versions (MatMulInteger, ConvInteger, DynamicQuantizeLSTM) run on
# onnxruntime's CPU provider.
DEFAULT_QUANTIZED_OPS: tuple[str, ...] = ("MatMul", "Gemm", "Conv", "LSTM")


class OnnxVerificationError(RuntimeError):
    """The exported graph's logits differ from PyTorch's by more than the tolerance."""

    def __init__(self, message: str, *, max_abs_diff: float, atol: float):
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.atol = atol


class OnnxMetadataError(ValueError):
    """An ONNX file lacks the edgefl metadata, or carries a version this code cannot read."""


@dataclass(frozen=True)
class OnnxMetadata:
    """What `export_onnx` stores in an ONNX file besides the graph."""

    spec: ArchSpec
    class_names: list[str]
    normalization: dict[str, list[float]] | None
    quantization: str | None = None


@dataclass(frozen=True)
class QuantizationReport:
    """Outcome of `quantize_dynamic_int8`; accuracies are None without evaluation data.

    `accuracy_delta` is int8 minus fp32 accuracy (negative when quantization costs accuracy).
    """

    fp32_bytes: int
    int8_bytes: int
    fp32_accuracy: float | None
    int8_accuracy: float | None
    accuracy_delta: float | None

    @property
    def size_ratio(self) -> float:
        """int8 size as a fraction of the fp32 size."""
        return self.int8_bytes / self.fp32_bytes


# --------------------------------------------------------------------------------------------
# metadata


def _check_class_names(spec: ArchSpec, class_names: Sequence[str] | None) -> list[str]:
    if class_names is None:
        return [str(i) for i in range(spec.num_classes)]
    names = list(class_names)
    if len(names) != spec.num_classes or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"class_names must be {spec.num_classes} strings (spec.num_classes), "
            f"got {len(names)} items: {names[:5]!r}..."
        )
    return names


def _check_normalization(
    spec: ArchSpec, normalization: Mapping[str, Sequence[float]] | None
) -> dict[str, list[float]] | None:
    if normalization is None:
        return None
    if set(normalization) != {"mean", "std"}:
        raise ValueError(
            f"normalization must be a mapping with exactly the keys 'mean' and 'std', "
            f"got keys {sorted(normalization)}"
        )
    if input_dtype(spec) != torch.float32:
        raise ValueError(f"normalization makes no sense for the integer inputs of {spec}")
    mean = [float(v) for v in normalization["mean"]]
    std = [float(v) for v in normalization["std"]]
    channels = spec.input_shape[0] if len(spec.input_shape) == 3 else 1
    allowed = {1, channels}
    if len(mean) != len(std) or len(mean) not in allowed:
        raise ValueError(
            f"normalization mean and std need one value per channel ({channels}) or a single "
            f"value for input_shape {spec.input_shape}; got {len(mean)} means, {len(std)} stds"
        )
    if not all(math.isfinite(v) for v in mean) or not all(math.isfinite(s) and s > 0 for s in std):
        raise ValueError(f"normalization needs finite means and positive stds, got {mean}, {std}")
    return {"mean": mean, "std": std}


def metadata_from_props(props: Mapping[str, str], *, source: str = "model") -> OnnxMetadata:
    """Parse the `edgefl.*` metadata_props of an ONNX model (a key -> value mapping)."""
    if META_ARCH_SPEC not in props:
        raise OnnxMetadataError(
            f"{source} has no {META_ARCH_SPEC!r} metadata: it was not written by "
            "edge_sdk.export.export_onnx; re-export it from its ArchSpec and weights"
        )
    version = props.get(META_FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise OnnxMetadataError(
            f"{source} has edgefl format version {version!r}; this SDK reads version "
            f"{FORMAT_VERSION!r}: re-export it with this SDK"
        )
    try:
        spec = ArchSpec.from_json(props[META_ARCH_SPEC])
        class_names = json.loads(props.get(META_CLASS_NAMES, "null"))
        normalization = json.loads(props.get(META_NORMALIZATION, "null"))
    except ValueError as exc:
        raise OnnxMetadataError(f"{source} has malformed edgefl metadata: {exc}") from exc
    if class_names is None:
        class_names = [str(i) for i in range(spec.num_classes)]
    return OnnxMetadata(
        spec=spec,
        class_names=list(class_names),
        normalization=normalization,
        quantization=props.get(META_QUANTIZATION),
    )


def read_metadata(path: str | os.PathLike[str]) -> OnnxMetadata:
    """Read the edgefl metadata of an ONNX file without loading its weights."""
    proto = onnx.load(os.fspath(path), load_external_data=False)
    return metadata_from_props({p.key: p.value for p in proto.metadata_props}, source=str(path))


def _set_props(proto: onnx.ModelProto, props: Mapping[str, str]) -> None:
    kept = {p.key: p.value for p in proto.metadata_props if p.key not in props}
    onnx.helper.set_model_props(proto, {**kept, **props})


# --------------------------------------------------------------------------------------------
# export and verification


@contextmanager
def _atomic_target(path: Path) -> Iterator[Path]:
    """A temporary file next to `path` that replaces it on success and is removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    # mkstemp creates the file 0600; give the result the usual permissions of a data file.
    os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with suppress(FileNotFoundError):
            tmp.unlink()


def _eval_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to("cpu").eval()


def _cpu_session(path: str | os.PathLike[str]) -> ort.InferenceSession:
    return ort.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])


def _compare_logits(expected: np.ndarray, got: np.ndarray, atol: float, *, context: str) -> float:
    """Max abs difference of two logit arrays; raise `OnnxVerificationError` above `atol`."""
    if expected.shape != got.shape:
        raise OnnxVerificationError(
            f"{context}: ONNX logits have shape {got.shape}, PyTorch logits {expected.shape}",
            max_abs_diff=math.inf,
            atol=atol,
        )
    diff = np.abs(expected.astype(np.float64) - got.astype(np.float64))
    diff[np.isnan(expected) & np.isnan(got)] = 0.0
    max_diff = float(np.max(diff, initial=0.0)) if not np.isnan(diff).any() else math.inf
    if max_diff > atol:
        raise OnnxVerificationError(
            f"{context}: ONNX and PyTorch logits differ by up to {max_diff:.3g} "
            f"(atol {atol:g}); the graph does not reproduce the model (a data-dependent "
            "branch or an op the exporter mistranslates)",
            max_abs_diff=max_diff,
            atol=atol,
        )
    return max_diff


def _reference_inputs(spec: ArchSpec, sample_inputs: torch.Tensor | None) -> list[torch.Tensor]:
    if sample_inputs is not None:
        sample = torch.as_tensor(sample_inputs)
        if tuple(sample.shape[1:]) != tuple(spec.input_shape):
            raise ValueError(
                f"sample_inputs must have shape (batch, *{spec.input_shape}), "
                f"got {tuple(sample.shape)}"
            )
        return [sample.to(device="cpu", dtype=input_dtype(spec))]
    generator = torch.Generator().manual_seed(0)
    return [example_input(spec, b, generator) for b in (1, 7)]


def _verify(
    path: Path,
    cpu_model: nn.Module,
    spec: ArchSpec,
    sample_inputs: torch.Tensor | None,
    atol: float,
) -> float:
    session = _cpu_session(path)
    worst = 0.0
    for x in _reference_inputs(spec, sample_inputs):
        with torch.no_grad():
            expected = cpu_model(x).numpy()
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})
        context = f"{spec} at batch {x.shape[0]}"
        worst = max(worst, _compare_logits(expected, got, atol, context=context))
    return worst


def verify_onnx(
    path: str | os.PathLike[str],
    model: nn.Module,
    spec: ArchSpec,
    *,
    sample_inputs: torch.Tensor | None = None,
    atol: float = 1e-4,
) -> float:
    """Run the ONNX file (onnxruntime, CPU) and `model` (eval mode, CPU) on the same inputs.

    Inputs are `sample_inputs` (batch, *input_shape) or, by default, `example_input` batches of 1
    and 7. Returns the largest absolute logit difference; raises `OnnxVerificationError` when
    it exceeds `atol`. The caller's model is not modified (a copy is evaluated).
    """
    return _verify(Path(path), _eval_copy(model), spec, sample_inputs, atol)


def export_onnx(
    model: nn.Module,
    spec: ArchSpec,
    path: str | os.PathLike[str],
    *,
    class_names: Sequence[str] | None = None,
    normalization: Mapping[str, Sequence[float]] | None = None,
    opset: int = 17,
    atol: float = 1e-4,
    verify: bool = True,
    sample_inputs: torch.Tensor | None = None,
) -> Path:
    """Export `model` (built from `spec`) to `path` as ONNX with a dynamic batch axis.

    The graph has one input ``input`` (batch, *spec.input_shape) and one output ``logits``
    (batch, num_classes). Metadata: the spec, `class_names` (default "0".."n-1") and
    `normalization` ({"mean": [...], "std": [...]}, one value per channel or one in all). A
    copy of the model is exported in eval mode on CPU; the caller's model is left as it was.
    With `verify`, onnxruntime must reproduce PyTorch's logits within `atol` (see
    `verify_onnx`) before the file is moved into place; otherwise `OnnxVerificationError`.
    """
    path = Path(path)
    names = _check_class_names(spec, class_names)
    norm = _check_normalization(spec, normalization)
    cpu_model = _eval_copy(model)

    dummy = example_input(spec, 2, torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            out = cpu_model(dummy)
    except RuntimeError as exc:
        raise ValueError(f"model does not accept inputs of {spec}: {exc}") from exc
    if tuple(out.shape) != (2, spec.num_classes):
        raise ValueError(
            f"model returns shape {tuple(out.shape)} for a batch of 2, expected "
            f"(2, {spec.num_classes}) from {spec}: model and spec do not match"
        )

    with _atomic_target(path) as tmp:
        # torch's exporter keeps global state (and catch_warnings is process-wide): one export
        # at a time, so clients exporting from their own threads do not collide.
        with _EXPORT_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                cpu_model,
                (dummy,),
                os.fspath(tmp),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        proto = onnx.load(os.fspath(tmp))
        _set_props(
            proto,
            {
                META_ARCH_SPEC: spec.to_json(),
                META_CLASS_NAMES: json.dumps(names),
                META_NORMALIZATION: json.dumps(norm),
                META_FORMAT_VERSION: FORMAT_VERSION,
            },
        )
        onnx.checker.check_model(proto)
        onnx.save(proto, os.fspath(tmp))
        if verify:
            diff = _verify(tmp, cpu_model, spec, sample_inputs, atol)
            logger.debug("verified %s: max abs logit diff %.3g", spec, diff)
    logger.info("exported %s to %s (%d bytes)", spec, path, path.stat().st_size)
    return path


# --------------------------------------------------------------------------------------------
# quantization


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _accuracy(session: ort.InferenceSession, inputs: np.ndarray, labels: np.ndarray) -> float:
    correct = 0
    for start in range(0, len(inputs), 256):
        (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: inputs[start : start + 256]})
        correct += int((logits.argmax(axis=1) == labels[start : start + 256]).sum())
    return correct / len(inputs)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def quantize_dynamic_int8(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    eval_inputs: torch.Tensor | np.ndarray | None = None,
    eval_labels: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    op_types: Sequence[str] = DEFAULT_QUANTIZED_OPS,
) -> QuantizationReport:
    """Quantize the weights of `src` (an `export_onnx` file) to int8 and write `dst` atomically.

    Uses onnxruntime's dynamic quantization (QInt8 weights, activations quantized at run time)
    on the `op_types` listed; the edgefl metadata is carried over, plus
    ``edgefl.quantization = "dynamic-int8"``. With `eval_inputs` (batch, *input_shape) and
    `eval_labels` (batch,), both models are scored and the accuracy delta is reported.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"no ONNX file at {src}; export one with export_onnx first")
    if (eval_inputs is None) != (eval_labels is None):
        raise ValueError("pass both eval_inputs and eval_labels, or neither")
    proto = onnx.load(os.fspath(src))
    props = {p.key: p.value for p in proto.metadata_props}
    meta = metadata_from_props(props, source=str(src))
    if meta.quantization is not None:
        raise ValueError(f"{src} is already quantized ({meta.quantization}); pass the fp32 file")

    with _atomic_target(dst) as tmp:
        root = logging.getLogger()
        drop = _DropMessage("Please consider to run pre-processing before quantization")
        root.addFilter(drop)
        try:
            quantize_dynamic(
                proto,
                tmp,
                op_types_to_quantize=list(op_types),
                weight_type=QuantType.QInt8,
            )
        finally:
            root.removeFilter(drop)
        quantized = onnx.load(os.fspath(tmp))
        _set_props(quantized, {**props, META_QUANTIZATION: "dynamic-int8"})
        onnx.save(quantized, os.fspath(tmp))

    fp32_bytes, int8_bytes = src.stat().st_size, dst.stat().st_size
    fp32_acc = int8_acc = delta = None
    if eval_inputs is not None and eval_labels is not None:
        dtype = np.int64 if input_dtype(meta.spec) == torch.int64 else np.float32
        inputs = _as_numpy(eval_inputs).astype(dtype, copy=False)
        labels = _as_numpy(eval_labels).astype(np.int64, copy=False).reshape(-1)
        if tuple(inputs.shape[1:]) != tuple(meta.spec.input_shape) or len(inputs) != len(labels):
            raise ValueError(
                f"eval_inputs must be (n, *{meta.spec.input_shape}) with n == len(eval_labels); "
                f"got inputs {inputs.shape} and {len(labels)} labels"
            )
        if len(labels) == 0:
            raise ValueError("eval_inputs is empty: pass at least one labelled sample")
        fp32_acc = _accuracy(_cpu_session(src), inputs, labels)
        int8_acc = _accuracy(_cpu_session(dst), inputs, labels)
        delta = int8_acc - fp32_acc
    report = QuantizationReport(fp32_bytes, int8_bytes, fp32_acc, int8_acc, delta)
    logger.info("quantized %s -> %s: %s", src, dst, report)
    return report
