"""What an edgefl ONNX file holds besides its graph, and how such files are written.

The graph has one input ``input`` (batch, *input_shape) and one output ``logits``; the
metadata_props under ``edgefl.*`` carry the `ArchSpec`, the class names, the input
normalisation, the exporter and any quantization (`OnnxMetadata`). Files are written through
`model_zoo.files.atomic_path`, so a failed export or quantization never leaves half a file
behind.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx
import torch

from model_zoo.spec import ArchSpec, input_dtype

__all__ = [
    "FORMAT_VERSION",
    "INPUT_NAME",
    "META_ARCH_SPEC",
    "META_CLASS_NAMES",
    "META_EXPORTER",
    "META_EXPORTER_FALLBACK",
    "META_FORMAT_VERSION",
    "META_NORMALIZATION",
    "META_QUANTIZATION",
    "OUTPUT_NAME",
    "OnnxMetadata",
    "OnnxMetadataError",
    "check_class_names",
    "check_normalization",
    "metadata_from_props",
    "read_metadata",
    "set_metadata_props",
]

FORMAT_VERSION = "1"
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
META_ARCH_SPEC = "edgefl.arch_spec"
META_CLASS_NAMES = "edgefl.class_names"
META_NORMALIZATION = "edgefl.normalization"
META_FORMAT_VERSION = "edgefl.format_version"
META_QUANTIZATION = "edgefl.quantization"
META_EXPORTER = "edgefl.exporter"  # "dynamo" or "legacy": which torch exporter wrote the graph
META_EXPORTER_FALLBACK = "edgefl.exporter_fallback"  # why "auto" fell back to "legacy"


class OnnxMetadataError(ValueError):
    """An ONNX file lacks the edgefl metadata, or carries a version this code cannot read."""


@dataclass(frozen=True)
class OnnxMetadata:
    """What `export_onnx` stores in an ONNX file besides the graph."""

    spec: ArchSpec
    class_names: list[str]
    normalization: dict[str, list[float]] | None
    quantization: str | None = None
    # "dynamo" or "legacy"; None for files written before the exporter was recorded.
    exporter: str | None = None


# --------------------------------------------------------------------------------------------
# metadata


def check_class_names(spec: ArchSpec, class_names: Sequence[str] | None) -> list[str]:
    if class_names is None:
        return [str(i) for i in range(spec.num_classes)]
    names = list(class_names)
    if len(names) != spec.num_classes or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"class_names must be {spec.num_classes} strings (spec.num_classes), "
            f"got {len(names)} items: {names[:5]!r}..."
        )
    return names


def check_normalization(
    spec: ArchSpec, normalization: Mapping[str, Sequence[float]] | None
) -> dict[str, list[float]] | None:
    if normalization is None:
        return None
    if set(normalization) != {"mean", "std"}:
        raise ValueError(
            f"normalization must be a mapping with exactly the keys 'mean' and 'std', "
            f"got keys {sorted(normalization)}"
        )
    if input_dtype(spec) != torch.float32:
        raise ValueError(f"normalization makes no sense for the integer inputs of {spec}")
    mean = [float(v) for v in normalization["mean"]]
    std = [float(v) for v in normalization["std"]]
    channels = spec.input_shape[0] if len(spec.input_shape) == 3 else 1
    allowed = {1, channels}
    if len(mean) != len(std) or len(mean) not in allowed:
        raise ValueError(
            f"normalization mean and std need one value per channel ({channels}) or a single "
            f"value for input_shape {spec.input_shape}; got {len(mean)} means, {len(std)} stds"
        )
    if not all(math.isfinite(v) for v in mean) or not all(math.isfinite(s) and s > 0 for s in std):
        raise ValueError(f"normalization needs finite means and positive stds, got {mean}, {std}")
    return {"mean": mean, "std": std}


def metadata_from_props(props: Mapping[str, str], *, source: str = "model") -> OnnxMetadata:
    """Parse the `edgefl.*` metadata_props of an ONNX model (a key -> value mapping)."""
    if META_ARCH_SPEC not in props:
        raise OnnxMetadataError(
            f"{source} has no {META_ARCH_SPEC!r} metadata: it was not written by "
            "edge_sdk.export.export_onnx; re-export it from its ArchSpec and weights"
        )
    version = props.get(META_FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise OnnxMetadataError(
            f"{source} has edgefl format version {version!r}; this SDK reads version "
            f"{FORMAT_VERSION!r}: re-export it with this SDK"
        )
    try:
        spec = ArchSpec.from_json(props[META_ARCH_SPEC])
        class_names = json.loads(props.get(META_CLASS_NAMES, "null"))
        normalization = json.loads(props.get(META_NORMALIZATION, "null"))
    except ValueError as exc:
        raise OnnxMetadataError(f"{source} has malformed edgefl metadata: {exc}") from exc
    if class_names is None:
        class_names = [str(i) for i in range(spec.num_classes)]
    return OnnxMetadata(
        spec=spec,
        class_names=list(class_names),
        normalization=normalization,
        quantization=props.get(META_QUANTIZATION),
        exporter=props.get(META_EXPORTER),
    )


def read_metadata(path: str | os.PathLike[str]) -> OnnxMetadata:
    """Read the edgefl metadata of an ONNX file without loading its weights."""
    proto = onnx.load(os.fspath(path), load_external_data=False)
    return metadata_from_props({p.key: p.value for p in proto.metadata_props}, source=str(path))


def set_metadata_props(proto: onnx.ModelProto, props: Mapping[str, str]) -> None:
    kept = {p.key: p.value for p in proto.metadata_props if p.key not in props}
    onnx.helper.set_model_props(proto, {**kept, **props})
