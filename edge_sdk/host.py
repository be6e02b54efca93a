"""What this host is, for the records of what a figure was measured on: its CPU's name.

Light: it loads neither torch nor any ONNX tooling, so a benchmark that measures start-up (or
anything else that must not hold torch) can record its machine.
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

__all__ = ["cpu_name"]


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (`platform.processor()` is often empty on
    Linux), else what `platform` knows: what a benchmark's figures depend on."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
