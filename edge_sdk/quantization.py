"""Int8 quantization (and fp16 conversion) of an `export_onnx` file, with its size and accuracy
cost.

Two int8 ways, both onnxruntime's and both written atomically with the edgefl metadata carried
over:

* `quantize_dynamic_int8`: int8 weights, activations quantized at run time (MatMulInteger,
  ConvInteger, DynamicQuantizeLSTM). Needs no data; covers every family, the LSTM included.
* `quantize_static_int8`: QDQ format, weights per output channel, activation ranges calibrated
  (min/max) on sample inputs, so the graph runs int8 end to end where onnxruntime fuses the QDQ
  pairs into QLinearConv/QLinearMatMul. For the convolutional families; it has no LSTM kernel.

``edgefl.quantization`` in the metadata says which (``dynamic-int8`` / ``static-int8-qdq``).

`convert_fp16` halves the file instead: weights and activations in float16, inputs and outputs
kept float32 (``edgefl.quantization = "fp16"``). onnxruntime's CPU provider runs many fp16 ops by
casting back to float32, so it saves size and memory bandwidth, not CPU time; GPUs and NPUs run it
natively.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from edge_sdk.export import cpu_session
from edge_sdk.onnx_format import (
    INPUT_NAME,
    META_QUANTIZATION,
    OUTPUT_NAME,
    OnnxMetadata,
    metadata_from_props,
    set_metadata_props,
)
from model_zoo.files import atomic_path
from model_zoo.spec import input_dtype

__all__ = [
    "DEFAULT_QUANTIZED_OPS",
    "DYNAMIC_INT8",
    "FP16",
    "STATIC_INT8",
    "QuantizationReport",
    "convert_fp16",
    "quantize_dynamic_int8",
    "quantize_static_int8",
]

logger = logging.getLogger(__name__)

DYNAMIC_INT8 = "dynamic-int8"
STATIC_INT8 = "static-int8-qdq"
FP16 = "fp16"
# Op types whose dynamic int8 versions (MatMulInteger, ConvInteger, DynamicQuantizeLSTM) run on
# onnxruntime's CPU provider.
DEFAULT_QUANTIZED_OPS: tuple[str, ...] = ("MatMul", "Gemm", "Conv", "LSTM")
_CALIBRATION_BATCH = 64


@dataclass(frozen=True)
class QuantizationReport:
    """Outcome of a quantization; accuracies are None without evaluation data.

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


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextmanager
def _quiet_preprocessing_hint() -> Iterator[None]:
    # onnxruntime logs this on the root logger at every call, whether or not it applies.
    root = logging.getLogger()
    drop = _DropMessage("Please consider to run pre-processing before quantization")
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _model_inputs(meta: OnnxMetadata, inputs: Any, what: str) -> np.ndarray:
    """`inputs` as the dtype the graph takes, checked against the spec's input shape."""
    dtype = np.int64 if input_dtype(meta.spec) == torch.int64 else np.float32
    arr = _as_numpy(inputs).astype(dtype, copy=False)
    if tuple(arr.shape[1:]) != tuple(meta.spec.input_shape):
        raise ValueError(
            f"{what} must have shape (n, *{meta.spec.input_shape}) for {meta.spec}, "
            f"got {tuple(arr.shape)}"
        )
    if len(arr) == 0:
        raise ValueError(f"{what} is empty: pass at least one sample")
    return np.ascontiguousarray(arr)


def _accuracy(session: ort.InferenceSession, inputs: np.ndarray, labels: np.ndarray) -> float:
    correct = 0
    for start in range(0, len(inputs), 256):
        (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: inputs[start : start + 256]})
        correct += int((logits.argmax(axis=1) == labels[start : start + 256]).sum())
    return correct / len(inputs)


def _load_fp32(src: Path) -> tuple[onnx.ModelProto, dict[str, str], OnnxMetadata]:
    if not src.is_file():
        raise FileNotFoundError(f"no ONNX file at {src}; export one with export_onnx first")
    proto = onnx.load(os.fspath(src))
    props = {p.key: p.value for p in proto.metadata_props}
    meta = metadata_from_props(props, source=str(src))
    if meta.quantization is not None:
        raise ValueError(f"{src} is already quantized ({meta.quantization}); pass the fp32 file")
    return proto, props, meta


def _quantize(
    src: Path,
    dst: Path,
    kind: str,
    run: Callable[[onnx.ModelProto, OnnxMetadata, Path], None],
    eval_inputs: Any,
    eval_labels: Any,
) -> QuantizationReport:
    """Shared frame: load and check `src`, `run` the quantizer into a temp file, stamp the
    metadata, move it to `dst`, then score both files on the evaluation data if given."""
    if (eval_inputs is None) != (eval_labels is None):
        raise ValueError("pass both eval_inputs and eval_labels, or neither")
    proto, props, meta = _load_fp32(src)
    if eval_inputs is not None:  # check before any work is done
        inputs = _model_inputs(meta, eval_inputs, "eval_inputs")
        labels = _as_numpy(eval_labels).astype(np.int64, copy=False).reshape(-1)
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} eval_inputs but {len(labels)} eval_labels")
    with atomic_path(dst) as tmp, _quiet_preprocessing_hint():
        run(proto, meta, tmp)
        quantized = onnx.load(os.fspath(tmp))
        set_metadata_props(quantized, {**props, META_QUANTIZATION: kind})
        onnx.save(quantized, os.fspath(tmp))

    fp32_bytes, int8_bytes = src.stat().st_size, dst.stat().st_size
    fp32_acc = int8_acc = delta = None
    if eval_inputs is not None:
        fp32_acc = _accuracy(cpu_session(src), inputs, labels)
        int8_acc = _accuracy(cpu_session(dst), inputs, labels)
        delta = int8_acc - fp32_acc
    report = QuantizationReport(fp32_bytes, int8_bytes, fp32_acc, int8_acc, delta)
    logger.info("quantized %s -> %s (%s): %s", src, dst, kind, report)
    return report


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

    def run(proto: onnx.ModelProto, meta: OnnxMetadata, tmp: Path) -> None:
        quantize_dynamic(
            proto, tmp, op_types_to_quantize=list(op_types), weight_type=QuantType.QInt8
        )

    return _quantize(Path(src), Path(dst), DYNAMIC_INT8, run, eval_inputs, eval_labels)


def convert_fp16(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    eval_inputs: torch.Tensor | np.ndarray | None = None,
    eval_labels: torch.Tensor | np.ndarray | Sequence[int] | None = None,
) -> QuantizationReport:
    """Convert `src` (an `export_onnx` file) to float16 weights and activations, keeping float32
    inputs and outputs, and write `dst` atomically (``edgefl.quantization = "fp16"``). The
    report's `int8_*` fields describe the fp16 file."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    def run(proto: onnx.ModelProto, meta: OnnxMetadata, tmp: Path) -> None:
        onnx.save(convert_float_to_float16(proto, keep_io_types=True), os.fspath(tmp))

    return _quantize(Path(src), Path(dst), FP16, run, eval_inputs, eval_labels)


class _Batches(CalibrationDataReader):
    """Feeds calibration samples to onnxruntime's calibrator in fixed-size batches."""

    def __init__(self, inputs: np.ndarray, batch: int):
        self._batches = iter([inputs[i : i + batch] for i in range(0, len(inputs), batch)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch}


def quantize_static_int8(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    calibration_inputs: torch.Tensor | np.ndarray,
    *,
    eval_inputs: torch.Tensor | np.ndarray | None = None,
    eval_labels: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    per_channel: bool = True,
    reduce_range: bool = True,
) -> QuantizationReport:
    """Static int8 quantization of `src` in QDQ format, calibrated on `calibration_inputs`.

    `calibration_inputs` (n, *input_shape) should be a few hundred representative training
    samples, preprocessed exactly as at inference (normalised images). The graph is first
    pre-processed (symbolic shape inference and onnxruntime's basic graph optimisations, as
    onnxruntime recommends), then weights are quantized to QInt8 (per output channel with
    `per_channel`) and activations to QUInt8 with min/max ranges from the calibration run.
    Metadata as in `quantize_dynamic_int8`, with ``edgefl.quantization = "static-int8-qdq"``.

    `reduce_range` keeps weights to 7 bits. On x86 CPUs without VNNI, onnxruntime's uint8 x int8
    kernels can saturate their 16-bit intermediate sums; measured on such a CPU (AVX2), a VGG-13
    trained on Fashion-MNIST lost 1.39 points with 8-bit weights and none with 7-bit ones
    (docs/benchmarks/onnx-inference.md). The file is the same size either way.
    """
    src = Path(src)
    _, _, meta = _load_fp32(src)
    calibration = _model_inputs(meta, calibration_inputs, "calibration_inputs")

    def run(proto: onnx.ModelProto, meta: OnnxMetadata, tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="edgefl-quant-") as work:
            prepared = Path(work) / "prepared.onnx"
            quant_pre_process(proto, prepared)
            quantize_static(
                prepared,
                tmp,
                _Batches(calibration, _CALIBRATION_BATCH),
                quant_format=QuantFormat.QDQ,
                per_channel=per_channel,
                reduce_range=reduce_range,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
            )

    return _quantize(src, Path(dst), STATIC_INT8, run, eval_inputs, eval_labels)
