"""Timing and scoring of runners side by side: `benchmark_onnx` and its settings and rows."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from edge_sdk.onnx_bench.runners import OrtRunner, Runner, TorchRunner, onnx_providers
from edge_sdk.onnx_format import read_metadata
from edge_sdk.quantization import DYNAMIC_INT8, FP16, STATIC_INT8
from model_zoo.spec import ArchSpec, input_dtype

__all__ = [
    "THROUGHPUT_BATCH",
    "VARIANTS",
    "BenchRow",
    "BenchSettings",
    "benchmark_onnx",
    "family_label",
    "torch_threads",
    "variant_of",
]

VARIANTS = ("torch", "ort_fp32", "ort_int8_dynamic", "ort_int8_static")
THROUGHPUT_BATCH = 64
_VARIANT_OF_QUANTIZATION = {
    None: "ort_fp32",
    FP16: "ort_fp16",  # `edgefl export --format fp16`
    DYNAMIC_INT8: "ort_int8_dynamic",
    STATIC_INT8: "ort_int8_static",
}


@dataclass(frozen=True)
class BenchSettings:
    """How much to measure, on what. `quick()` is the seconds-long version for reports/tests."""

    threads: int = 1
    device: str = "cpu"  # "cpu" or "cuda": PyTorch's device and onnxruntime's provider
    warmup: int = 30  # untimed calls per variant at batch 1 (and warmup // 10 + 1 at batch 64)
    rounds: int = 5
    latency_calls: int = 100  # timed batch-1 calls per variant per round
    throughput_batches: int = 3  # timed batch-64 calls per variant per round
    eval_batch: int = 256  # batch size of the accuracy pass (not timed)

    def __post_init__(self) -> None:
        for name in ("threads", "rounds", "latency_calls", "throughput_batches", "eval_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @classmethod
    def quick(cls, **changes: Any) -> BenchSettings:
        """Few repetitions: enough to see orders of magnitude in seconds, not for a report."""
        return replace(cls(), warmup=5, rounds=2, latency_calls=20, throughput_batches=1).with_(
            **changes
        )

    def with_(self, **changes: Any) -> BenchSettings:
        return replace(self, **changes)


@dataclass(frozen=True)
class BenchRow:
    """One variant of one model, measured. Latencies in ms, throughput in samples/s."""

    family: str
    variant: str
    spec: str
    exporter: str | None
    provider: str
    device: str
    threads: int
    latency_p50_ms_b1: float
    latency_p99_ms_b1: float
    latency_calls_b1: int
    throughput_b64: float
    size_bytes: int
    accuracy: float | None
    accuracy_delta: float | None  # accuracy minus PyTorch's (None without a PyTorch model)
    agreement_with_torch: float | None  # fraction of samples predicted as PyTorch predicts
    eval_samples: int
    latency_ratio_vs_torch: float | None = None  # p50 / PyTorch's p50
    path: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def family_label(spec: ArchSpec) -> str:
    """The family name, with ``-char`` for the character-level LSTM."""
    return f"{spec.family}-char" if spec.kwargs.get("mode") == "char" else spec.family


def variant_of(quantization: str | None) -> str:
    """The benchmark variant name of a file with this ``edgefl.quantization`` value."""
    try:
        return _VARIANT_OF_QUANTIZATION[quantization]
    except KeyError:
        raise ValueError(f"unknown quantization {quantization!r} in the file's metadata") from None


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """PyTorch's intra-op thread count set to `n` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Timing:
    latencies_ns: list[int] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)


def _time_variants(
    runners: Sequence[Runner], x1: np.ndarray, x64: np.ndarray, settings: BenchSettings
) -> dict[str, _Timing]:
    prepared = [(r, r.prepare(x1), r.prepare(x64)) for r in runners]
    timings = {r.name: _Timing() for r in runners}
    clock = time.perf_counter_ns
    for r, p1, p64 in prepared:  # warm-up, not timed
        for _ in range(settings.warmup):
            r(p1)
        for _ in range(settings.warmup // 10 + 1):
            r(p64)
    for round_ in range(settings.rounds):
        shift = round_ % len(prepared)
        for r, p1, p64 in prepared[shift:] + prepared[:shift]:
            t = timings[r.name]
            for _ in range(settings.latency_calls):
                start = clock()
                r(p1)
                t.latencies_ns.append(clock() - start)
            start = clock()
            for _ in range(settings.throughput_batches):
                r(p64)
            seconds = (clock() - start) / 1e9
            t.throughputs.append(settings.throughput_batches * len(x64) / seconds)
    return timings


def _predictions(runner: Runner, x: np.ndarray, batch: int) -> np.ndarray:
    return np.concatenate(
        [runner.logits(x[i : i + batch]).argmax(axis=1) for i in range(0, len(x), batch)]
    )


def _torch_size(model: nn.Module) -> int:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return len(safetensors_bytes(state))


def _eval_arrays(spec: ArchSpec, inputs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    def arr(v: Any) -> np.ndarray:
        return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)

    dtype = np.int64 if input_dtype(spec) == torch.int64 else np.float32
    x = np.ascontiguousarray(arr(inputs).astype(dtype, copy=False))
    y = arr(labels).astype(np.int64, copy=False).reshape(-1)
    if tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(
            f"eval_inputs must have shape (n, *{spec.input_shape}) for {spec}, got {x.shape}"
        )
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"need as many eval_labels as eval_inputs (> 0), got {len(x)}, {len(y)}")
    return x, y


def _timing_batches(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A batch of 1 and a batch of 64 real samples (repeated when there are fewer than 64)."""
    reps = -(-THROUGHPUT_BATCH // len(x))
    x64 = np.ascontiguousarray(np.concatenate([x] * reps)[:THROUGHPUT_BATCH])
    return np.ascontiguousarray(x[:1]), x64


def benchmark_onnx(
    onnx_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    eval_inputs: torch.Tensor | np.ndarray,
    eval_labels: torch.Tensor | np.ndarray | Sequence[int],
    *,
    model: nn.Module | None = None,
    settings: BenchSettings | None = None,
) -> list[BenchRow]:
    """Benchmark exported edgefl ONNX files of one model side by side (see the module docs).

    `onnx_files`: one or more files written by `export_onnx` / `edge_sdk.quantization` for the
    same ArchSpec (fp32 and any int8 copies); each becomes a row whose variant is read from its
    metadata. `eval_inputs` (n, *input_shape), preprocessed as the model expects (normalised
    images, token ids), and `eval_labels` (n,) give the accuracy. With `model` (the PyTorch
    network the files came from) a ``torch`` row comes first and every row gets
    `accuracy_delta`, `agreement_with_torch` and `latency_ratio_vs_torch`.
    """
    settings = settings or BenchSettings()
    paths = (
        [Path(onnx_files)]
        if isinstance(onnx_files, str | os.PathLike)
        else list(map(Path, onnx_files))
    )
    if not paths:
        raise ValueError("pass at least one ONNX file")
    metas = [read_metadata(p) for p in paths]  # FileNotFoundError / OnnxMetadataError
    spec = metas[0].spec
    for p, m in zip(paths, metas, strict=True):
        if m.spec != spec:
            raise ValueError(f"{p} holds {m.spec}, but {paths[0]} holds {spec}: one model at once")
    x, y = _eval_arrays(spec, eval_inputs, eval_labels)
    device = torch.device(settings.device)
    providers = onnx_providers(settings.device)

    runners: list[Runner] = []
    if model is not None:
        runners.append(TorchRunner(model, device))
    for p, m in zip(paths, metas, strict=True):
        runners.append(OrtRunner(variant_of(m.quantization), p, spec, settings.threads, providers))
    names = [r.name for r in runners]
    if len(set(names)) != len(names):
        raise ValueError(f"two files of the same variant: {names}; pass one of each")

    with torch_threads(settings.threads):
        predictions = {r.name: _predictions(r, x, settings.eval_batch) for r in runners}
        with torch.inference_mode():  # once, outside the timed calls
            timings = _time_variants(runners, *_timing_batches(x), settings)

    reference = predictions.get("torch")
    torch_acc = float((reference == y).mean()) if reference is not None else None
    torch_p50 = (
        float(np.percentile(timings["torch"].latencies_ns, 50)) if "torch" in timings else None
    )
    sizes: dict[str, int] = {r.name: 0 for r in runners}
    if model is not None:
        sizes["torch"] = _torch_size(model)
    for p, m in zip(paths, metas, strict=True):
        sizes[variant_of(m.quantization)] = p.stat().st_size
    files = {variant_of(m.quantization): (p, m) for p, m in zip(paths, metas, strict=True)}

    rows = []
    for r in runners:
        t = timings[r.name]
        p50 = float(np.percentile(t.latencies_ns, 50))
        acc = float((predictions[r.name] == y).mean())
        path_meta = files.get(r.name)
        rows.append(
            BenchRow(
                family=family_label(spec),
                variant=r.name,
                spec=str(spec),
                exporter=path_meta[1].exporter if path_meta else None,
                provider=r.provider,
                device=settings.device,
                threads=settings.threads,
                latency_p50_ms_b1=round(p50 / 1e6, 4),
                latency_p99_ms_b1=round(float(np.percentile(t.latencies_ns, 99)) / 1e6, 4),
                latency_calls_b1=len(t.latencies_ns),
                throughput_b64=round(statistics.median(t.throughputs), 1),
                size_bytes=sizes[r.name],
                accuracy=round(acc, 6),
                accuracy_delta=None if torch_acc is None else round(acc - torch_acc, 6),
                agreement_with_torch=(
                    None
                    if reference is None
                    else round(float((predictions[r.name] == reference).mean()), 6)
                ),
                eval_samples=len(y),
                latency_ratio_vs_torch=None if torch_p50 is None else round(p50 / torch_p50, 4),
                path=str(path_meta[0]) if path_meta else None,
            )
        )
    return rows
