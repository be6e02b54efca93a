"""Data the coordinator itself holds (never a client's): today, an unlabeled set of inputs.

FedMe clusters the uploaded models by their outputs on such a set. In simulation the simulator
holds samples out of the dataset and passes them in; in a deployment the coordinator reads them
from a file named in its config (`load_unlabeled`): a `.npy` array or a `.safetensors` file of
inputs shaped like the clients' (N, *input_shape), preprocessed the way the clients preprocess
theirs. Neither format can carry code: `.npy` is read with `allow_pickle=False`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["ServerData", "UnlabeledDataError", "load_unlabeled"]


class UnlabeledDataError(ValueError):
    """An unlabeled-set file that is missing, unreadable, or not a float array of inputs."""


@dataclass(frozen=True)
class ServerData:
    """What the coordinator holds for strategies that need data of their own."""

    unlabeled: torch.Tensor | None = None  # (N, *input_shape) inputs, no labels


def load_unlabeled(path: str | Path) -> torch.Tensor:
    """Read an unlabeled set: `.npy` (one array) or `.safetensors` ("inputs", or its one tensor)."""
    p = Path(path)
    if not p.is_file():
        raise UnlabeledDataError(
            f"unlabeled set {p} does not exist; write the inputs with numpy.save (.npy) or "
            "safetensors (a tensor named 'inputs')"
        )
    suffix = p.suffix.lower()
    if suffix == ".npy":
        try:
            array = np.load(p, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise UnlabeledDataError(f"{p}: not a plain .npy array: {exc}") from exc
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    elif suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(p)
        except (SafetensorError, OSError) as exc:
            raise UnlabeledDataError(f"{p}: not a readable safetensors file: {exc}") from exc
        if "inputs" in tensors:
            tensor = tensors["inputs"]
        elif len(tensors) == 1:
            tensor = next(iter(tensors.values()))
        else:
            raise UnlabeledDataError(
                f"{p} holds tensors {sorted(tensors)}; name the inputs 'inputs'"
            )
    else:
        raise UnlabeledDataError(f"{p}: unlabeled sets are .npy or .safetensors files")
    if tensor.dim() < 2 or len(tensor) == 0:
        raise UnlabeledDataError(
            f"{p}: expected a batch of inputs (N, ...), got shape {tuple(tensor.shape)}"
        )
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
        raise UnlabeledDataError(
            f"{p}: inputs of dtype {tensor.dtype} are not numbers a model reads"
        )
    if not tensor.is_floating_point():
        return tensor.long()  # token ids (sequence models)
    tensor = tensor.float()
    if not bool(torch.isfinite(tensor).all()):
        raise UnlabeledDataError(f"{p}: the unlabeled inputs contain NaN or inf")
    return tensor
