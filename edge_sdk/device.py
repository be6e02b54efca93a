"""Device selection: chosen once (`auto` = CUDA when available, else CPU) and passed down; how
many CPU threads this process should use; and a GPU held by one training task at a time.

`choose_device` also says why (what was asked, and what `auto` found) and what precision the
SDK's trainer computes in there, so that a run can report the device it actually used.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "DeviceChoice",
    "DeviceName",
    "autocast_dtype",
    "choose_device",
    "cpu_threads",
    "exclusive",
    "precision",
    "resolve_device",
    "stepping_aside",
]

DeviceName = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class DeviceChoice:
    """The device a name resolved to, and why."""

    requested: str  # what was asked: auto, cpu, cuda, cuda:N
    device: torch.device
    reason: str  # e.g. "auto: CUDA is not available"

    @property
    def precision(self) -> str:
        return precision(self.device)


def choose_device(name: str = "auto") -> DeviceChoice:
    """Turn `auto | cpu | cuda | cuda:N` into a device and the reason for it; asking for CUDA
    without one fails."""
    if name == "auto":
        if torch.cuda.is_available():
            device = torch.device("cuda")
            why = f"auto: CUDA is available ({torch.cuda.get_device_name(device)})"
            return DeviceChoice(name, device, why)
        return DeviceChoice(name, torch.device("cpu"), "auto: CUDA is not available")
    if name == "cpu":
        return DeviceChoice(name, torch.device("cpu"), "asked for cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} requested but CUDA is not available; use 'auto' or 'cpu'"
            )
        device = torch.device(name)
        return DeviceChoice(
            name, device, f"asked for {name} ({torch.cuda.get_device_name(device)})"
        )
    raise ValueError(f"unknown device {name!r}; expected 'auto', 'cpu' or 'cuda'")


def resolve_device(name: str = "auto") -> torch.device:
    """Turn `auto | cpu | cuda | cuda:N` into a torch.device; asking for CUDA without one fails."""
    return choose_device(name).device


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype the SDK's trainer autocasts to on `device`: bfloat16 on a CUDA device that
    supports it, else float16 (with loss scaling) on CUDA; None (plain float32) elsewhere."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def precision(device: torch.device) -> str:
    """How the trainer computes on `device`, in words: `float32`, or `bfloat16 autocast`."""
    dtype = autocast_dtype(device)
    return "float32" if dtype is None else f"{str(dtype).removeprefix('torch.')} autocast"


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


# One turn per GPU: tasks of clients in one process (the simulator's threads, EdgeClients on
# threads) take turns on a GPU. A CUDA graph capture fails when another thread uses the device
# meanwhile (an allocation, a synchronization: "operation not permitted when stream is
# capturing"), and the failed capture can leave the device unusable for every client after it.
# Seen on an H100: a simulated FedeRiCo run lost every client's finalize this way, and then
# every round of its baselines. What the turns cost is the overlap of the threads' kernel
# launches: that run's 60 FedeRiCo rounds (6 clients of tiny steps) took 34 s against 15 s.
class _Turn:
    """A GPU's turn: held by one thread at a time, which may take it again (nested); it steps
    aside while it waits for another client's work (`stepping_aside`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def held(self) -> bool:
        return self._owner == threading.get_ident()

    def take(self, depth: int = 1) -> None:
        if self.held():
            self._depth += depth
            return
        self._lock.acquire()
        self._owner, self._depth = threading.get_ident(), depth

    def give_back(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def step_aside(self) -> int:
        """Give the turn up whatever the depth; the depth it was held at."""
        depth, self._owner, self._depth = self._depth, None, 0
        self._lock.release()
        return depth


_TURNS: dict[str, _Turn] = {}
_TURNS_GUARD = threading.Lock()


def _takes_turns(device: torch.device) -> bool:
    return device.type == "cuda"


@contextmanager
def exclusive(device: torch.device) -> Iterator[None]:
    """Hold `device` for this thread while the block runs, if it is a GPU (other threads wait;
    the same thread may enter again); on the CPU, nothing: its tasks run side by side."""
    if not _takes_turns(device):
        yield
        return
    key = str(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current one, "cuda:N"
        key = f"cuda:{torch.cuda.current_device()}"
    with _TURNS_GUARD:
        turn = _TURNS.setdefault(key, _Turn())
    turn.take()
    try:
        yield
    finally:
        turn.give_back()


@contextmanager
def stepping_aside() -> Iterator[None]:
    """While this thread waits for what another client's task makes (a peer's model, its
    gradients), the GPUs it holds are free for that task; it takes them back after, as deep as
    it held them. A client holding its turn while it waited would wait for a peer that waits
    for the turn."""
    with _TURNS_GUARD:
        held = [t for t in _TURNS.values() if t.held()]
    depths = [turn.step_aside() for turn in held]
    try:
        yield
    finally:
        for turn, depth in zip(held, depths, strict=True):
            turn.take(depth)
