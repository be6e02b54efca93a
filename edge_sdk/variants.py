"""A personalized model as ONNX in the formats a device may want, each checked against PyTorch.

`export_variants(model, spec, path, formats, ...)` writes the fp32 file (`export_onnx`, verified)
and, from it, any of `fp16`, `int8-dynamic` and `int8-static` (static int8 calibrated on the
inputs you pass: the client's own training data). Then every file runs in onnxruntime on the
evaluation inputs next to the PyTorch model, and the report says, per format: the file's size,
how often its prediction (argmax) agrees with PyTorch's, the largest |logit difference|, and the
accuracy when labels are given.

Files: `PATH` (fp32), and `PATH` with `.fp16`, `.int8-dynamic` or `.int8-static` before `.onnx`.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from edge_sdk.export import Exporter, cpu_session, export_onnx, verify_onnx
from edge_sdk.onnx_format import INPUT_NAME, OUTPUT_NAME
from edge_sdk.quantization import convert_fp16, quantize_dynamic_int8, quantize_static_int8
from model_zoo.spec import ArchSpec, input_dtype

__all__ = [
    "FORMATS",
    "VariantReport",
    "export_variants",
    "format_variant_table",
    "unsupported",
    "variant_path",
]

log = logging.getLogger(__name__)

FORMATS: Final[tuple[str, ...]] = ("fp32", "fp16", "int8-dynamic", "int8-static")
_BATCH = 256

_CONVERT: Final[dict[str, Callable[..., Any]]] = {
    "fp16": convert_fp16,
    "int8-dynamic": quantize_dynamic_int8,
}


@dataclass(frozen=True)
class VariantReport:
    """One ONNX file of the model against PyTorch on the evaluation inputs."""

    format: str
    path: Path
    size_bytes: int
    samples: int  # evaluation inputs compared
    agreement: float  # share of them whose argmax equals PyTorch's
    max_abs_diff: float  # largest |ONNX logit - PyTorch logit|
    accuracy: float | None  # on the evaluation labels (None without labels)
    torch_accuracy: float | None  # PyTorch's own, on the same labels

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"path": str(self.path)}


def variant_path(path: str | os.PathLike[str], fmt: str) -> Path:
    """Where `export_variants` writes format `fmt` of the fp32 file `path`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown ONNX format {fmt!r}; known: {', '.join(FORMATS)}")
    path = Path(path)
    return path if fmt == "fp32" else path.with_name(f"{path.stem}.{fmt}{path.suffix}")


def _logits(run: Callable[[torch.Tensor], np.ndarray], x: torch.Tensor) -> np.ndarray:
    return np.concatenate([run(x[i : i + _BATCH]) for i in range(0, len(x), _BATCH)])


def _onnx_runner(path: Path) -> Callable[[torch.Tensor], np.ndarray]:
    session = cpu_session(path)
    return lambda b: session.run([OUTPUT_NAME], {INPUT_NAME: b.numpy()})[0]


def unsupported(model: nn.Module, fmt: str) -> str | None:
    """Why `model` cannot be written in format `fmt`, or None when it can."""
    if fmt == "int8-static" and any(isinstance(m, nn.LSTM) for m in model.modules()):
        return "onnxruntime has no static int8 LSTM kernel; use int8-dynamic for this model"
    return None


def export_variants(
    model: nn.Module,
    spec: ArchSpec,
    path: str | os.PathLike[str],
    formats: Sequence[str],
    *,
    eval_inputs: torch.Tensor,
    eval_labels: torch.Tensor | None = None,
    calibration_inputs: torch.Tensor | None = None,
    class_names: Sequence[str] | None = None,
    normalization: Mapping[str, Sequence[float]] | None = None,
    exporter: Exporter = "auto",
    keep_fp32: bool = False,
) -> list[VariantReport]:
    """Write `model` to `path` (fp32) and in every other format of `formats`; compare each
    file with PyTorch on `eval_inputs` (model inputs, preprocessed as in training).

    `int8-static` needs `calibration_inputs` (a few hundred training inputs). The fp32 file is
    always written and reported first: the others are made from it. An unknown format, or one
    the model cannot take (`unsupported`: static int8 for an LSTM, which onnxruntime has no
    kernel for; `int8-dynamic` quantizes LSTMs), raises `ValueError` before anything is written.
    `exporter`: the torch exporter of the fp32 file (`export_onnx`'s). `keep_fp32`: an fp32 file
    already at `path` is kept, not exported again, where onnxruntime runs it to `model`'s
    logits within `export_onnx`'s tolerance (the file a run wrote of this model as it ended:
    an export costs seconds); any other file there is replaced.
    """
    wanted = ["fp32", *[f for f in FORMATS[1:] if f in formats]]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(
            f"unknown ONNX format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}"
        )
    for fmt in wanted:
        if (why := unsupported(model, fmt)) is not None:
            raise ValueError(f"{fmt} for {spec}: {why}")
    if "int8-static" in wanted and (calibration_inputs is None or len(calibration_inputs) == 0):
        raise ValueError("int8-static needs calibration inputs (the client's training data)")
    x = torch.as_tensor(eval_inputs).detach().to("cpu", input_dtype(spec))
    if len(x) == 0:
        raise ValueError("no evaluation inputs to compare the ONNX files with PyTorch on")
    reference = copy.deepcopy(model).to("cpu").eval()
    with torch.no_grad():
        expected = _logits(lambda b: reference(b).numpy(), x)
    labels = None if eval_labels is None else torch.as_tensor(eval_labels).cpu().numpy()

    fp32 = Path(path)
    if not (keep_fp32 and _holds(fp32, model, spec, x[:8])):
        fp32 = export_onnx(
            model,
            spec,
            path,
            class_names=class_names,
            normalization=normalization,
            exporter=exporter,
            sample_inputs=x[:8],
        )
    reports = []
    for fmt in wanted:
        target = variant_path(fp32, fmt)
        if fmt == "int8-static":
            assert calibration_inputs is not None
            quantize_static_int8(fp32, target, calibration_inputs)
        elif fmt != "fp32":
            _CONVERT[fmt](fp32, target)
        got = _logits(_onnx_runner(target), x)
        diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
        agree = float(np.mean(got.argmax(axis=1) == expected.argmax(axis=1)))
        reports.append(
            VariantReport(
                format=fmt,
                path=target,
                size_bytes=target.stat().st_size,
                samples=len(x),
                agreement=agree,
                max_abs_diff=float(diff.max()) if not np.isnan(diff).any() else float("inf"),
                accuracy=None if labels is None else float(np.mean(got.argmax(1) == labels)),
                torch_accuracy=(
                    None if labels is None else float(np.mean(expected.argmax(1) == labels))
                ),
            )
        )
        log.info("%s: %s", target, reports[-1])
    return reports


def _holds(path: Path, model: nn.Module, spec: ArchSpec, inputs: torch.Tensor) -> bool:
    """Whether `path` is an ONNX file of `model`: onnxruntime reproduces its logits on `inputs`
    within `export_onnx`'s tolerance."""
    if not path.is_file():
        return False
    try:
        verify_onnx(path, model, spec, sample_inputs=inputs)
    except Exception as exc:  # another model's file, or no ONNX at all: written again
        log.info("%s is not this model's ONNX file (%s): exporting it again", path, exc)
        return False
    log.info("%s already holds this model (onnxruntime reproduces it): kept", path)
    return True


def format_variant_table(reports: Sequence[VariantReport]) -> str:
    """The reports as a text table: format, size, accuracy (ONNX and PyTorch), agreement, |Δ|."""

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:.2f}%"

    rows = [("format", "size KiB", "accuracy", "torch acc", "same argmax", "max |Δ logit|", "file")]
    for r in reports:
        rows.append(
            (
                r.format,
                f"{r.size_bytes / 1024:.1f}",
                pct(r.accuracy),
                pct(r.torch_accuracy),
                pct(r.agreement),
                f"{r.max_abs_diff:.2e}",
                str(r.path),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
