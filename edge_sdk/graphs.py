"""A training step run over many batches: eagerly, or captured once in a CUDA graph and replayed.

A small model's step is hundreds of tiny kernels, each launched from Python: on a GPU the
launches, not the arithmetic, set the pace (3.8 ms per FML step of one cnn2 client on an H100,
about 50× what its arithmetic needs, `../shared/reference/gpu_fml_vmap.py`). A CUDA graph
records the step's kernels once and replays them with one launch.

`StepRunner(step)` calls `step(*inputs)` for each batch. With `capture=True` (CUDA), the first
`warmup` calls of each input shape run eagerly on a side stream (they are real steps, and they
let lazily created state, such as optimizer buffers and library workspaces, exist before the
capture); the next call captures the step into a graph with static input tensors, and from then
on each call copies its inputs into those tensors and replays the graph. Everything the step
reads or writes other than its inputs (parameters, gradients, optimizer state) must stay the
same tensors for as long as the runner lives, which is one training task: the trainer makes a
runner per `Trainer.run`.

What a captured step may do: tensor operations on the device, autograd, optimizer steps
(`torch.optim.Adam` needs `capturable=True`; the trainer builds it so when it captures). What it
must not: read a value on the host (`.item()`, `float(t)`, `if t:`), draw random numbers from a
generator of its own, or change shape from one batch to the next (a new shape is a new graph).
Its outputs are the graph's static tensors: read them before the next call.

A runner can outlive its task: `Trainer.run(..., keep=...)` keeps it for the next task whose
step reads the same tensors at the same addresses with the same settings (`footprint`), so a
device's later rounds replay the step captured in its first without warming up or capturing
again (about 20 ms a round for one cnn2 client's FML step, benchmarks/gpu_round.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepRunner", "footprint"]

log = logging.getLogger(__name__)

Step = Callable[..., Sequence[torch.Tensor]]


def _key(inputs: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in inputs)


class _Unkept(Exception):
    """Something a footprint cannot tell apart by value."""


def footprint(*things: object) -> tuple[Any, ...] | None:
    """What a captured step bakes in of `things`, the modules, optimizers, tensors and plain
    values (numbers, strings, None) it reads: equal footprints, equal replays.

    A module counts with its class, its modules' modes (train or eval) and the address, shape,
    layout and `requires_grad` of every parameter and buffer; an optimizer with its class, its
    settings (learning rate, momentum, ...) and the address of each parameter and state tensor;
    a tensor (a stack's per-member loss weights) with its address, shape and layout, as a
    replay reads whatever it holds then.
    A parameter given new memory, an optimizer given new state or another learning rate, a
    value changed: another footprint. None where something cannot be told apart by value (a
    tensor among the settings, another kind of object): such a step is not kept.
    """
    try:
        return tuple(_footprint(thing) for thing in things)
    except _Unkept:
        return None


def _footprint(thing: object) -> Any:
    if isinstance(thing, torch.nn.Module):
        tensors = itertools.chain(thing.parameters(), thing.buffers())
        modes = tuple(m.training for m in thing.modules())
        return (type(thing), modes, *map(_where, tensors))
    if isinstance(thing, torch.optim.Optimizer):
        groups = tuple(
            (
                tuple(sorted((k, _value(v)) for k, v in group.items() if k != "params")),
                *map(_where, group["params"]),
            )
            for group in thing.param_groups
        )
        state = tuple(
            (_where(p), k, _where(v) if isinstance(v, torch.Tensor) else _value(v))
            for p, entry in thing.state.items()
            for k, v in sorted(entry.items())
        )
        return (type(thing), groups, state)
    if isinstance(thing, torch.Tensor):
        return _where(thing)
    return _value(thing)


def _where(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _value(v: object) -> Any:
    if isinstance(v, tuple | list):
        return tuple(_value(x) for x in v)
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise _Unkept(type(v).__name__)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]  # the static tensors a replay reads its batch from
    outputs: tuple[torch.Tensor, ...]  # the static tensors a replay writes its values to


class StepRunner:
    """`step(*inputs) -> tensors`, eagerly or (capture=True, CUDA) as a replayed CUDA graph per
    input shape. `graphs` counts the graphs captured, `eager` and `replayed` the steps run each
    way."""

    def __init__(self, step: Step, *, capture: bool = False, warmup: int = 2) -> None:
        self.step = step
        self.capture = capture
        self.warmup = warmup
        self._seen: dict[tuple[Any, ...], int] = {}
        self._graphs: dict[tuple[Any, ...], _Captured] = {}
        self._pool: Any = None  # one memory pool shared by this runner's graphs
        self.eager = 0  # steps run eagerly
        self.replayed = 0  # steps replayed from a graph
        self.last_replayed = False
        self.failed: str | None = None  # why a capture failed (the runner then runs eagerly)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        self.last_replayed = False
        if not self.capture:
            self.eager += 1
            return tuple(self.step(*inputs))
        key = _key(inputs)
        captured = self._graphs.get(key)
        if captured is None:
            seen = self._seen.get(key, 0)
            self._seen[key] = seen + 1
            if seen < self.warmup:
                return self._side_stream(inputs)
            try:
                captured = self._graphs[key] = self._capture(inputs)
            except RuntimeError as exc:  # torch.AcceleratorError among them
                return self._uncaptured(inputs, exc)
        for static, t in zip(captured.inputs, inputs, strict=True):
            if static is not None and t is not None:
                static.copy_(t)
        captured.graph.replay()
        self.replayed += 1
        self.last_replayed = True
        return captured.outputs

    def _side_stream(self, inputs: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        """An eager step on a side stream, as the warm-up before a capture must run."""
        self.eager += 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = tuple(self.step(*inputs))
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _uncaptured(
        self, inputs: Sequence[torch.Tensor | None], exc: BaseException
    ) -> tuple[torch.Tensor, ...]:
        """After a failed capture: this step and every later one eagerly, said once in the log.
        A capture runs nothing (its kernels are recorded, not launched), so the batch it was
        given has not been trained on: it runs now. Measured on an H100 (torch 2.11, CUDA 13):
        cuBLASLt failed a linear layer's kernel inside one capture of many
        (CUBLAS_STATUS_EXECUTION_FAILED), which would otherwise have ended the client's task."""
        self.capture = False
        self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning(
            "a training step could not be captured in a CUDA graph (%s); it runs eagerly",
            self.failed,
        )
        torch.cuda.synchronize()
        self.eager += 1
        return tuple(self.step(*inputs))

    def _capture(self, inputs: Sequence[torch.Tensor | None]) -> _Captured:
        """Record the step on static copies of `inputs` (recording runs nothing: the caller
        replays the graph for this very batch)."""
        static = [None if t is None else t.clone() for t in inputs]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = tuple(self.step(*static))
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph, static, outputs)
