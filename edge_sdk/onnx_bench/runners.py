"""The variants being timed: PyTorch eager and onnxruntime sessions behind one small interface.

`prepare` puts a batch where the runtime reads it (not timed); calling the runner runs one
forward pass on it (timed); `logits` is the plain numpy-in, numpy-out path (for accuracy).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from edge_sdk.onnx_format import INPUT_NAME, OUTPUT_NAME
from model_zoo.spec import ArchSpec

__all__ = ["OrtRunner", "Runner", "TorchRunner", "onnx_providers"]

_CUDA_EP = "CUDAExecutionProvider"
_CPU_EP = "CPUExecutionProvider"


def onnx_providers(device: str) -> list[str]:
    """onnxruntime providers for `device`: CUDA first when asked for and available."""
    if device == "cuda" and _CUDA_EP in ort.get_available_providers():
        return [_CUDA_EP, _CPU_EP]
    return [_CPU_EP]


class Runner(Protocol):
    """One variant: `prepare` puts a batch where the runtime reads it (untimed); a call runs one
    forward on it (timed); `logits` is the plain numpy-in, numpy-out path (accuracy)."""

    name: str
    provider: str

    def prepare(self, x: np.ndarray) -> Any: ...

    def __call__(self, prepared: Any, /) -> Any: ...

    def logits(self, x: np.ndarray) -> np.ndarray: ...


class TorchRunner:
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


class OrtRunner:
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
