"""LSTM classifiers (Hochreiter and Schmidhuber, "Long Short-Term Memory", Neural Computation
1997) in the two forms federated-learning benchmarks use:

* ``mode="image"`` (default): an image (C, H, W) is read row by row as H steps of C*W features
  (a (T, F) input is read as T steps of F features), the classic sequential-MNIST classifier;
  the last step's hidden state feeds a linear layer.
* ``mode="char"``: the character-level next-character model of the Shakespeare task of LEAF
  (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) and FedAvg (McMahan et al.,
  AISTATS 2017): token ids (T,) -> 8-d embedding -> 2-layer LSTM of 256 units -> linear layer on
  the last step giving logits over the next character (num_classes is normally vocab_size).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model_zoo.models._shapes import positive_int
from model_zoo.spec import ArchSpec, InvalidInputShape, ModelZooError, register

__all__ = ["CharLSTM", "ImageLSTM", "build_lstm", "lstm_input_dtype"]

_MODES = ("image", "char")


class ImageLSTM(nn.Module):
    """(B, C, H, W) -> H steps of C*W features (or (B, T, F) as is) -> LSTM -> last step -> FC."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, hidden: int, layers: int):
        super().__init__()
        features = input_shape[0] * input_shape[2] if len(input_shape) == 3 else input_shape[1]
        self.image = len(input_shape) == 3
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.image:
            # (B, C, H, W) -> (B, H, C, W) -> (B, H, C*W): each image row is one time step.
            x = torch.flatten(x.permute(0, 2, 1, 3), 2)
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


class CharLSTM(nn.Module):
    """(B, T) int64 token ids -> Embedding -> LSTM -> last step -> FC to next-token logits."""

    def __init__(self, num_classes: int, *, vocab_size: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embedding(tokens))
        return self.fc(out[:, -1])


def lstm_input_dtype(spec: ArchSpec) -> torch.dtype:
    """int64 token ids in char mode, float32 otherwise."""
    return torch.int64 if spec.kwargs.get("mode") == "char" else torch.float32


@register("lstm", input_dtype=lstm_input_dtype)
def build_lstm(
    input_shape: tuple[int, ...],
    num_classes: int,
    mode: str = "image",
    hidden: int | None = None,
    layers: int | None = None,
    vocab_size: int = 80,
    embed: int = 8,
) -> nn.Module:
    """Image mode: (C, H, W) or (T, F); hidden 64, 1 layer by default.

    Char mode: (T,) token ids; vocab_size 80, embed 8, hidden 256, 2 layers by default.
    """
    if mode not in _MODES:
        raise ModelZooError(f"lstm kwarg 'mode' must be one of {_MODES}, got {mode!r}")
    if mode == "char":
        if len(input_shape) != 1:
            raise InvalidInputShape(
                f"lstm in char mode needs input_shape (T,) of token ids, got {input_shape}"
            )
        return CharLSTM(
            num_classes,
            vocab_size=positive_int("lstm", "vocab_size", vocab_size),
            embed=positive_int("lstm", "embed", embed),
            hidden=positive_int("lstm", "hidden", 256 if hidden is None else hidden),
            layers=positive_int("lstm", "layers", 2 if layers is None else layers),
        )
    if len(input_shape) not in (2, 3):
        raise InvalidInputShape(
            f"lstm in image mode needs input_shape (C, H, W) (read as H steps of C*W features) "
            f"or (T, F), got {input_shape}; for token ids use kwargs {{'mode': 'char'}}"
        )
    return ImageLSTM(
        input_shape,
        num_classes,
        hidden=positive_int("lstm", "hidden", 64 if hidden is None else hidden),
        layers=positive_int("lstm", "layers", 1 if layers is None else layers),
    )
