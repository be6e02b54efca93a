"""Model weights on the wire: safetensors bytes (never pickle), optional fp16, sha256, checks.

A model travels as (ArchSpec, weights). `WireModel` is that pair in memory; `encode_weights` /
`decode_weights` turn the weights into bytes and back, and `check_weights` refuses NaN/inf
values and tensors whose names or shapes do not match the architecture.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from model_zoo import ArchSpec, build

__all__ = [
    "DEFAULT_MAX_BLOB_BYTES",
    "Buffer",
    "PayloadError",
    "WeightsError",
    "WireModel",
    "check_weights",
    "clones",
    "cpu_copies",
    "decode_weights",
    "encode_weights",
    "sha256_hex",
    "state_of",
]

DEFAULT_MAX_BLOB_BYTES = 256 * 1024 * 1024
Buffer = bytes | bytearray | memoryview  # a blob: bytes as sent, a bytearray as received
_FP16_KEY = "edgefl.fp16"


class PayloadError(ValueError):
    """Bytes that cannot be a weights blob: too large, corrupt, wrong checksum."""


class WeightsError(ValueError):
    """Weights that decode but are unusable: non-finite values, wrong names or shapes."""


def sha256_hex(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached, contiguous CPU copy of a model's state dict (for the wire or a checkpoint).

    Contiguous in the standard layout even when the model runs channels_last: safetensors and
    every reader of the weights expect it.
    """
    return cpu_copies(model.state_dict(keep_vars=True))  # copied without autograd: detached


def cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of `tensors` on the CPU, contiguous in the standard layout (`state_of`'s
    copies, of tensors already taken out of a model): one foreach call for all of them when they
    are on the CPU."""
    src = list(tensors.values())
    with torch.no_grad():
        if all(t.device.type == "cpu" for t in src):
            made = clones(src, torch.contiguous_format)
        else:  # from a device: a copy to the host each, as before (not measured on one)
            made = [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in src]
    return dict(zip(tensors, made, strict=True))


def clones(tensors: list[torch.Tensor], layout: torch.memory_format) -> list[torch.Tensor]:
    """Copies of `tensors` in new memory, laid out as `layout`: one operator call for the list
    (`torch._foreach_clone`), a clone each on a torch without it."""
    if not tensors:
        return []
    foreach = getattr(torch, "_foreach_clone", None)
    if foreach is None:
        return [t.clone(memory_format=layout) for t in tensors]
    return list(foreach(tensors, memory_format=layout))


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
        # Seeded, so that rebuilding draws nothing from torch's global generator: how many
        # models a process materialises (one per client, or one per stack) changes no result.
        model = build(self.spec, seed=0)
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
    data: Buffer, *, max_bytes: int = DEFAULT_MAX_BLOB_BYTES
) -> dict[str, torch.Tensor]:
    """Parse a safetensors blob; fp16-encoded float tensors come back as float32.

    A writable buffer (what `Endpoint.receive` hands out) is not copied: the tensors are views
    of it and keep it alive. Read-only bytes are copied once. The header is checked as strictly
    as safetensors does: known dtypes, sizes that match shapes, offsets that tile the data.
    """
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise PayloadError(f"weights blob is {len(view)} bytes, over the limit of {max_bytes}")
    header, start = _read_header(view)
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PayloadError("corrupt weights blob: __metadata__ is not an object of strings")
    fp16 = meta.get(_FP16_KEY) == "1"
    if view.readonly:
        view = memoryview(bytearray(view))
    entries = sorted(
        (_entry(name, info, len(view) - start) for name, info in header.items()),
        key=lambda e: (e[3], e[4]),  # by (begin, end), as safetensors: empty tensors first
    )
    at = 0
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in entries:
        if begin != at:
            raise PayloadError(f"corrupt weights blob: tensor {name!r} does not start at {at}")
        at = end
        t = (
            torch.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=start + begin)
            if end > begin
            else torch.empty(0, dtype=dtype)
        )
        t = t.reshape(shape)
        tensors[name] = t.float() if fp16 and t.dtype == torch.float16 else t
    if at != len(view) - start:
        raise PayloadError(
            f"corrupt weights blob: {len(view) - start - at} bytes belong to no tensor"
        )
    return tensors


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}  # every dtype safetensors reads into torch: what it reads, this reads (test_fuzz)
_MAX_HEADER_BYTES = 16 * 1024 * 1024


def _read_header(view: memoryview) -> tuple[dict[str, Any], int]:
    """The header object and where the data starts."""
    if len(view) < 8:
        raise PayloadError(f"corrupt weights blob: {len(view)} bytes, no header")
    n = int.from_bytes(view[:8], "little")
    if n > min(_MAX_HEADER_BYTES, len(view) - 8):
        raise PayloadError(f"corrupt weights blob: a {n}-byte header in {len(view)} bytes")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise PayloadError(f"corrupt weights blob: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise PayloadError("corrupt weights blob: header is not an object")
    return header, 8 + n


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)  # not bool, not float


def _entry(name: str, info: Any, size: int) -> tuple[str, torch.dtype, list[int], int, int]:
    """(name, dtype, shape, begin, end) of one header entry, checked against the data size."""
    try:
        dtype = _DTYPES[info["dtype"]]
        shape, offsets = info["shape"], info["data_offsets"]
    except (KeyError, TypeError) as exc:
        raise PayloadError(f"corrupt weights blob: bad entry for {name!r} ({exc!r})") from exc
    if not (_int_list(shape) and _int_list(offsets) and len(offsets) == 2):
        raise PayloadError(f"corrupt weights blob: shape or offsets of {name!r} are not integers")
    begin, end = offsets
    numel = math.prod(shape)
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= size:
        raise PayloadError(f"corrupt weights blob: bad shape or offsets for {name!r}")
    if end - begin != numel * dtype.itemsize:
        raise PayloadError(
            f"corrupt weights blob: {name!r} has {end - begin} bytes for {numel} {dtype} values"
        )
    return name, dtype, shape, begin, end


def _largest(floats: Mapping[str, torch.Tensor], max_abs: float) -> tuple[str, float] | None:
    """The first tensor holding a value not finite or above `max_abs` in magnitude, and that
    magnitude; None where there is none. A fixed number of operator calls: the largest
    magnitude of each tensor (one foreach call; NaN propagates), then their largest. Checking
    tensor by tensor made six calls a tensor, which for a stack of clients' replies was a tenth
    of a round's calls (benchmarks/gpu_round.py)."""
    if not floats:
        return None
    tops = torch._foreach_norm(list(floats.values()), math.inf)

    def within(top: torch.Tensor) -> bool:
        value = float(top)
        return math.isfinite(value) and value <= max_abs

    if within(torch.stack(tops).max()):
        return None
    return next(
        (name, float(top)) for name, top in zip(floats, tops, strict=True) if not within(top)
    )


def check_weights(
    weights: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor] | None = None,
    *,
    what: str = "model",
    partial: bool = False,
    max_abs: float = math.inf,
) -> None:
    """Refuse non-finite values, values above `max_abs` in magnitude (the coordinator's
    `robust.max_abs`) and, given a reference state, missing/extra names, bad shapes or dtypes.

    With `partial=True` the weights may be a subset of the reference's names (shared backbone).
    """
    floats = {k: t for k, t in weights.items() if t.is_floating_point() and t.numel()}
    bad = _largest(floats, max_abs)
    if bad is not None:
        name, top = bad
        if not math.isfinite(top):
            raise WeightsError(f"{what}: tensor {name!r} contains NaN or inf")
        raise WeightsError(
            f"{what}: tensor {name!r} holds {top:.3g}, out of range (robust.max_abs = {max_abs:g})"
        )
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
