"""The model families of the zoo. Importing this package registers every family with
`model_zoo.spec.register`; `example_input` makes a realistic random batch for any spec.

Families: mlr, mlp (`linear`), lenet5 (`lenet`), cnn1, cnn2 (`cnn`), vgg11/13/16/19 (`vgg`),
lstm in image and char modes (`lstm`), `mixture` (a weighted mixture of any of them), and
`inputs` (a set of inputs travelling as a model, not a network).
"""

from __future__ import annotations

import torch

from model_zoo.models import cnn, inputs, lenet, linear, lstm, mixture, vgg
from model_zoo.spec import ArchSpec, input_dtype

__all__ = ["cnn", "example_input", "inputs", "lenet", "linear", "lstm", "mixture", "vgg"]


def example_input(
    spec: ArchSpec, batch: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A random batch `(batch, *spec.input_shape)` of the dtype the family expects.

    Token ids uniform in [0, vocab_size) for int64 (char-mode) inputs, standard-normal float32
    values otherwise. Pass a seeded `generator` for a reproducible batch.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    shape = (batch, *spec.input_shape)
    dtype = input_dtype(spec)
    if dtype == torch.int64:
        vocab_size = int(spec.kwargs.get("vocab_size", 80))
        return torch.randint(0, vocab_size, shape, generator=generator, dtype=torch.int64)
    return torch.randn(shape, generator=generator, dtype=dtype)
