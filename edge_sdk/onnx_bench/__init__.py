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

from edge_sdk.onnx_bench.measure import (
    THROUGHPUT_BATCH,
    VARIANTS,
    BenchRow,
    BenchSettings,
    benchmark_onnx,
    family_label,
    torch_threads,
    variant_of,
)
from edge_sdk.onnx_bench.report import format_rows, machine_info
from edge_sdk.onnx_bench.runners import onnx_providers

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
