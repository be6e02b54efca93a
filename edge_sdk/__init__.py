"""What runs on a device: algorithms, trainer, losses, wire protocol, transports, EdgeClient,
ONNX export and inference. Import the submodules you need (`edge_sdk.client`, `edge_sdk.export`,
`edge_sdk.quantization`, `edge_sdk.inference`, `edge_sdk.onnx_bench`); this package stays light
so that importing it loads no ONNX tooling.
"""

from edge_sdk.codec import WireModel
from edge_sdk.device import resolve_device
from edge_sdk.trainer import ClientData, OptimConfig, Trainer

__all__ = ["ClientData", "OptimConfig", "Trainer", "WireModel", "resolve_device"]
