"""What the numbers depend on (`machine_info`) and a plain-text table of rows (`format_rows`)."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnxruntime as ort
import torch

from edge_sdk.host import cpu_name
from edge_sdk.onnx_bench.measure import BenchRow, BenchSettings
from edge_sdk.onnx_bench.runners import onnx_providers

__all__ = ["format_rows", "machine_info"]


def _versions() -> dict[str, str]:
    import onnx

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
    }
    with contextlib.suppress(ImportError):
        import onnxscript

        found["onnxscript"] = onnxscript.__version__
    return found


def machine_info(settings: BenchSettings) -> dict[str, Any]:
    """CPU, thread counts, providers, GPU and versions: what the numbers depend on."""
    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "device": settings.device,
        "torch_threads": settings.threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "ort_intra_op_threads": settings.threads,
        "ort_inter_op_threads": 1,
        "ort_providers_available": ort.get_available_providers(),
        "ort_providers_used": onnx_providers(settings.device),
        "cuda_available": torch.cuda.is_available(),
        "versions": _versions(),
    }
    if settings.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    if hasattr(os, "getloadavg"):  # other jobs on a shared machine skew absolute numbers
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for n, row in enumerate([header, *rows]):
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _opt(value: float | None, fmt: Callable[[float], str]) -> str:
    return "—" if value is None else fmt(value)


def format_rows(rows: Sequence[BenchRow | Mapping[str, Any]]) -> str:
    """A plain-text table of benchmark rows (objects or their dicts)."""
    header = (
        "family",
        "variant",
        "p50 ms",
        "p99 ms",
        "x torch",
        "b64/s",
        "size KB",
        "acc %",
        "Δacc pts",
        "same pred",
        "exporter",
        "provider",
    )
    body = []
    for row in rows:
        r = row.to_dict() if isinstance(row, BenchRow) else dict(row)
        body.append(
            (
                r["family"],
                r["variant"],
                f"{r['latency_p50_ms_b1']:.3f}",
                f"{r['latency_p99_ms_b1']:.3f}",
                _opt(r.get("latency_ratio_vs_torch"), lambda v: f"{v:.2f}"),
                f"{r['throughput_b64']:.0f}",
                f"{r['size_bytes'] / 1024:.1f}",
                _opt(r.get("accuracy"), lambda v: f"{100 * v:.2f}"),
                _opt(r.get("accuracy_delta"), lambda v: f"{100 * v:+.2f}"),
                _opt(r.get("agreement_with_torch"), lambda v: f"{100 * v:.2f}%"),
                r.get("exporter") or "—",
                str(r["provider"]).replace("ExecutionProvider", ""),
            )
        )
    return _table(header, body)
