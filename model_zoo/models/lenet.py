"""LeNet-5 (LeCun, Bottou, Bengio and Haffner, "Gradient-Based Learning Applied to Document
Recognition", Proc. IEEE 1998), in its common modern form: ReLU instead of scaled tanh, max
instead of average (sub-sampling) pooling, and a plain fully connected output layer.

The original takes 32x32 inputs; for smaller images (MNIST's 28x28) the first convolution is
padded by 2 so that both sizes reach the same 16x5x5 feature map. Any channel count works.
"""

from __future__ import annotations

from torch import Tensor, nn

from model_zoo.models._shapes import require_image
from model_zoo.spec import register

__all__ = ["LeNet5", "build_lenet5"]

_MIN_HW = 12  # padded: 12 -> 12 (conv) -> 6 (pool) -> 2 (conv) -> 1 (pool)


def _conv_pool_out(size: int, padding: int) -> int:
    size = size + 2 * padding - 4  # 5x5 conv, stride 1
    size //= 2  # 2x2 max-pool
    size -= 4  # second 5x5 conv, no padding
    return size // 2


class LeNet5(nn.Module):
    """conv5x5(6) - pool - conv5x5(16) - pool - FC120 - FC84 - FC(num_classes), ReLU."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        channels, height, width = input_shape
        padding = 2 if min(height, width) < 32 else 0
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 16 * _conv_pool_out(height, padding) * _conv_pool_out(width, padding)
        self.classifier = nn.Sequential(
            nn.Linear(flat, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


@register("lenet5")
def build_lenet5(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """(C, H, W) with H, W >= 12; H or W below 32 pads the first convolution by 2."""
    return LeNet5(require_image("lenet5", input_shape, min_hw=_MIN_HW), num_classes)
