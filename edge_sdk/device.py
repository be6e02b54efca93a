"""Device selection: chosen once (`auto` = CUDA when available, else CPU) and passed down; and
how many CPU threads this process should use."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import torch

__all__ = ["DeviceName", "cpu_threads", "resolve_device"]

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


def cpu_threads(environ: Mapping[str, str] | None = None) -> int:
    """The CPU threads this process should use: the cores it may run on (its CPU affinity, as a
    container or `taskset` limits it; never `os.cpu_count()` alone, the machine's count), and no
    more than `OMP_NUM_THREADS` when that is set (as torch itself reads it). Several runs side
    by side each set OMP_NUM_THREADS to their share; without it each would use every core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    env = os.environ if environ is None else environ
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return max(1, min(int(first), cores))
    return max(1, cores)
