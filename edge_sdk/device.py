"""Device selection: chosen once (`auto` = CUDA when available, else CPU) and passed down."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["DeviceName", "resolve_device"]

DeviceName = Literal["auto", "cpu", "cuda"]


def resolve_device(name: str = "auto") -> torch.device:
    """Turn `auto | cpu | cuda | cuda:N` into a torch.device; asking for CUDA without one fails."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} requested but CUDA is not available; use 'auto' or 'cpu'"
            )
        return torch.device(name)
    raise ValueError(f"unknown device {name!r}; expected 'auto', 'cpu' or 'cuda'")
