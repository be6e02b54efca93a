"""On-device inference from a single ONNX file written by `edge_sdk.export.export_onnx`.

`OnnxPredictor` needs nothing but the .onnx file: the architecture spec, the class names and the
input normalisation are read from the file's metadata. It runs on onnxruntime with the CUDA
execution provider when the installed onnxruntime offers it, else on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from edge_sdk.onnx_format import INPUT_NAME, OUTPUT_NAME, OnnxMetadata, metadata_from_props
from model_zoo.spec import ArchSpec

__all__ = ["OnnxPredictor", "default_providers", "softmax"]

_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime build offers it, CPU always as the fallback."""
    return [_CUDA, _CPU] if _CUDA in ort.get_available_providers() else [_CPU]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


class OnnxPredictor:
    """Class probabilities and ids from an edgefl ONNX file.

    Batches are numpy arrays or torch tensors of shape (batch, *input_shape); a single sample of
    shape `input_shape` is promoted to a batch of one. With ``normalize=True`` raw inputs (images
    scaled to [0, 1]) are standardised per channel with the mean/std stored at export.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        providers: Sequence[str] | None = None,
        session_options: ort.SessionOptions | None = None,
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no ONNX file at {self.path}")
        self._session = ort.InferenceSession(
            os.fspath(self.path),
            sess_options=session_options,
            providers=list(providers) if providers is not None else default_providers(),
        )
        props = self._session.get_modelmeta().custom_metadata_map
        self._meta: OnnxMetadata = metadata_from_props(props, source=str(self.path))
        inputs = self._session.get_inputs()
        if [i.name for i in inputs] != [INPUT_NAME]:
            raise ValueError(
                f"{self.path} has inputs {[i.name for i in inputs]}, expected [{INPUT_NAME!r}]"
            )
        self._int_input = inputs[0].type == "tensor(int64)"

    # ----------------------------------------------------------------------------- metadata

    @property
    def spec(self) -> ArchSpec:
        return self._meta.spec

    @property
    def class_names(self) -> list[str]:
        return list(self._meta.class_names)

    @property
    def normalization(self) -> dict[str, list[float]] | None:
        """{"mean": [...], "std": [...]} from the metadata, or None when none was stored."""
        norm = self._meta.normalization
        return None if norm is None else {k: list(v) for k, v in norm.items()}

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample (no batch axis)."""
        return tuple(self._meta.spec.input_shape)

    @property
    def quantization(self) -> str | None:
        """ "dynamic-int8" or "static-int8-qdq" for a file from `edge_sdk.quantization`, else
        None (fp32)."""
        return self._meta.quantization

    @property
    def exporter(self) -> str | None:
        """ "dynamo" or "legacy": the torch exporter that wrote the graph (None if unrecorded)."""
        return self._meta.exporter

    @property
    def providers(self) -> list[str]:
        """Execution providers the session actually uses, in priority order."""
        return self._session.get_providers()

    # ----------------------------------------------------------------------------- inference

    def _prepare(self, batch: Any, normalize: bool) -> np.ndarray:
        arr = batch.detach().cpu().numpy() if isinstance(batch, torch.Tensor) else np.asarray(batch)
        shape = self.input_shape
        if tuple(arr.shape) == shape:
            arr = arr[np.newaxis]
        elif tuple(arr.shape[1:]) != shape:
            raise ValueError(
                f"expected input of shape (batch, {', '.join(map(str, shape))}) or {shape} "
                f"for {self.spec}, got {tuple(arr.shape)}"
            )
        if self._int_input:
            if arr.dtype.kind not in "iu":
                raise ValueError(f"{self.spec} expects integer token ids, got dtype {arr.dtype}")
            if normalize:
                raise ValueError("normalize=True does not apply to integer token-id inputs")
            return arr.astype(np.int64, copy=False)
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"{self.spec} expects numeric inputs, got dtype {arr.dtype}")
        arr = arr.astype(np.float32, copy=False)
        if normalize:
            arr = self._normalize(arr)
        return arr

    def _normalize(self, arr: np.ndarray) -> np.ndarray:
        norm = self._meta.normalization
        if norm is None:
            raise ValueError(
                f"{self.path} stores no normalization; call with normalize=False or re-export "
                "with export_onnx(..., normalization={'mean': [...], 'std': [...]})"
            )
        mean = np.asarray(norm["mean"], dtype=np.float32)
        std = np.asarray(norm["std"], dtype=np.float32)
        if len(self.input_shape) == 3:  # per channel on (B, C, H, W)
            mean, std = mean.reshape(1, -1, 1, 1), std.reshape(1, -1, 1, 1)
        return (arr - mean) / std

    def logits(self, batch: Any, normalize: bool = False) -> np.ndarray:
        """Raw logits, shape (batch, num_classes)."""
        x = self._prepare(batch, normalize)
        (out,) = self._session.run([OUTPUT_NAME], {INPUT_NAME: x})
        return out

    def predict_proba(self, batch: Any, *, normalize: bool = False) -> np.ndarray:
        """Softmax class probabilities, shape (batch, num_classes)."""
        return softmax(self.logits(batch, normalize=normalize))

    def predict(self, batch: Any, *, normalize: bool = False) -> np.ndarray:
        """Most likely class id per sample, shape (batch,); names via `class_names`."""
        return self.logits(batch, normalize=normalize).argmax(axis=1)

    def __repr__(self) -> str:
        return f"OnnxPredictor({str(self.path)!r}, spec={self.spec}, providers={self.providers})"
