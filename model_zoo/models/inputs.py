"""A set of inputs that travels as a model (`inputs`): the coordinator sends data to devices the
way it sends models, signed, chunked and checked against the shapes its spec implies.

`ArchSpec(family="inputs", input_shape=(c, h, w), num_classes=k, kwargs={"count": n})` has one
float32 buffer, `inputs` of shape (n, c, h, w), and no forward pass. `num_classes` is that of
the models the inputs are for. Today it carries FedMe's unlabeled set to the devices for the
guard's students (edge_sdk.algorithms.deployment). It is not an architecture a client can run:
`families()` leaves it out.
"""

from __future__ import annotations

import torch
from torch import nn

from model_zoo.spec import ArchSpec, ModelZooError, register

__all__ = ["INPUTS", "Inputs", "build_inputs", "inputs_spec"]

INPUTS = "inputs"


class Inputs(nn.Module):
    """`count` inputs of `input_shape`, as the buffer `inputs`."""

    def __init__(self, input_shape: tuple[int, ...], count: int) -> None:
        super().__init__()
        self.inputs: torch.Tensor
        self.register_buffer("inputs", torch.zeros(count, *input_shape))


@register(INPUTS, data=True)
def build_inputs(input_shape: tuple[int, ...], num_classes: int, count: int) -> Inputs:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ModelZooError(f"a set of inputs holds at least one, got count={count!r}")
    return Inputs(input_shape, count)


def inputs_spec(x: torch.Tensor, num_classes: int) -> ArchSpec:
    """The spec of the inputs `x` (n, *input_shape), for models of `num_classes` classes."""
    return ArchSpec(
        family=INPUTS,
        num_classes=num_classes,
        input_shape=tuple(x.shape[1:]),
        kwargs={"count": len(x)},
    )
