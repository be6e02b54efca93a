"""The two small CNNs of Federated Mutual Learning (Shen, Zhang, Wang, Kuang, Chen, Wang, Yang,
Wu, "Federated Mutual Learning", arXiv:2006.16765, 2020), used there as heterogeneous local
models next to the shared meme model.

* CNN1: two 3x3 convolutions with 6 and 16 channels, each followed by ReLU and 2x2 max-pooling,
  then two fully connected layers (hidden width 120 by default).
* CNN2: three 3x3 convolutions with 128 channels (`width`), each followed by ReLU and 2x2
  max-pooling, then one fully connected layer.

Convolutions use padding 1 so that only the pooling shrinks the feature maps.
"""

from __future__ import annotations

from torch import Tensor, nn

from model_zoo.models._shapes import positive_int, require_image
from model_zoo.spec import register

__all__ = ["CNN1", "CNN2", "build_cnn1", "build_cnn2"]


def _conv_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]


def _pooled(size: int, stages: int) -> int:
    for _ in range(stages):
        size //= 2
    return size


class CNN1(nn.Module):
    """conv3x3(6)-pool - conv3x3(16)-pool - FC(hidden) - FC(num_classes)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 120):
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(*_conv_block(channels, 6), *_conv_block(6, 16))
        flat = 16 * _pooled(height, 2) * _pooled(width, 2)
        self.classifier = nn.Sequential(
            nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class CNN2(nn.Module):
    """Three conv3x3(width)-pool blocks, then FC(num_classes)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: int = 128):
        super().__init__()
        channels, height, w = input_shape
        self.features = nn.Sequential(
            *_conv_block(channels, width), *_conv_block(width, width), *_conv_block(width, width)
        )
        self.classifier = nn.Linear(width * _pooled(height, 3) * _pooled(w, 3), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


@register("cnn1")
def build_cnn1(input_shape: tuple[int, ...], num_classes: int, hidden: int = 120) -> nn.Module:
    """(C, H, W) with H, W >= 4 (two 2x2 poolings)."""
    shape = require_image("cnn1", input_shape, min_hw=4)
    return CNN1(shape, num_classes, hidden=positive_int("cnn1", "hidden", hidden))


@register("cnn2")
def build_cnn2(input_shape: tuple[int, ...], num_classes: int, width: int = 128) -> nn.Module:
    """(C, H, W) with H, W >= 8 (three 2x2 poolings)."""
    shape = require_image("cnn2", input_shape, min_hw=8)
    return CNN2(shape, num_classes, width=positive_int("cnn2", "width", width))
