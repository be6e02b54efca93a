"""ArchSpec and the family registry: a model always travels as (ArchSpec, weights), never as code.

`build(spec)` rebuilds the same network anywhere (server, device, ONNX exporter). Families are
registered by name with the `register` decorator; the registry refuses duplicate names.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_validator
from torch import nn

__all__ = [
    "ArchSpec",
    "InvalidInputShape",
    "ModelZooError",
    "UnknownArchitecture",
    "build",
    "families",
    "input_dtype",
    "register",
]


class ModelZooError(ValueError):
    """Base class of the zoo's errors."""


class UnknownArchitecture(ModelZooError):
    def __init__(self, family: str, known: list[str]):
        super().__init__(
            f"unknown architecture family {family!r}; known families: {', '.join(known)}"
        )
        self.family = family
        self.known = known


class InvalidInputShape(ModelZooError):
    """The family cannot take this input shape; the message names the constraint."""


class ArchSpec(BaseModel):
    """A serialisable description of a network: enough to rebuild it with `build`.

    `input_shape` excludes the batch axis: (C, H, W) for images, (F,) for feature vectors, (T,)
    for token sequences.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    num_classes: int
    input_shape: tuple[int, ...]
    kwargs: dict[str, Any] = {}

    @field_validator("num_classes")
    @classmethod
    def _positive_classes(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"num_classes must be >= 1, got {v}")
        return v

    @field_validator("input_shape")
    @classmethod
    def _positive_shape(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(d < 1 for d in v):
            raise ValueError(f"input_shape must be non-empty with positive sizes, got {v}")
        return v

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> ArchSpec:
        return cls.model_validate_json(text)

    def with_(self, **changes: Any) -> ArchSpec:
        """A copy with some fields changed (specs are frozen)."""
        return self.model_validate({**self.model_dump(), **changes})

    def __str__(self) -> str:
        extra = f", {json.dumps(self.kwargs, sort_keys=True)}" if self.kwargs else ""
        return f"{self.family}({'x'.join(map(str, self.input_shape))}->{self.num_classes}{extra})"


@dataclass(frozen=True)
class _Family:
    builder: Callable[..., nn.Module]
    input_dtype: Callable[[ArchSpec], torch.dtype]
    composite: bool = False  # made of other families' models (a mixture), not a client's own
    data: bool = False  # a set of inputs that travels as a model (`inputs`), not a network


_REGISTRY: dict[str, _Family] = {}


def register(
    name: str,
    *,
    input_dtype: Callable[[ArchSpec], torch.dtype] | None = None,
    composite: bool = False,
    data: bool = False,
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Register `builder(input_shape, num_classes, **kwargs) -> nn.Module` under `name`
    (`composite`: made of other families' models; `data`: a set of inputs, not a network)."""

    def deco(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"architecture family {name!r} is already registered")
        dtype = input_dtype or (lambda spec: torch.float32)
        _REGISTRY[name] = _Family(builder, dtype, composite, data)
        return builder

    return deco


def families(*, composite: bool = False) -> list[str]:
    """Names of the families a client can run, sorted; with `composite`, also those made of
    other families' models (`mixture`). Never a set of inputs (`inputs`)."""
    _load_families()
    return sorted(n for n, f in _REGISTRY.items() if not f.data and (composite or not f.composite))


def is_network(spec: ArchSpec) -> bool:
    """Whether `spec` is a network (not a set of inputs travelling as a model, `inputs`)."""
    return not _family(spec.family).data


def _family(name: str) -> _Family:
    _load_families()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownArchitecture(name, sorted(_REGISTRY)) from None


_SEEDED_BUILD = threading.RLock()  # re-entrant: a mixture builds its members inside


def build(spec: ArchSpec, *, seed: int | None = None) -> nn.Module:
    """Build a freshly initialised network for `spec`.

    With `seed`, initialisation is reproducible and thread-safe: torch's global RNG is forked
    under a lock, so clients building models on their own threads get the same weights for the
    same seed. Without it, torch's global RNG is used as is, under the same lock, so an unseeded
    build on one thread never draws numbers from under a seeded build on another.
    """
    fam = _family(spec.family)
    if seed is None:
        with _SEEDED_BUILD:
            return _call(fam, spec)
    with _SEEDED_BUILD, torch.random.fork_rng(devices=[]):
        # The CPU generator only, the one a build draws from: torch.manual_seed would also
        # reseed every CUDA device's generator for good (fork_rng restores only the CPU's), and
        # before CUDA is initialised it queues that with a stack trace, ~5 ms per build.
        torch.default_generator.manual_seed(seed)
        return _call(fam, spec)


def _call(fam: _Family, spec: ArchSpec) -> nn.Module:
    try:
        return fam.builder(tuple(spec.input_shape), spec.num_classes, **spec.kwargs)
    except TypeError as exc:
        if "keyword argument" not in str(exc):
            raise
        raise ModelZooError(f"bad kwargs for family {spec.family!r}: {exc}") from exc


def input_dtype(spec: ArchSpec) -> torch.dtype:
    """dtype of the input tensor the family expects (float images/features, int64 tokens)."""
    return _family(spec.family).input_dtype(spec)


def _load_families() -> None:
    # Importing the family modules registers them; done lazily to avoid an import cycle.
    import model_zoo.models  # noqa: F401
