"""Export a zoo model to a self-describing ONNX file and verify it against PyTorch.

`export_onnx` writes a single .onnx file that carries everything a device application needs
besides the runtime: the `ArchSpec`, the class names, the input normalisation and the exporter
that produced the graph live in the file's metadata_props (keys `edgefl.*`, read back by
`read_metadata` and by `edge_sdk.inference.OnnxPredictor`). The file is written atomically and
checked against PyTorch with onnxruntime before it replaces anything at the destination.

Two exporters: torch's `torch.export`-based one (``dynamo=True``, the default since torch 2.9;
the TorchScript one is deprecated in torch 2.14) and the legacy TorchScript exporter
(``dynamo=False``). ``exporter="auto"`` uses the first and falls back to the second when it fails
or does not verify; the metadata key ``edgefl.exporter`` says which one wrote the file.

Int8 quantization of the exported file lives in `edge_sdk.quantization`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

# The file format's names are re-exported here, where users have always imported them from.
from edge_sdk.onnx_format import (
    FORMAT_VERSION,
    INPUT_NAME,
    META_ARCH_SPEC,
    META_CLASS_NAMES,
    META_EXPORTER,
    META_EXPORTER_FALLBACK,
    META_FORMAT_VERSION,
    META_NORMALIZATION,
    META_QUANTIZATION,
    OUTPUT_NAME,
    OnnxMetadata,
    OnnxMetadataError,
    check_class_names,
    check_normalization,
    metadata_from_props,
    read_metadata,
    set_metadata_props,
)
from model_zoo.files import atomic_path
from model_zoo.models import example_input
from model_zoo.spec import ArchSpec, input_dtype

__all__ = [
    "DEFAULT_OPSET",
    "EXPORTERS",
    "FORMAT_VERSION",
    "INPUT_NAME",
    "META_ARCH_SPEC",
    "META_CLASS_NAMES",
    "META_EXPORTER",
    "META_EXPORTER_FALLBACK",
    "META_FORMAT_VERSION",
    "META_NORMALIZATION",
    "META_QUANTIZATION",
    "OUTPUT_NAME",
    "Exporter",
    "OnnxMetadata",
    "OnnxMetadataError",
    "OnnxVerificationError",
    "export_onnx",
    "metadata_from_props",
    "read_metadata",
    "verify_onnx",
]

logger = logging.getLogger(__name__)
_EXPORT_LOCK = threading.Lock()

Exporter = Literal["auto", "dynamo", "legacy"]
EXPORTERS: tuple[str, ...] = ("auto", "dynamo", "legacy")
# The dynamo exporter's operator library starts at opset 18; asking for less makes it convert
# the graph down, which fails for some of the zoo's graphs.
DEFAULT_OPSET = 18


class OnnxVerificationError(RuntimeError):
    """The exported graph's logits differ from PyTorch's by more than the tolerance."""

    def __init__(self, message: str, *, max_abs_diff: float, atol: float):
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.atol = atol


# --------------------------------------------------------------------------------------------
# verification


def _eval_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to("cpu").eval()


def cpu_session(path: str | os.PathLike[str]) -> ort.InferenceSession:
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
    session = cpu_session(path)
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


# --------------------------------------------------------------------------------------------
# export


def _dynamo_graph(model: nn.Module, dummy: torch.Tensor, opset: int) -> onnx.ModelProto:
    import onnxscript.optimizer  # the dynamo exporter's own dependency

    program = torch.onnx.export(
        model,
        (dummy,),
        None,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        opset_version=opset,
        dynamo=True,
        optimize=False,
        verbose=False,  # else it prints its progress on stdout
    )
    if program is None:  # only None when torch falls back to TorchScript itself
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNX program")
    # Fold every constant subgraph, however large: the exporter computes the LSTM's gate-reordered
    # weights at run time otherwise (Slice/Concat of the initializers), which both costs time
    # and hides the weights from int8 quantization. The default limits skip tensors > 8192.
    folded: onnx.ModelProto = onnxscript.optimizer.optimize(
        program.model_proto, input_size_limit=1 << 62, output_size_limit=1 << 62
    )
    # Drop the exporter's debugging annotations: per-node stack traces (with this machine's
    # file paths), FX node dumps and the ExportedProgram signature. They are up to a third of a
    # small model's file and mean nothing on a device.
    del folded.graph.metadata_props[:]
    for node in folded.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    # Drop the intermediate shape annotations too: onnxruntime and its quantizer infer their
    # own. With torch 2.11's exporter (onnxscript 0.7.2 as here) one was left naming a linear
    # layer's weight with its dimensions swapped after folding, and the quantizer's strict
    # shape inference refused the file ("Inferred shape and existing shape differ").
    del folded.graph.value_info[:]
    return folded


def _legacy_graph(model: nn.Module, dummy: torch.Tensor, opset: int, tmp: Path) -> onnx.ModelProto:
    torch.onnx.export(
        model,
        (dummy,),
        os.fspath(tmp),
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        opset_version=opset,
        do_constant_folding=True,
        dynamo=False,
    )
    return onnx.load(os.fspath(tmp))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _failure_reason(exc: BaseException, limit: int = 300) -> str:
    """One line naming `exc` and its root cause (torch wraps the real error in its own)."""
    root = exc
    seen = {id(root)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        root = nxt

    def line(e: BaseException) -> str:
        text = _ANSI.sub("", str(e)).strip()
        first = text.splitlines()[0] if text else ""
        return f"{type(e).__name__}: {first}" if first else type(e).__name__

    reason = line(exc) if root is exc else f"{line(exc)} (caused by {line(root)})"
    return reason[:limit]


def _write_graph(
    tmp: Path,
    which: str,
    cpu_model: nn.Module,
    dummy: torch.Tensor,
    opset: int,
    props: Mapping[str, str],
) -> None:
    """Export with one exporter (`dynamo` or `legacy`) and write the checked graph to `tmp`."""
    # torch's exporters keep global state (and catch_warnings is process-wide): one export at
    # a time, so clients exporting from their own threads do not collide.
    with _EXPORT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if which == "dynamo":
            proto = _dynamo_graph(cpu_model, dummy, opset)
        else:
            proto = _legacy_graph(cpu_model, dummy, opset, tmp)
    set_metadata_props(proto, {**props, META_EXPORTER: which})
    onnx.checker.check_model(proto)
    onnx.save(proto, os.fspath(tmp))


def export_onnx(
    model: nn.Module,
    spec: ArchSpec,
    path: str | os.PathLike[str],
    *,
    class_names: Sequence[str] | None = None,
    normalization: Mapping[str, Sequence[float]] | None = None,
    exporter: Exporter = "auto",
    opset: int = DEFAULT_OPSET,
    atol: float = 1e-4,
    verify: bool = True,
    sample_inputs: torch.Tensor | None = None,
) -> Path:
    """Export `model` (built from `spec`) to `path` as ONNX with a dynamic batch axis.

    The graph has one input ``input`` (batch, *spec.input_shape) and one output ``logits``
    (batch, num_classes). Metadata: the spec, `class_names` (default "0".."n-1"),
    `normalization` ({"mean": [...], "std": [...]}, one value per channel or one in all) and
    the exporter used. A copy of the model is exported in eval mode on CPU; the caller's model
    is left as it was. With `verify`, onnxruntime must reproduce PyTorch's logits within `atol`
    (see `verify_onnx`) before the file is moved into place; otherwise `OnnxVerificationError`.

    `exporter`: ``"dynamo"`` (torch.export-based), ``"legacy"`` (TorchScript, deprecated in
    torch 2.14) or ``"auto"``: dynamo, falling back to legacy when the dynamo exporter raises or
    its graph fails verification; the fallback is logged as a warning and recorded in the
    metadata (``edgefl.exporter = "legacy"``, the reason under ``edgefl.exporter_fallback``).
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    path = Path(path)
    names = check_class_names(spec, class_names)
    norm = check_normalization(spec, normalization)
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
    props = {
        META_ARCH_SPEC: spec.to_json(),
        META_CLASS_NAMES: json.dumps(names),
        META_NORMALIZATION: json.dumps(norm),
        META_FORMAT_VERSION: FORMAT_VERSION,
    }

    def write(tmp: Path, which: str, extra: Mapping[str, str]) -> None:
        _write_graph(tmp, which, cpu_model, dummy, opset, {**props, **extra})
        if verify:
            diff = _verify(tmp, cpu_model, spec, sample_inputs, atol)
            logger.debug("verified %s (%s exporter): max abs logit diff %.3g", spec, which, diff)

    with atomic_path(path) as tmp:
        if exporter != "auto":
            write(tmp, exporter, {})
        else:
            try:
                write(tmp, "dynamo", {})
            except Exception as exc:  # any failure of the new exporter: fall back to the old one
                reason = _failure_reason(exc)
                logger.warning(
                    "dynamo exporter failed for %s (%s); falling back to the legacy exporter",
                    spec,
                    reason,
                )
                write(tmp, "legacy", {META_EXPORTER_FALLBACK: reason})
    logger.info("exported %s to %s (%d bytes)", spec, path, path.stat().st_size)
    return path
