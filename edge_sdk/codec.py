"""Model weights on the wire: safetensors bytes (never pickle), optional fp16, sha256, checks.

A model travels as (ArchSpec, weights). `WireModel` is that pair in memory; `encode_weights` /
`decode_weights` turn the weights into bytes and back, and `check_weights` refuses NaN/inf
values and tensors whose names or shapes do not match the architecture.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from model_zoo import ArchSpec, build

__all__ = [
    "DEFAULT_MAX_BLOB_BYTES",
    "PayloadError",
    "WeightsError",
    "WireModel",
    "check_weights",
    "decode_weights",
    "encode_weights",
    "sha256_hex",
    "state_of",
]

DEFAULT_MAX_BLOB_BYTES = 256 * 1024 * 1024
_FP16_KEY = "edgefl.fp16"


class PayloadError(ValueError):
    """Bytes that cannot be a weights blob: too large, corrupt, wrong checksum."""


class WeightsError(ValueError):
    """Weights that decode but are unusable: non-finite values, wrong names or shapes."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached, contiguous CPU copy of a model's state dict (for the wire or a checkpoint).

    Contiguous in the standard layout even when the model runs channels_last: safetensors and
    every reader of the weights expect it.
    """
    return {
        k: torch.empty(v.shape, dtype=v.dtype).copy_(v.detach())
        for k, v in model.state_dict().items()
    }


@dataclass(frozen=True)
class WireModel:
    """A model as it travels: its architecture and its weights (CPU tensors)."""

    spec: ArchSpec
    weights: dict[str, torch.Tensor]

    @classmethod
    def of(cls, spec: ArchSpec, model: nn.Module) -> WireModel:
        return cls(spec, state_of(model))

    def build(self, device: torch.device | str = "cpu") -> nn.Module:
        """Rebuild the network and load these weights (strictly)."""
        model = build(self.spec)
        model.load_state_dict(self.weights)
        return model.to(device)


def encode_weights(
    weights: Mapping[str, torch.Tensor],
    *,
    fp16: bool = False,
    max_bytes: int = DEFAULT_MAX_BLOB_BYTES,
) -> bytes:
    """Serialise weights to safetensors bytes; fp16 halves float32 tensors for transfer."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        t = t.detach().to("cpu")
        if fp16 and t.dtype == torch.float32:
            t = t.to(torch.float16)
        tensors[name] = t.contiguous()
    data = st_save(tensors, metadata={_FP16_KEY: "1" if fp16 else "0"})
    if len(data) > max_bytes:
        raise PayloadError(f"weights blob is {len(data)} bytes, over the limit of {max_bytes}")
    return data


def decode_weights(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BLOB_BYTES
) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes; fp16-encoded float tensors come back as float32."""
    if len(data) > max_bytes:
        raise PayloadError(f"weights blob is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise PayloadError(f"corrupt weights blob ({len(data)} bytes): {exc}") from exc
    # The metadata header says whether float tensors were halved for transport.
    if _header_says_fp16(data):
        tensors = {k: v.float() if v.dtype == torch.float16 else v for k, v in tensors.items()}
    return tensors


def _header_says_fp16(data: bytes) -> bool:
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__", {})
    return meta.get(_FP16_KEY) == "1"


def check_weights(
    weights: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor] | None = None,
    *,
    what: str = "model",
    partial: bool = False,
) -> None:
    """Refuse non-finite values and, given a reference state, missing/extra names, bad shapes
    or dtypes.

    With `partial=True` the weights may be a subset of the reference's names (shared backbone).
    """
    for name, t in weights.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WeightsError(f"{what}: tensor {name!r} contains NaN or inf")
    if reference is None:
        return
    extra = sorted(set(weights) - set(reference))
    missing = [] if partial else sorted(set(reference) - set(weights))
    if extra or missing:
        raise WeightsError(f"{what}: unexpected tensors {extra[:5]}, missing tensors {missing[:5]}")
    for name, t in weights.items():
        ref = reference[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise WeightsError(
                f"{what}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
            )
        if t.dtype != ref.dtype:
            raise WeightsError(f"{what}: tensor {name!r} is {t.dtype}, expected {ref.dtype}")
