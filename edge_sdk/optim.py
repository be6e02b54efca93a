"""torch's SGD and Adam without the torch.compile machinery they load on first use.

`torch.optim` marks its optimizers' methods for `torch.compile` to leave alone (and breaks the
graph around `step`), and doing so imports all of `torch._dynamo` on the first optimizer
built: sympy, triton, torch.distributed, about 150 MB of resident memory per process with the
CUDA build of torch 2.14 (and ~2 s), every simulated federation and every device paying it for
a compiler it never runs (benchmarks/simulate_scale.py). The classes here are torch's own, with
those markers taken off: the same update arithmetic (bit for bit), the same state dicts, still
`torch.optim.Optimizer`s. Nothing in edge_sdk compiles a training step; under `torch.compile`,
use torch's classes.

SGD on the CPU runs torch's fused kernel (`fused=True`) unless told otherwise: one pass over
each parameter, its gradient and momentum where the single-tensor loop makes four (weight
decay, momentum scale, momentum add, update). For a stack of 100 mlps (coordinator.stacking) that
halves the update's time. Its values can differ from the loop's in the last bit (its vector
code fuses a multiply and an add that the loop rounds apart), and so from one position of a
value in memory to another: a client trained stacked and alone agree to float rounding.

Elsewhere, one difference in how, not what: SGD adds the weight decay into the gradients in place
(`grad += wd·param`, the very operation torch's SGD computes into a new tensor) and then steps
without it. The parameters come out the same, bit for bit; the gradients hold the decayed value
after the step. A fresh tensor per parameter per step costs little for one small model, but a
stack of 100 clients' models (coordinator.stacking) allocates and page-faults 30 MB per step for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._compile
from torch.optim.sgd import sgd as _sgd

__all__ = ["SGD", "Adam", "restart"]

# The wrapper `torch._disable_dynamo` puts around a method; what it wraps is `__wrapped__`.
_DISABLE_WRAPPER = torch._compile._disable_dynamo(lambda: None).__code__
_O = TypeVar("_O", bound=type[torch.optim.Optimizer])
_Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # a parameter, grad, momentum


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
    """`torch.optim.SGD`, without loading `torch._dynamo`; on the CPU its fused kernel unless
    `foreach` or `fused` is given (see `_fused_step`), elsewhere weight decay added in place."""

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(params, torch.Tensor):  # (torch refuses one tensor, with its reason)
            params = [_listed(p) for p in params]  # read once: a group's may be a generator
        if (
            kwargs.get("fused") is None
            and kwargs.get("foreach") is None
            and not kwargs.get("differentiable")
            and _all_on_cpu(params)
        ):
            kwargs["fused"] = True
        super().__init__(params, *args, **kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if (
            all(g["fused"] for g in self.param_groups)
            and getattr(self, "grad_scale", None) is None
            and _all_on_cpu(self.param_groups)
        ):
            return self._fused_step(closure)
        decays = [g["weight_decay"] for g in self.param_groups]
        for group, wd in zip(self.param_groups, decays, strict=True):
            # (a fused group's kernel adds it, after unscaling a gradient scaler's gradients)
            if wd and not group["maximize"] and not group["differentiable"] and not group["fused"]:
                pairs = [(p.grad, p) for p in group["params"] if p.grad is not None]
                if pairs:
                    torch._foreach_add_([g for g, _ in pairs], [p for _, p in pairs], alpha=wd)
                group["weight_decay"] = 0
        try:
            return super().step(closure)
        finally:
            for group, wd in zip(self.param_groups, decays, strict=True):
                group["weight_decay"] = wd

    def _fused_step(self, closure: Any) -> Any:
        """torch's fused step (`torch.optim.sgd.sgd`), with each parameter, its gradient and
        its momentum buffer given as flat runs of their memory (`_flat`). The kernel is
        elementwise; given tensors as they are, it copies one that is not contiguous (a stacked
        linear weight, held transposed: coordinator.stacking) in and out, slower than the loop it
        replaces, and it computes wrong values for a gradient laid out unlike its parameter
        (torch 2.14, CPU). Tensors that cannot run flat step by the single-tensor loop. (On
        the CPU without a gradient scaler: `step` decides.)"""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Each parameter with what steps it: its flat runs (the fused kernel), or the
            # tensors themselves (the loop).
            todo: dict[bool, list[tuple[torch.Tensor, _Triple]]] = {True: [], False: []}
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].get("momentum_buffer")
                    run = _flat(p, p.grad, buf)
                    todo[run is not None].append((p, run or (p, p.grad, buf)))
            for fused, items in todo.items():
                if not items:
                    continue
                bufs = [b for _, (_, _, b) in items]  # a first step fills in its new buffers
                _sgd(
                    [t for _, (t, _, _) in items],
                    [g for _, (_, g, _) in items],
                    bufs,
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    lr=group["lr"],
                    dampening=group["dampening"],
                    nesterov=group["nesterov"],
                    maximize=group["maximize"],
                    foreach=False,
                    fused=fused,
                )
                if group["momentum"] == 0:
                    continue
                for (p, (_, _, had)), b in zip(items, bufs, strict=True):
                    if had is None:  # new: a flat run's is 1-D, seen as its parameter's layout
                        assert b is not None
                        self.state[p]["momentum_buffer"] = (
                            b.as_strided(p.shape, p.stride(), 0) if fused else b
                        )
        return loss


def _flat(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None) -> _Triple | None:
    """`p`, `grad` and `buf` as 1-D aliases of their memory, element k of each the same
    element of the parameter, where the three share one layout that fills its memory without
    gaps (in any order of dimensions); None otherwise."""
    if grad.stride() != p.stride() or (buf is not None and buf.stride() != p.stride()):
        return None
    dims = sorted(range(p.dim()), key=p.stride, reverse=True)
    if not p.permute(dims).is_contiguous():
        return None

    def run(t: torch.Tensor) -> torch.Tensor:
        return t.as_strided((t.numel(),), (1,))

    return run(p), run(grad), None if buf is None else run(buf)


def _listed(p: Any) -> Any:
    """A parameter, or a param group with its parameters in a list (as torch lists them)."""
    if not isinstance(p, dict):
        return p
    ps = p["params"]
    return p | {"params": [ps] if isinstance(ps, torch.Tensor) else list(ps)}


def _all_on_cpu(params: list[Any]) -> bool:
    """Whether `params` (tensors, or param groups with their parameters listed) are all
    floating-point tensors on the CPU."""
    tensors: list[Any] = []
    for p in params:
        tensors += p["params"] if isinstance(p, dict) else [p]
    return bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point()
        for t in tensors
    )


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
