"""Models as blobs: encode models into the blobs and `ModelRef`s a message carries, decode and
check them against the shapes their ArchSpec implies (built on meta tensors, no memory)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from edge_sdk.codec import (
    DEFAULT_MAX_BLOB_BYTES,
    Buffer,
    WireModel,
    check_weights,
    decode_weights,
    encode_weights,
    sha256_hex,
)
from edge_sdk.ids import unique_id
from edge_sdk.protocol import BlobRef, ModelRef
from model_zoo import ArchSpec, build

__all__ = ["model_bytes", "pack_models", "reference_shapes", "unpack_models"]


def model_bytes(spec: ArchSpec) -> int:
    """The bytes of a model of `spec` on the wire (float32 weights; the header is extra)."""
    return sum(t.numel() * t.element_size() for t in reference_shapes(spec).values())


def pack_models(
    models: Mapping[str, WireModel],
    *,
    fp16: bool = False,
    max_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    shared: bool = False,
) -> tuple[dict[str, ModelRef], dict[str, bytes]]:
    """Encode models as blobs and the ModelRefs a message carries for them (`shared`: the
    blobs travel on the broadcast topic, for many messages at once)."""
    refs: dict[str, ModelRef] = {}
    blobs: dict[str, bytes] = {}
    for name, m in models.items():
        data = encode_weights(m.weights, fp16=fp16, max_bytes=max_bytes)
        blob_id = unique_id()
        blobs[blob_id] = data
        refs[name] = ModelRef(
            spec=m.spec,
            blob=BlobRef(id=blob_id, sha256=sha256_hex(data), size=len(data), shared=shared),
        )
    return refs, blobs


def unpack_models(
    refs: Mapping[str, ModelRef],
    blobs: Mapping[str, Buffer],
    *,
    max_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    partial: frozenset[str] = frozenset(),
    max_abs: float = math.inf,
) -> dict[str, WireModel]:
    """Decode and validate models: finite values no larger than `max_abs` in magnitude, names
    and shapes that fit their ArchSpec.

    Models named in `partial` may carry a subset of their architecture's tensors (a shared
    backbone).
    """
    out: dict[str, WireModel] = {}
    for name, ref in refs.items():
        if ref.blob.id not in blobs:
            raise ValueError(f"model {name!r}: its blob {ref.blob.id} did not arrive")
        weights = decode_weights(blobs[ref.blob.id], max_bytes=max_bytes)
        check_weights(
            weights,
            reference_shapes(ref.spec),
            what=name,
            partial=name in partial,
            max_abs=max_abs,
        )
        out[name] = WireModel(ref.spec, weights)
    return out


def reference_shapes(spec: ArchSpec) -> Mapping[str, torch.Tensor]:
    """The state dict an ArchSpec implies, as meta tensors (names and shapes, no memory).

    Raises the zoo's errors for an unknown family or an impossible shape, so it also serves
    to check that a spec received from the network can be built, without building it.
    """
    return _reference_shapes(spec.to_json())


@functools.lru_cache(maxsize=64)
def _reference_shapes(spec_json: str) -> Mapping[str, torch.Tensor]:
    with torch.device("meta"):  # shapes only: no memory, no draws from the global RNG
        model = build(ArchSpec.from_json(spec_json))
    return dict(model.state_dict())
