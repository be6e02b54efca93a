"""Input-shape checks shared by the family modules.

Each helper raises `InvalidInputShape` with the family name and the constraint it violated, so a
bad `ArchSpec` fails at `build` time with a message that says what to change.
"""

from __future__ import annotations

import math

from model_zoo.spec import InvalidInputShape, ModelZooError

__all__ = ["flat_features", "positive_int", "require_image"]


def require_image(
    family: str,
    input_shape: tuple[int, ...],
    *,
    min_hw: int,
    why: str = "so that its pooling stages keep a spatial size >= 1",
) -> tuple[int, int, int]:
    """Check that `input_shape` is (C, H, W) with H, W >= `min_hw`; return (C, H, W).

    `why` completes the error message ("needs H and W >= 16 <why>").
    """
    if len(input_shape) != 3:
        raise InvalidInputShape(
            f"{family} needs an image input_shape (C, H, W), got {input_shape} "
            f"({len(input_shape)}-D); use mlr/mlp for feature vectors"
        )
    c, h, w = input_shape
    if h < min_hw or w < min_hw:
        raise InvalidInputShape(
            f"{family} needs H and W >= {min_hw} {why}, got {h}x{w}; "
            "resize the input or pick a shallower family"
        )
    return c, h, w


def flat_features(input_shape: tuple[int, ...]) -> int:
    """Number of features after flattening one sample of `input_shape`."""
    return math.prod(input_shape)


def positive_int(family: str, name: str, value: object) -> int:
    """Check that the kwarg `name` of `family` is a positive int (bools refused); return it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelZooError(f"{family} kwarg {name!r} must be a positive int, got {value!r}")
    return value
