"""An edgefl plugin: a model family, a dataset, a partition scheme and an algorithm of your own,
usable by name from every command, with no edit inside the SDK.

    edgefl zoo --plugin examples/plugin/edgefl_example_plugin.py
    edgefl simulate --plugin examples/plugin/edgefl_example_plugin.py \
        --dataset stripes --partition label_blocks --models tiny_cnn --algorithm fedavgm \
        --clients 4 --rounds 5 --out runs/stripes

The same `--plugin` goes to `edgefl coordinator`, `edgefl client` and `edgefl demo` (which
passes it to every process it starts); `EDGEFL_PLUGINS=...` or an `edgefl.plugins` entry point
of an installed package do the same. Everything below registers when the module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from torch import nn

from coordinator.strategies import FitReply, register_strategy, weighted_mean
from coordinator.strategies.fedavg import FedAvgStrategy
from edge_sdk.algorithms import register_algorithm
from edge_sdk.algorithms.fedavg import FedAvg, FedAvgConfig
from model_zoo import register
from model_zoo.data import Dataset, register_dataset, register_scheme


# -- a model family -----------------------------------------------------------------------------
class TinyCNN(nn.Module):
    """One 3x3 convolution, global average pooling, one linear layer."""

    def __init__(self, in_channels: int, num_classes: int, width: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)  # any image size, without computing it
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


@register("tiny_cnn")
def build_tiny_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> nn.Module:
    # The SDK also calls builders on the meta device (shapes only, no values) to check a model
    # received from the network: build from the shapes, never from tensor values (no .item()).
    if len(input_shape) != 3:
        raise ValueError(f"tiny_cnn takes images (C, H, W), got input shape {input_shape}")
    return TinyCNN(input_shape[0], num_classes, width)


# -- a dataset ------------------------------------------------------------------------------------
STRIPES = ("horizontal", "vertical", "diagonal", "checker")


@register_dataset("stripes", needs_root=False)
def load_stripes(
    *,
    n_samples: int = 800,
    size: int = 12,
    noise: float = 0.5,
    seed: int = 0,
    max_samples: int | None = None,
) -> Dataset:
    """Generated 1 x size x size images of four stripe patterns with Gaussian noise."""
    rng = np.random.default_rng(seed)
    n = min(n_samples, max_samples or n_samples)
    y = rng.integers(0, len(STRIPES), n)
    i, j = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    patterns = np.stack([i % 2, j % 2, (i + j) % 2, (i // 2 + j // 2) % 2]).astype(np.float32)
    x = patterns[y] + noise * rng.standard_normal((n, size, size)).astype(np.float32)
    mean, std = float(x.mean()), float(x.std())
    return Dataset(
        name="stripes",
        x=torch.from_numpy((x - mean) / std).unsqueeze(1),
        y=torch.from_numpy(y.astype(np.int64)),
        classes=list(STRIPES),
        input_shape=(1, size, size),
        normalization={"mean": [mean], "std": [std]},
    )


# -- a partition scheme ---------------------------------------------------------------------------
@register_scheme("label_blocks")
def label_blocks(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups: Any
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Sort the samples by label and cut them into equal contiguous blocks, one per client:
    each client sees one or two classes."""
    order = np.argsort(labels, kind="stable")
    return list(np.array_split(order, num_clients)), {}


# -- an algorithm: FedAvg with server momentum (FedAvgM, Hsu et al. 2019) --------------------------
class FedAvgMConfig(FedAvgConfig):
    """One config for both halves: the device trains as FedAvg, the server steps with momentum."""

    server_lr: float = Field(1.0, gt=0)
    server_momentum: float = Field(0.9, ge=0, lt=1)


@register_algorithm
class FedAvgM(FedAvg):
    """Device half: FedAvg's (train the global model, send it back)."""

    name = "fedavgm"
    config_cls: ClassVar[type[FedAvgConfig]] = FedAvgMConfig


@register_strategy
class FedAvgMStrategy(FedAvgStrategy):
    """Server half: v <- momentum * v + (w - mean of the clients' models); w <- w - lr * v."""

    name = "fedavgm"
    config: FedAvgMConfig

    def setup(self) -> None:
        super().setup()
        self.velocity = {k: torch.zeros_like(v) for k, v in self.global_weights.items()}

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        states = [r.models["model"].weights for r in replies.values()]
        mean = weighted_mean(states, self._weights(replies))
        for k, w in self.global_weights.items():
            if not w.is_floating_point():
                self.global_weights[k] = mean[k]
                continue
            v = self.config.server_momentum * self.velocity[k] + (w - mean[k])
            self.velocity[k] = v
            self.global_weights[k] = w - self.config.server_lr * v

    def state_dict(self) -> dict[str, Any]:  # checkpoints carry the velocity too
        return super().state_dict() | {"velocity": dict(self.velocity)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}
