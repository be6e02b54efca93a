"""torch's SGD and Adam without the torch.compile machinery they load on first use.

`torch.optim` marks its optimizers' methods for `torch.compile` to leave alone (and breaks the
graph around `step`), and doing so imports all of `torch._dynamo` on the first optimizer
built: sympy, triton, torch.distributed, about 150 MB of resident memory per process with the
CUDA build of torch 2.14 (and ~2 s), every simulated federation and every device paying it for
a compiler it never runs (benchmarks/simulate_scale.py). The classes here are torch's own, with
those markers taken off: the same update arithmetic (bit for bit), the same state dicts, still
`torch.optim.Optimizer`s. Nothing in edge_sdk compiles a training step; under `torch.compile`,
use torch's classes.

One difference in how, not what: SGD adds the weight decay into the gradients in place
(`grad += wd·param`, the very operation torch's SGD computes into a new tensor) and then steps
without it. The parameters come out the same, bit for bit; the gradients hold the decayed value
after the step. A fresh tensor per parameter per step costs little for one small model, but a
stack of 100 clients' models (edge_sdk.cohort) allocates and page-faults 30 MB per step for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._compile

__all__ = ["SGD", "Adam", "restart"]

# The wrapper `torch._disable_dynamo` puts around a method; what it wraps is `__wrapped__`.
_DISABLE_WRAPPER = torch._compile._disable_dynamo(lambda: None).__code__
_O = TypeVar("_O", bound=type[torch.optim.Optimizer])


def _unwrapped(fn: Any) -> Any:
    if getattr(fn, "__code__", None) is _DISABLE_WRAPPER:
        return fn.__wrapped__
    return fn


def _without_dynamo(cls: _O) -> _O:
    """`cls` with its methods' `torch._disable_dynamo` wrappers and `step`'s graph breaks
    removed (grad mode set as torch's wrapper sets it)."""
    for klass in reversed(cls.__mro__[1:]):
        for name, fn in vars(klass).items():
            if _unwrapped(fn) is not fn:
                setattr(cls, name, _unwrapped(fn))
    raw: Callable[..., Any] = inspect.unwrap(cls.__mro__[1].__dict__["step"])

    def lean_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return raw(self, closure)

    lean_step.__doc__ = raw.__doc__
    cls.step = lean_step  # type: ignore[method-assign]
    return cls


@_without_dynamo
class _SGD(torch.optim.SGD):
    """`torch.optim.SGD`, without loading `torch._dynamo`."""


class SGD(_SGD):
    """`torch.optim.SGD`, without loading `torch._dynamo`; weight decay added in place."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        decays = [g["weight_decay"] for g in self.param_groups]
        for group, wd in zip(self.param_groups, decays, strict=True):
            if wd and not group["maximize"] and not group["differentiable"]:
                pairs = [(p.grad, p) for p in group["params"] if p.grad is not None]
                if pairs:
                    torch._foreach_add_([g for g, _ in pairs], [p for _, p in pairs], alpha=wd)
                group["weight_decay"] = 0
        try:
            return super().step(closure)
        finally:
            for group, wd in zip(self.param_groups, decays, strict=True):
                group["weight_decay"] = wd


@_without_dynamo
class Adam(torch.optim.Adam):
    """`torch.optim.Adam`, without loading `torch._dynamo`."""


def restart(optimizer: torch.optim.Optimizer) -> None:
    """Let `optimizer` step on as a new one over the same parameters would: its state zeroed in
    place (SGD's momentum, Adam's moments and step count), so that a captured step reading that
    state stays valid (`edge_sdk.graphs`). A zero momentum buffer equals a new SGD's first step
    (its buffer is that step's gradient) only without dampening; otherwise the state is dropped.
    """
    if any(g.get("dampening", 0) for g in optimizer.param_groups):
        optimizer.state.clear()
        return
    tensors = [v for entry in optimizer.state.values() for v in entry.values()]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if tensors:
        torch._foreach_zero_(tensors)
