"""VGG-11/13/16/19 (Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale
Image Recognition", ICLR 2015; configurations A, B, D and E of its Table 1), with optional batch
normalisation after each convolution (Ioffe and Szegedy, ICML 2015), adapted to small images and
edge devices:

* channel widths are scaled by `width` (default 0.25, i.e. 16..128 instead of 64..512);
* a 2x2 max-pool stage is skipped when the feature map is already smaller than 2x2, so 28x28 and
  32x32 inputs work (28 -> 14 -> 7 -> 3 -> 1, the fifth pool skipped);
* the three 4096-wide fully connected layers are replaced by global average pooling and a small
  classifier (one hidden layer as wide as the last convolution), as in the CIFAR variants.

One `VGG` module is driven by the layer-width table `CONFIGS`; each variant is a tiny builder.
"""

from __future__ import annotations

from torch import Tensor, nn

from model_zoo.models._shapes import require_image
from model_zoo.spec import ModelZooError, register

__all__ = [
    "CONFIGS",
    "VGG",
    "build_vgg11",
    "build_vgg13",
    "build_vgg16",
    "build_vgg19",
]

_POOL = "M"

# Output channels of each 3x3 convolution at width 1.0; "M" is a 2x2 max-pool stage.
# fmt: off
CONFIGS: dict[str, tuple[int | str, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (
        64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
    ),
    "vgg19": (
        64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
        512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
    ),
}
# fmt: on

# At least four of the five pooling stages must apply: 16 -> 8 -> 4 -> 2 -> 1.
_MIN_HW = 16


class VGG(nn.Module):
    """Convolution stack from a `CONFIGS` table, global average pooling, small classifier."""

    def __init__(
        self,
        config: tuple[int | str, ...],
        input_shape: tuple[int, int, int],
        num_classes: int,
        *,
        width: float = 0.25,
        batch_norm: bool = True,
    ):
        super().__init__()
        channels, height, w = input_shape
        layers: list[nn.Module] = []
        for item in config:
            if item == _POOL:
                if min(height, w) >= 2:
                    layers.append(nn.MaxPool2d(2))
                    height, w = height // 2, w // 2
                continue
            out = max(1, round(int(item) * width))
            layers.append(nn.Conv2d(channels, out, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU())
            channels = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(channels, channels), nn.ReLU(), nn.Linear(channels, num_classes)
        )
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))


def _build(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    width: float,
    batch_norm: bool,
) -> VGG:
    shape = require_image(
        name,
        input_shape,
        min_hw=_MIN_HW,
        why="(at least four of its five 2x2 max-pool stages must apply)",
    )
    if isinstance(width, bool) or not isinstance(width, int | float) or width <= 0:
        raise ModelZooError(f"{name} kwarg 'width' must be a positive number, got {width!r}")
    if not isinstance(batch_norm, bool):
        raise ModelZooError(f"{name} kwarg 'batch_norm' must be true or false, got {batch_norm!r}")
    return VGG(CONFIGS[name], shape, num_classes, width=float(width), batch_norm=batch_norm)


@register("vgg11")
def build_vgg11(
    input_shape: tuple[int, ...], num_classes: int, width: float = 0.25, batch_norm: bool = True
) -> nn.Module:
    """VGG-11 (configuration A); (C, H, W) with H, W >= 16."""
    return _build("vgg11", input_shape, num_classes, width, batch_norm)


@register("vgg13")
def build_vgg13(
    input_shape: tuple[int, ...], num_classes: int, width: float = 0.25, batch_norm: bool = True
) -> nn.Module:
    """VGG-13 (configuration B); (C, H, W) with H, W >= 16."""
    return _build("vgg13", input_shape, num_classes, width, batch_norm)


@register("vgg16")
def build_vgg16(
    input_shape: tuple[int, ...], num_classes: int, width: float = 0.25, batch_norm: bool = True
) -> nn.Module:
    """VGG-16 (configuration D); (C, H, W) with H, W >= 16."""
    return _build("vgg16", input_shape, num_classes, width, batch_norm)


@register("vgg19")
def build_vgg19(
    input_shape: tuple[int, ...], num_classes: int, width: float = 0.25, batch_norm: bool = True
) -> nn.Module:
    """VGG-19 (configuration E); (C, H, W) with H, W >= 16."""
    return _build("vgg19", input_shape, num_classes, width, batch_norm)
