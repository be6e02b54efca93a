"""What runs on a device: algorithms, trainer, losses, wire protocol, transports, EdgeClient,
ONNX export and inference. Import the submodules you need (`edge_sdk.client`, `edge_sdk.export`,
`edge_sdk.quantization`, `edge_sdk.inference`, `edge_sdk.onnx_bench`); this package stays light:
importing it, or a light submodule such as `edge_sdk.auth`, loads neither torch nor any ONNX
tooling. The names below load their module (and torch) when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_sdk.client_data import ClientData
    from edge_sdk.codec import WireModel
    from edge_sdk.device import resolve_device
    from edge_sdk.optim_config import OptimConfig
    from edge_sdk.trainer import Trainer

__all__ = ["ClientData", "OptimConfig", "Trainer", "WireModel", "resolve_device"]

_WHERE = {
    "ClientData": "edge_sdk.client_data",
    "OptimConfig": "edge_sdk.optim_config",
    "Trainer": "edge_sdk.trainer",
    "WireModel": "edge_sdk.codec",
    "resolve_device": "edge_sdk.device",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'edge_sdk' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
