"""Inference benchmark: PyTorch eager against onnxruntime (fp32, int8 dynamic, int8 static).

`benchmark_onnx` measures already-exported edgefl ONNX files (and, optionally, the PyTorch model
they came from) side by side on labelled evaluation data:

* latency at batch 1: p50 and p99 over every timed call, in milliseconds;
* throughput at batch 64, in samples per second (median over rounds);
* size: the file's bytes, or for PyTorch the bytes of its safetensors state_dict (what the SDK
  sends over the wire);
* accuracy on the evaluation data, its difference to PyTorch's, and the fraction of samples on
  which the variant predicts the same class as PyTorch.

Side by side means: every variant is warmed up first (warm-up calls are not timed), then timed in
`rounds` rounds, each round timing every variant in turn (the order rotates from round to round),
so a noisy machine slows all variants alike. Thread counts are fixed: PyTorch's intra-op threads
and onnxruntime's intra-op threads are both `threads` (inter-op: 1, sequential execution).

A timed call is one forward pass on a batch already where the runtime reads it, on the device:
PyTorch eager on a ready tensor (under `torch.inference_mode`, synchronised on CUDA),
onnxruntime through IO binding with pre-bound input and output buffers (its lowest-overhead
call). Moving numpy data in and out is not timed for either; `benchmarks/onnx_session_overhead.py`
shows what it and onnxruntime's other ways of calling cost for the smallest models.
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from edge_sdk.export import INPUT_NAME, OUTPUT_NAME, read_metadata
from edge_sdk.quantization import DYNAMIC_INT8, STATIC_INT8
from model_zoo.spec import ArchSpec, input_dtype

__all__ = [
    "THROUGHPUT_BATCH",
    "VARIANTS",
    "BenchRow",
    "BenchSettings",
    "benchmark_onnx",
    "family_label",
    "format_rows",
    "machine_info",
    "onnx_providers",
    "torch_threads",
    "variant_of",
]

VARIANTS = ("torch", "ort_fp32", "ort_int8_dynamic", "ort_int8_static")
THROUGHPUT_BATCH = 64
_VARIANT_OF_QUANTIZATION = {
    None: "ort_fp32",
    DYNAMIC_INT8: "ort_int8_dynamic",
    STATIC_INT8: "ort_int8_static",
}
_CUDA_EP = "CUDAExecutionProvider"
_CPU_EP = "CPUExecutionProvider"


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


def onnx_providers(device: str) -> list[str]:
    """onnxruntime providers for `device`: CUDA first when asked for and available."""
    if device == "cuda" and _CUDA_EP in ort.get_available_providers():
        return [_CUDA_EP, _CPU_EP]
    return [_CPU_EP]


# --------------------------------------------------------------------------------------------
# the things being timed


class _Runner(Protocol):
    """One variant: `prepare` puts a batch where the runtime reads it (untimed); a call runs one
    forward on it (timed); `logits` is the plain numpy-in, numpy-out path (accuracy)."""

    name: str
    provider: str

    def prepare(self, x: np.ndarray) -> Any: ...

    def __call__(self, prepared: Any, /) -> Any: ...

    def logits(self, x: np.ndarray) -> np.ndarray: ...


class _TorchRunner:
    name = "torch"

    def __init__(self, model: nn.Module, device: torch.device):
        # A copy in the standard layout: the caller's model keeps its device and mode.
        self.model = copy.deepcopy(model).to(device).to(memory_format=torch.contiguous_format)
        self.model.eval()
        self.device = device
        self.provider = f"torch:{device.type}"

    def prepare(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def __call__(self, x: torch.Tensor) -> Any:
        out = self.model(x)  # the caller holds torch.inference_mode() around the timed loop
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def logits(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.model(self.prepare(x)).float().cpu().numpy()


class _OrtRunner:
    """An onnxruntime session; timed calls go through IO binding with pre-bound buffers."""

    def __init__(
        self, name: str, path: Path, spec: ArchSpec, threads: int, providers: Sequence[str]
    ):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # no per-node placement warnings on CUDA
        self.session = ort.InferenceSession(
            os.fspath(path), sess_options=options, providers=list(providers)
        )
        self.name = name
        self.provider = self.session.get_providers()[0]
        self._device = "cuda" if self.provider == _CUDA_EP else "cpu"
        self._classes = spec.num_classes

    def prepare(self, x: np.ndarray) -> tuple[ort.IOBinding, ort.OrtValue, ort.OrtValue]:
        # Input and output buffers live on the session's device and stay bound: a call is the
        # forward pass alone, as for PyTorch on a ready tensor. (Passing a RunOptions to
        # run_with_iobinding would add ~40 us a call in onnxruntime 1.32: none is passed.)
        binding = self.session.io_binding()
        value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x), self._device, 0)
        out = ort.OrtValue.ortvalue_from_shape_and_type(
            (len(x), self._classes), np.float32, self._device, 0
        )
        binding.bind_ortvalue_input(INPUT_NAME, value)
        binding.bind_ortvalue_output(OUTPUT_NAME, out)
        return binding, value, out  # the values must outlive the binding

    def __call__(self, prepared: tuple[ort.IOBinding, ort.OrtValue, ort.OrtValue]) -> Any:
        self.session.run_with_iobinding(prepared[0])
        return prepared[2]

    def logits(self, x: np.ndarray) -> np.ndarray:
        (out,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(x)})
        return np.asarray(out)


# --------------------------------------------------------------------------------------------
# measuring


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
    runners: Sequence[_Runner], x1: np.ndarray, x64: np.ndarray, settings: BenchSettings
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


def _predictions(runner: _Runner, x: np.ndarray, batch: int) -> np.ndarray:
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

    runners: list[_Runner] = []
    if model is not None:
        runners.append(_TorchRunner(model, device))
    for p, m in zip(paths, metas, strict=True):
        runners.append(_OrtRunner(variant_of(m.quantization), p, spec, settings.threads, providers))
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


# --------------------------------------------------------------------------------------------
# reporting


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


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(settings: BenchSettings) -> dict[str, Any]:
    """CPU, thread counts, providers, GPU and versions: what the numbers depend on."""
    info: dict[str, Any] = {
        "cpu": _cpu_name(),
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
