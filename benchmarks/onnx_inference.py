"""Inference benchmark: PyTorch eager vs onnxruntime fp32 / int8 dynamic / int8 static.

The same as `edgefl bench onnx` (same options); docs/benchmarks/onnx-inference.md says what it
measures.

    python benchmarks/onnx_inference.py                          # every family, ~16 min on 2 cores
    python benchmarks/onnx_inference.py --quick --families mlr,lenet5 --json-out out.json

Prints one JSON object, then plain-text tables.
"""

from __future__ import annotations

import sys

from coordinator.cli import app

if __name__ == "__main__":
    app(["bench", "onnx", *sys.argv[1:]], prog_name="onnx_inference.py")
