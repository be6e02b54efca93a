"""Stacked modules: a model's parameters with a leading client dimension, run as one program.

`stack_modules` builds a stack from clients' models of one architecture (a subclass of the
model's own class whose forward runs every row), `unstack_module` gives a row back. A chain of
the zoo's feed-forward layers runs as one batched program (grouped convolutions, batched
matmuls); anything else is vmapped over `functional_call`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from edge_sdk.algorithms.base import (
    SPEC_ATTR,
)
from edge_sdk.algorithms.members import CohortUnsupported
from model_zoo import ArchSpec

__all__ = ["stack_modules", "stack_rows", "unstack_module"]


# -- stacked modules ---------------------------------------------------------------------------
_TEMPLATE = "_edgefl_template"  # the meta-device copy whose forward each row runs


class _Stacked(nn.Module):
    """Mixed into a model's own class: parameters with a leading client dimension, and a
    forward that runs the original forward once per row: as one batched program when the model
    is a chain of layers `_chain_of` knows (grouped convolutions, batched matmuls), else vmapped.

    Inputs (R, B, ...) run on the first R rows (the clients taking a step, a prefix of the
    stack); inputs (B, ...) without the client dimension are the same batch for every row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        template = getattr(self, _TEMPLATE)
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        spec = getattr(self, SPEC_ATTR, None)
        shared = spec is not None and x.dim() == len(spec.input_shape) + 1
        if not shared and len(x) != len(next(iter(params.values()))):
            params = {k: v[: len(x)] for k, v in params.items()}
        chain = getattr(self, _CHAIN)
        if chain is not None:
            return _run_chain(chain, params, x, shared)

        def one(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return cast(torch.Tensor, functional_call(template, p, (xi,)))

        return cast(torch.Tensor, vmap(one, in_dims=(0, None if shared else 0))(params, x))

    def train(self, mode: bool = True) -> _Stacked:
        getattr(self, _TEMPLATE).train(mode)
        return cast(_Stacked, super().train(mode))


# -- a chain of layers as one batched program --------------------------------------------------
# vmap runs a stacked model's forward through its batching rules, which surround every layer
# with views and permutes: forward and backward, a stack of 20 lenet5s took 155 torch calls,
# one lenet5 alone 70. The zoo's feed-forward models are chains: convolutions, ReLU,
# max-pooling, a flatten, linear layers. Such a chain runs here on all rows at once, in the
# layouts its layers need, with what the batching rules amount to: a convolution of every row
# is one grouped convolution over the rows' channels side by side, (B, R·C, H, W); a linear
# layer of every row one batched matmul over (R, B, F). The same stack of lenet5s: 79 calls.
# On a GPU each call is a launch. On the CPU the arithmetic is the same, but the activations
# of 100 rows outgrow the caches: there the grouped convolutions run in channels-last memory
# (oneDNN's grouped kernels took a quarter to a half of their NCHW time), and a ReLU before a
# max-pooling runs after it (the same values and gradients, on a quarter of the values): a
# round of 100 lenet5 clients on 2 cores, 2.1-2.4 s before, 1.1-1.25 s after.


@dataclass(frozen=True)
class _Layer:
    kind: str  # "conv", "linear", "relu", "maxpool", "flatten"
    weight: str = ""  # conv, linear: the parameters' names
    bias: str | None = None
    options: tuple[tuple[str, Any], ...] = ()  # conv, maxpool: the functional's arguments


_CHAIN = "_edgefl_chain"  # the template's chain of _Layers, None when vmap runs it
_CHAINS: dict[str, tuple[_Layer, ...] | None] = {}  # by architecture


def _signature(*required: str, **optional: Any) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [inspect.Parameter(name, kind) for name in required]
        + [inspect.Parameter(name, kind, default=v) for name, v in optional.items()]
    )


# The functions a chain's layers call, as nn.Conv2d, nn.Linear, nn.ReLU, nn.MaxPool2d and a
# flatten (module, method or function) call them: the layer's kind, and the signature their
# arguments bind to.
_CONV = _signature("input", "weight", bias=None, stride=1, padding=0, dilation=1, groups=1)
_LINEAR = _signature("input", "weight", bias=None)
_RELU = _signature("input", inplace=False)
_POOL = _signature(
    "input",
    "kernel_size",
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode=False,
    return_indices=False,
)
_FLATTEN = _signature("input", start_dim=0, end_dim=-1)
_FUNCTIONS: dict[Any, tuple[str, inspect.Signature]] = {
    torch.conv2d: ("conv", _CONV),
    nn.functional.linear: ("linear", _LINEAR),
    nn.functional.relu: ("relu", _RELU),
    torch.relu: ("relu", _RELU),
    nn.functional.max_pool2d: ("maxpool", _POOL),
    torch.flatten: ("flatten", _FLATTEN),
    torch.Tensor.flatten: ("flatten", _FLATTEN),
}


class _Recorder(TorchFunctionMode):
    """The torch functions a forward calls: for a known one its kind, bound arguments and
    result; None for any other. A mode is this thread's alone (torch.fx's tracer, by contrast,
    patches nn.Module.__call__ for every thread while it traces, and a simulation trains
    stacks on several threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict[str, Any], Any] | None] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known = _FUNCTIONS.get(func)
        if known is None:
            self.calls.append(None)
        else:
            bound = known[1].bind(*args, **(kwargs or {}))
            bound.apply_defaults()
            self.calls.append((known[0], dict(bound.arguments), out))
        return out


def _chain_of(template: nn.Module, spec: ArchSpec) -> tuple[_Layer, ...] | None:
    """The forward of `template` (a model of architecture `spec`) as a chain of _Layers, or
    None: anything else runs vmapped. The template runs once, without gradients, on a batch of
    two zero inputs, and every torch function it calls is recorded. (Not on the meta device:
    meta kernels import torch.compile's machinery, 150 MB, which a simulation never loads.) A
    chain calls the known layers only, each on the output of the one before (the first on the
    input), and returns the last one's output; its convolutions take images, its linear layers
    (B, F), its max-pooling comes after a convolution. Once per architecture (its class and
    ArchSpec)."""
    key = f"{type(template).__module__}.{type(template).__qualname__}:{spec.model_dump_json()}"
    if key in _CHAINS:
        return _CHAINS[key]
    first = next(template.parameters())
    x = torch.zeros((2, *spec.input_shape), device=first.device, dtype=first.dtype)
    names = {id(p): name for name, p in template.named_parameters()}
    recorder = _Recorder()
    try:
        with torch.no_grad(), recorder:
            out = template(x)
    except Exception:  # a forward that cannot run on such a batch: vmap runs it
        out = None
    layers: list[_Layer] = []
    previous: Any = x
    for call in recorder.calls:
        if call is None:  # a function no layer of a chain calls
            break
        kind, args, result = call
        layer = _layer(kind, args, previous, names, layers)
        if layer is None:
            break
        layers.append(layer)
        previous = result
    whole = len(layers) == len(recorder.calls) and out is previous
    for i in range(len(layers) - 1):
        # max(relu(x)) = relu(max(x)), gradient included: the window's largest value wins
        # either way, and a window of values <= 0 passes no gradient either way. Pooled first,
        # the ReLU and its backward touch a quarter of the values (a 2x2 pool).
        if (layers[i].kind, layers[i + 1].kind) == ("relu", "maxpool"):
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
    chain = tuple(layers) if whole and any(x.kind == "linear" for x in layers) else None
    _CHAINS[key] = chain
    return chain


def _layer(
    kind: str,
    args: dict[str, Any],
    previous: Any,
    names: Mapping[int, str],
    before: Sequence[_Layer],
) -> _Layer | None:
    """One recorded call (`args` bound to its signature) as a _Layer, or None when _run_chain
    cannot run it. Its input must be `previous` (the output of the call before); its weights,
    parameters of the template (`names`: their names by id)."""
    x = args["input"]
    if x is not previous:
        return None
    if kind in ("conv", "linear"):
        weight, bias = names.get(id(args["weight"])), args["bias"]
        bias_name = None if bias is None else names.get(id(bias))
        if weight is None or (bias is not None and bias_name is None):
            return None
        if kind == "linear":
            return _Layer("linear", weight, bias_name) if x.dim() == 2 else None
        if x.dim() != 4 or args["groups"] != 1 or isinstance(args["padding"], str):
            return None
        opts = tuple((k, args[k]) for k in ("stride", "padding", "dilation"))
        return _Layer("conv", weight, bias_name, opts)
    if kind == "maxpool":
        if args["return_indices"] or not any(b.kind == "conv" for b in before):
            return None
        names_ = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
        return _Layer("maxpool", options=tuple((k, args[k]) for k in names_))
    if kind == "flatten":
        return _Layer("flatten") if (args["start_dim"], args["end_dim"]) == (1, -1) else None
    return _Layer(kind)  # relu


def _run_chain(
    chain: Sequence[_Layer], params: Mapping[str, torch.Tensor], x: torch.Tensor, shared: bool
) -> torch.Tensor:
    """Every row's forward through `chain` at once. The activations are in one of three
    layouts: "shared", (B, ...), the same for every row (an input without the client
    dimension); "rows", (R, B, ...); "folded", (B, R·C, H, W), the rows' channels side by
    side, a convolution's."""
    F = nn.functional
    rows = len(next(iter(params.values())))
    h, layout = x, "shared" if shared else "rows"
    for layer in chain:
        if layer.kind == "conv":
            w, b = params[layer.weight], None if layer.bias is None else params[layer.bias]
            if layout == "rows":
                h = h.transpose(0, 1).flatten(1, 2)
            if h.device.type == "cpu":  # oneDNN's grouped convolutions: 2-4x faster in NHWC
                h = h.contiguous(memory_format=torch.channels_last)
            groups = 1 if layout == "shared" else rows
            bias = None if b is None else b.flatten()
            h = F.conv2d(h, w.flatten(0, 1), bias, groups=groups, **dict(layer.options))
            layout = "folded"
        elif layer.kind == "linear":
            w, b = params[layer.weight], None if layer.bias is None else params[layer.bias]
            wt = w.transpose(1, 2)  # (R, in, out): the stacked layout in memory (_transposed)
            if layout == "shared":
                h = h.expand(rows, *h.shape)
            h = torch.bmm(h, wt) if b is None else torch.baddbmm(b[:, None], h, wt)
            layout = "rows"
        elif layer.kind == "relu":
            h = F.relu(h)
        elif layer.kind == "maxpool":
            h = F.max_pool2d(h, **dict(layer.options))  # after a convolution: folded
        else:  # flatten: what the template flattens from dimension 1 on, per row
            if layout == "folded":
                h = h.unflatten(1, (rows, -1)).flatten(2).transpose(0, 1)
                layout = "rows"
            else:
                h = h.flatten(1 if layout == "shared" else 2)
    return h


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _stacked_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Stacked{cls.__name__}", (_Stacked, cls), {})
    return _CLASSES[cls]


def _check_stackable(model: nn.Module) -> None:
    if any(True for _ in model.buffers()):
        raise CohortUnsupported(f"{type(model).__name__} has buffers (e.g. batch norm statistics)")
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        # A vmapped dropout would draw from the global generator, not each client's own.
        raise CohortUnsupported(f"{type(model).__name__} uses dropout")


def stack_modules(modules: Sequence[nn.Module], into: nn.Module | None = None) -> nn.Module:
    """One module whose every parameter is the members' parameters stacked (row i = member i),
    with the same parameter names, so that `state_dict()` / `load_state_dict()` take stacked
    tensors under the usual keys. Its forward takes inputs with the same leading dimension.

    `into`: a stack built before (one kept from an earlier round). Where it holds the members'
    architecture and shapes, the rows are written into its parameters, which stay the tensors
    they were, and it is returned; otherwise a new stack is built."""
    first = modules[0]
    spec = getattr(first, SPEC_ATTR, None)
    if any(getattr(m, SPEC_ATTR, None) != spec or type(m) is not type(first) for m in modules):
        raise CohortUnsupported("the members' models differ in architecture")
    if into is not None:  # (a new stack is checked where it is built, in stack_rows)
        _check_stackable(first)
        if not _holds(into, first, len(modules)):
            into = None
    rows = {}
    # Each member's parameters by name, read once (`get_parameter` per member and name walked
    # the module tree each time: 15 ms of a batched round of 100 mlps).
    named = [dict(m.named_parameters()) for m in modules]
    kept = dict(into.named_parameters()) if into is not None else {}
    with torch.no_grad():  # one stacking call per parameter, whatever the number of members
        for name, p in first.named_parameters():
            members: list[torch.Tensor] = [params[name] for params in named]
            out: torch.Tensor | None = None
            if into is not None:
                out = kept[name]
            elif _transposed(first, name):  # stacked straight into the layout _stacked keeps
                out = p.new_empty((len(modules), *reversed(p.shape))).transpose(1, 2)
            rows[name] = torch.stack(members, out=out)
    if into is None:
        return stack_rows(first, rows)
    into.train(first.training)
    return into


def _holds(stack: nn.Module, template: nn.Module, n: int) -> bool:
    """Whether `stack` is a stack of `n` rows of `template`'s architecture, each parameter of
    the shape, dtype and requires_grad of template's."""
    params = dict(stack.named_parameters())
    own = dict(template.named_parameters())
    return (
        type(stack) is _stacked_class(type(template))
        and getattr(stack, SPEC_ATTR, None) == getattr(template, SPEC_ATTR, None)
        and params.keys() == own.keys()
        and all(
            params[k].shape == (n, *p.shape)
            and params[k].dtype == p.dtype
            and params[k].requires_grad == p.requires_grad
            for k, p in own.items()
        )
    )


def _transposed(template: nn.Module, name: str) -> bool:
    """Whether the stacked parameter `name` is held transposed: the weights of linear layers,
    (N, out, in) held as (N, in, out) in memory. The batched matmul's gradient comes out in that
    layout; a contiguous weight's gradient would be copied out of it every step (2.5-3× the
    step of a stack of 100 mlps on the CPU)."""
    owner, _, leaf = name.rpartition(".")
    return leaf == "weight" and isinstance(template.get_submodule(owner), nn.Linear)


def stack_rows(template: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Module:
    """A copy of `template` whose parameters are `params` (stacked rows, under the template's
    names) and whose forward runs the template's once per row."""
    _check_stackable(template)
    # Both copies take shapes for the template's parameters, not copies of their values: the
    # shell's are replaced below, and the per-row template is meta (a copy per parameter,
    # twice, then a move to meta, was three quarters of a stacked lenet5's stacking calls).
    shapes = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for p in template.parameters()
    }
    shell = copy.deepcopy(template, dict(shapes))
    meta = copy.deepcopy(template, dict(shapes)).to("meta")
    for name, p in template.named_parameters():
        owner, _, leaf = name.rpartition(".")
        rows = params[name]
        if _transposed(template, name) and not rows.transpose(1, 2).is_contiguous():
            rows = rows.transpose(1, 2).contiguous().transpose(1, 2)
        stacked = nn.Parameter(rows, requires_grad=p.requires_grad)
        setattr(shell.get_submodule(owner), leaf, stacked)
    shell.__class__ = _stacked_class(type(template))
    object.__setattr__(shell, _TEMPLATE, meta)  # not a submodule: no parameters, no state
    meta.train(template.training)
    spec = getattr(template, SPEC_ATTR, None)
    setattr(shell, SPEC_ATTR, spec)
    object.__setattr__(shell, _CHAIN, None if spec is None else _chain_of(template, spec))
    return shell


def unstack_module(stacked: nn.Module, i: int) -> dict[str, torch.Tensor]:
    """Row `i` of a stacked module's state (views)."""
    return {k: v[i] for k, v in stacked.state_dict().items()}
