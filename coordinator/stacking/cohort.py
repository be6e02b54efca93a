"""Stacked training: clients of one architecture train as one stacked model.

A simulation runs many clients in one process. Each would run its algorithm's ~100 tiny torch
ops per step on its own; here the clients of one task group (the simulator's LocalFleet groups a
phase's tasks, `coordinator.stacking.Stacking`) run their algorithm's `fit` **once**, on models
whose parameters carry a leading client dimension (`torch.func.vmap` over `functional_call`), so
every op runs once for all of them. The shared losses give one value per client for stacked
logits; no client's loss depends on another's parameters, so the gradient of their sum holds each
client's own gradient in its row, and the algorithm's update rule, written once, applies row by
row. Optimizers step stacked parameters and their stacked state (momentum) elementwise, as they
would each client's.

Nothing is forked: the algorithm's own `fit` runs, on a `CohortContext` whose trainer
(`coordinator.stacking.CohortTrainer`) draws each client's batches from that client's own
generator and data, gives each client its own number of steps, and whose `build_model` builds
each client's model with its own seed. Before the stacked fit each member's persistent state is
stacked (modules, optimizers, equal plain values), after it each member gets its row back, so
evaluation, persistence, rollback and ONNX export stay per client.

An algorithm opts in with `stackable = True`: its `fit` uses only what a CohortContext provides
(`ctx.build_model` / `ctx.materialize`, the trainer's batches, `run`, `step`,
`value_and_grad`, `evaluate`, elementwise updates, `data.n_train`) and takes no branch per
client on a value that differs between them (`PerMember` refuses it): a decision per client is
applied row by row (FML's and FedMe's gates weigh each member's loss, FedMe's members adopt
their exchanged model's rows, PersFL's members keep the rows of the teacher each chose), and a
persistent plain value that differs between members (PersFL's teacher's round) is named in the
algorithm's `per_member` and held as a PerMember list. Whatever cannot stack
(models with buffers such as batch norm, dropout, members whose state differs in kind, Adam with
unequal step counts) runs client by client, from the same state and random generators, so the
result does not depend on the path; the log says why.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from coordinator.stacking.kept import KeptStacks
from coordinator.stacking.trainer import CohortTrainer, StackedData
from edge_sdk.algorithms.base import (
    SPEC_ATTR,
    Candidate,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    TaskInfo,
)
from edge_sdk.algorithms.members import CohortUnsupported, PerMember
from edge_sdk.codec import WireModel, clones
from edge_sdk.trainer import Score
from model_zoo import ArchSpec, build

__all__ = [
    "CohortContext",
    "CohortTrainer",
    "CohortUnsupported",
    "PerMember",
    "run_stacked",
    "stack_modules",
    "unstack_module",
]

log = logging.getLogger(__name__)


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
    if into is not None:  # (a new stack is checked where it is built, in _stacked)
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
        return _stacked(first, rows)
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


def _stacked(template: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Module:
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


# -- what a stacked fit sees -------------------------------------------------------------------
@dataclass
class CohortContext(ClientContext):
    """The context of a stacked fit: its models are built per member and stacked."""

    members: list[ClientContext] = field(default_factory=list)

    def build_model(self, spec: ArchSpec, salt: int) -> nn.Module:
        return stack_modules([c.build_model(spec, salt) for c in self.members])

    def materialize(self, model: WireModel) -> nn.Module:
        template = build(model.spec, seed=0)  # its own weights are replaced: any seed will do
        setattr(template, SPEC_ATTR, model.spec)
        rows = {
            name: model.weights[name].to(self.device, copy=True)
            for name, _ in template.named_parameters()
        }
        return _stacked(template, rows)


def _cohort_context(
    members: Sequence[ClientContext], task: TaskInfo, masked: bool | None
) -> CohortContext:
    first = members[0]
    return CohortContext(
        client_id="+".join(c.client_id for c in members),
        spec=first.spec,
        data=StackedData.of([c.data for c in members]),
        device=first.device,
        seed=first.seed,
        trainer=CohortTrainer([c.trainer for c in members], masked=masked),
        peers=None,
        task=task,
        members=list(members),
    )


# -- stacking and unstacking algorithm state ---------------------------------------------------
def _stack_state(
    name: str, members: Sequence[ClientAlgorithm], stacked: ClientAlgorithm, into: Any = None
) -> Any:
    """The members' persistent attribute `name` as one value of the stacked algorithm: modules
    and optimizers stacked (written into `into`, a kept stack's own, where it fits), a plain
    value kept when every member holds an equal one."""
    values = [getattr(a, name) for a in members]
    first = values[0]
    if name in type(stacked).per_member:
        return PerMember(copy.deepcopy(values))
    if all(v is None for v in values):
        return None
    if all(isinstance(v, nn.Module) for v in values):
        return stack_modules(values, into if isinstance(into, nn.Module) else None)
    if all(isinstance(v, torch.optim.Optimizer) for v in values):
        module = getattr(stacked, _owner(first, members[0]))
        kept = into if isinstance(into, torch.optim.Optimizer) else None
        return _stack_optimizer(values, list(module.parameters()), kept)
    if not isinstance(first, nn.Module | torch.optim.Optimizer | torch.Tensor):
        try:
            if all(bool(v == first) for v in values):
                return copy.deepcopy(first)
        except (RuntimeError, TypeError, ValueError):
            pass
    raise CohortUnsupported(f"the members' {name!r} differ in kind or hold what cannot stack")


def _owner(opt: torch.optim.Optimizer, algo: ClientAlgorithm) -> str:
    """The persistent module whose parameters `opt` steps."""
    ids = [id(p) for group in opt.param_groups for p in group["params"]]
    for name in type(algo).persistent:
        module = getattr(algo, name, None)
        if isinstance(module, nn.Module) and [id(p) for p in module.parameters()] == ids:
            return name
    raise CohortUnsupported("an optimizer steps something other than one persistent model")


def _stack_optimizer(
    opts: Sequence[torch.optim.Optimizer],
    params: list[nn.Parameter],
    into: torch.optim.Optimizer | None = None,
) -> torch.optim.Optimizer:
    """One optimizer of the members' kind and settings over `params` (the stacked model's), its
    state the members' stacked: a momentum buffer row per member; step counts must agree.
    `into`: an optimizer built before (kept) over these very `params`, whose state tensors are
    overwritten where their shapes fit; otherwise a new optimizer is built."""
    saved = [o.state_dict() for o in opts]
    groups = saved[0]["param_groups"]
    if len(groups) != 1 or any(s["param_groups"] != groups for s in saved):
        raise CohortUnsupported("the members' optimizers differ in settings")
    if (
        into is None
        or type(into) is not type(opts[0])
        or len(into.param_groups) != 1
        or len(into.param_groups[0]["params"]) != len(params)
        or any(a is not b for a, b in zip(into.param_groups[0]["params"], params, strict=True))
    ):
        into = cast(Any, type(opts[0]))(params)
    state: dict[Any, dict[str, Any]] = {}
    for index in saved[0]["state"]:
        rows = [s["state"].get(index) for s in saved]
        if any(r is None or r.keys() != rows[0].keys() for r in rows):
            raise CohortUnsupported("the members' optimizers have taken different steps")
        p = params[index]
        have = into.state.get(p, {})
        state[p] = {k: _stack_entry([r[k] for r in rows], p, have.get(k)) for k in rows[0]}
    if any(len(s["state"]) != len(state) for s in saved):
        raise CohortUnsupported("the members' optimizers have taken different steps")
    into.state.clear()
    into.state.update(state)
    into.param_groups[0].update(
        {k: copy.deepcopy(v) for k, v in groups[0].items() if k != "params"}
    )
    return into


def _stack_entry(values: list[Any], p: torch.Tensor, have: Any) -> Any:
    """One entry of stacked parameter `p`'s optimizer state from the members' `values`:
    buffers stacked (into `have`, the kept entry, where it has their shape; else in p's memory
    layout, see _stacked, where they are rows of p), a step count kept where all agree."""
    first = values[0]
    with torch.no_grad():
        if isinstance(first, torch.Tensor) and first.dim():
            shape = (len(values), *first.shape)
            out = None
            if isinstance(have, torch.Tensor) and have.shape == shape:
                out = have
            elif p.shape == shape:
                out = torch.empty_like(p)
            return torch.stack(values, out=out)
        if not all(bool(v == first) for v in values):
            raise CohortUnsupported("the members' optimizers count different steps")
        if not isinstance(first, torch.Tensor):
            return first
        if isinstance(have, torch.Tensor) and have.shape == first.shape:
            return have.copy_(first)
        return first.clone()


def _unstack_state(name: str, stacked: ClientAlgorithm, members: Sequence[ClientAlgorithm]) -> None:
    """Each member (row i of the stack) gets its share of the stacked attribute `name`: its
    rows of a stacked module or optimizer, copied into new tensors (`_Copies`: one call for all
    members), or its value. A copy is laid out as its row (channels_last where the member's
    own tensor was): a linear weight (and its momentum) as the stack holds it, transposed, so
    that neither this copy nor the next round's stacking transposes (a third of a batched
    round of 100 mlps on the CPU did).

    New tensors, not its own overwritten: what a member held before the round stays as it was,
    so a node's state before the round (`ClientNode.begin`) needs no copy of its own."""
    value, n = getattr(stacked, name), len(members)
    copies = _Copies()
    stacked_params: dict[str, nn.Parameter] | None = None  # a stacked module's, read once
    for i, a in enumerate(members):
        own = getattr(a, name)
        if value is None:
            setattr(a, name, None)
        elif isinstance(value, nn.Module):
            spec = getattr(value, SPEC_ATTR)
            if isinstance(own, nn.Module) and getattr(own, SPEC_ATTR, None) == spec:
                if stacked_params is None:
                    stacked_params = dict(value.named_parameters())
                for k, p in own.named_parameters():
                    # the same Parameter (its optimizer's), new memory
                    copies.add(p, copies.row(stacked_params[k], i), partial(_rebind, p))
            else:
                saved = {"__module__": spec.to_json(), "weights": unstack_module(value, i)}
                setattr(a, name, a._decode(own, saved))
        elif isinstance(value, torch.optim.Optimizer):
            if not isinstance(own, torch.optim.Optimizer):
                module = getattr(a, _owner(value, stacked))
                own = cast(Any, type(value))(list(module.parameters()))
                setattr(a, name, own)
            _unstack_optimizer(value, own, i, n, copies)
        elif isinstance(value, PerMember):
            setattr(a, name, value[i])
        else:
            setattr(a, name, copy.deepcopy(value))
    copies.make()


def _rebind(p: nn.Parameter, t: torch.Tensor) -> None:
    p.data = t


class _Copies:
    """New tensors for the members, copied from rows of stacked tensors: each stacked tensor's
    rows taken once (one `unbind`), and every copy made in one call per memory layout
    (`codec.clones`), where a new tensor and a row per member and tensor took two calls each."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._todo: dict[torch.memory_format, list[tuple[torch.Tensor, Callable[..., None]]]] = {}

    def row(self, stacked: torch.Tensor, i: int) -> torch.Tensor:
        """Row i of `stacked` (a view)."""
        if id(stacked) not in self._rows:  # the tensor is kept with its rows: ids stay unique
            with torch.no_grad():
                self._rows[id(stacked)] = (stacked, stacked.unbind(0))
        return self._rows[id(stacked)][1][i]

    def add(
        self, like: torch.Tensor, src: torch.Tensor, put: Callable[[torch.Tensor], None]
    ) -> None:
        """Copy `src` into a new tensor and hand it to `put` (at `make`): channels_last where
        `like` is, otherwise laid out as `src` (`torch.preserve_format`: a stack's row is
        dense, contiguous or a linear weight's transposed layout)."""
        layout = torch.preserve_format
        if (  # (a 4-D tensor both ways, 1×1 images or one channel, is taken as contiguous)
            like.dim() == 4
            and not like.is_contiguous()
            and like.is_contiguous(memory_format=torch.channels_last)
        ):
            layout = torch.channels_last
        self._todo.setdefault(layout, []).append((src, put))

    def make(self) -> None:
        with torch.no_grad():
            for layout, todo in self._todo.items():
                made = clones([src for src, _ in todo], layout)
                for (_, put), t in zip(todo, made, strict=True):
                    put(t)
        self._todo.clear()


def _unstack_optimizer(
    stacked: torch.optim.Optimizer,
    own: torch.optim.Optimizer,
    i: int,
    n: int,
    copies: _Copies,
) -> None:
    """Member i's settings and state of a stacked optimizer into its own (its tensors new ones,
    in its parameters' layout, made by `copies`)."""
    for group, mine in zip(stacked.param_groups, own.param_groups, strict=True):
        mine.update({k: v for k, v in group.items() if k != "params"})
        for sp, op in zip(group["params"], mine["params"], strict=True):
            state, kept = stacked.state.get(sp, {}), own.state[op]
            for k in [k for k in kept if k not in state]:
                del kept[k]
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() and len(v) == n:
                    old = kept.get(k)
                    like = old if isinstance(old, torch.Tensor) and old.shape == v.shape[1:] else op
                    if like.shape == v.shape[1:]:
                        copies.add(like, copies.row(v, i), partial(kept.__setitem__, k))
                    else:
                        kept[k] = v[i].clone()
                else:
                    kept[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _stack_models(
    models: Sequence[Mapping[str, WireModel]], device: torch.device
) -> dict[str, WireModel]:
    """The members' incoming models, each tensor as rows (row i = member i's; read-only). A
    tensor every member shares (a round's global model, the same for all) is not copied once
    per member: it goes to `device` once and its rows are a view of it (stacking 100 copies
    of a global mlp on the host was most of a batched round's host time on an H100)."""
    names = set(models[0])
    if any(set(m) != names for m in models):
        raise CohortUnsupported("the members' tasks carry different models")
    out = {}
    for name in names:
        wires = [m[name] for m in models]
        if any(
            w.spec != wires[0].spec or w.weights.keys() != wires[0].weights.keys() for w in wires
        ):
            raise CohortUnsupported(f"the members' {name!r} models differ in architecture")
        rows = {}
        for k, first in wires[0].weights.items():
            if all(w.weights[k] is first for w in wires):
                rows[k] = first.to(device).expand(len(wires), *first.shape)
            else:
                rows[k] = torch.stack([w.weights[k] for w in wires])
        out[name] = WireModel(wires[0].spec, rows)
    return out


def _row(value: Any, i: int, n: int) -> Any:
    """Member i's share of a stacked fit's output value: a list holds one per member (what
    `data.n_train` and `trainer.run` give in a cohort); anything else is everyone's."""
    if isinstance(value, list) and len(value) == n:
        return value[i]
    return value  # the same for every member (a constant, a setting)


def _split_result(result: FitResult, n: int) -> list[FitResult]:
    rows = {
        name: {k: v.unbind(0) for k, v in w.weights.items()} for name, w in result.models.items()
    }
    return [
        FitResult(
            models={
                name: WireModel(w.spec, {k: v[i] for k, v in rows[name].items()})
                for name, w in result.models.items()
            },
            metrics={k: _row(v, i, n) for k, v in result.metrics.items()},
            n_samples=int(_row(result.n_samples, i, n)),
            details={k: _row(v, i, n) for k, v in result.details.items()},
        )
        for i in range(n)
    ]


def _refill(
    stacked: ClientAlgorithm, members: Sequence[ClientAlgorithm], masked: bool | None
) -> bool:
    """Ready a kept stack for the members' next fit: everything per round started afresh but
    for the algorithm's `restarted` attributes, and its persistent state kept for
    `_stack_state` to write theirs into. False where the stack no longer fits them (another
    config, context or trainer): a new one is built."""
    first, ctx = members[0], cast(CohortContext, stacked.ctx)
    trainer = cast(CohortTrainer, ctx.trainer)
    if (
        first.config != stacked.config
        or trainer.masked != (trainer.graphs if masked is None else masked)
        or any(c is not a.ctx for c, a in zip(ctx.members, members, strict=True))
        or any(t is not a.ctx.trainer for t, a in zip(trainer.members, members, strict=True))
    ):
        return False
    cls = type(first)
    kept = {"ctx", *cls.persistent, *cls.restarted}
    for name in [n for n in vars(stacked) if n not in kept]:
        delattr(stacked, name)
    ctx.task = first.ctx.task
    ctx.data = StackedData.of([a.ctx.data for a in members])
    ClientAlgorithm.__init__(stacked, ctx, first.config)
    return True


def run_stacked(
    algos: Sequence[ClientAlgorithm],
    phase: str,
    round_: int,
    rounds: int,
    models: Sequence[Mapping[str, WireModel]],
    *,
    masked: bool | None = None,
    kept: KeptStacks | None = None,
) -> list[FitResult]:
    """Run the `phase` ("fit", "evaluate" or "finalize") of all `algos` (same class, config and
    architecture) once, on stacked state, then give every member its row back (results in the
    order of `algos`). Raises CohortUnsupported, or the stacked phase's error, with every member
    as it was. `masked`: see CohortTrainer (default: on CUDA). `kept`: where a fit's stack is
    kept for the same members' next fit, and taken from, refilled in place (a fleet keeps its
    stacks where its trainer captures CUDA graphs, whose captured step the stack keeps too);
    None: a stack built for this call alone."""
    first = algos[0]
    cls = type(first)
    if not cls.stackable:
        raise CohortUnsupported(f"{cls.name} does not train stacked")
    # Longest epochs first: then the members still training at any step are a prefix.
    order = sorted(range(len(algos)), key=lambda i: -algos[i].ctx.data.n_train)
    members = [algos[i] for i in order]
    keep = kept if phase == "fit" else None
    stacked = keep.take(members) if keep is not None else None
    if stacked is None or not _refill(stacked, members, masked):
        ctx = _cohort_context([a.ctx for a in members], first.ctx.task, masked)
        stacked = cls.__new__(cls)
        ClientAlgorithm.__init__(stacked, ctx, first.config)
    for name in cls.persistent:  # into a kept stack's own tensors, where they fit
        setattr(stacked, name, _stack_state(name, members, stacked, vars(stacked).get(name)))
    incoming = _stack_models([models[i] for i in order], first.ctx.device)
    positions = _positions(members)
    try:
        if phase == "fit":
            result = stacked.train_round(round_, rounds, incoming)
        elif phase == "evaluate":
            result = FitResult(metrics=stacked.evaluate(incoming))
        else:
            result = stacked.finish(round_, rounds, incoming)
    except BaseException:
        _rewind(members, positions)  # as if nothing had run
        raise
    # Evaluation changes no state but what the algorithm says it keeps.
    for name in cls.evaluation_keeps if phase == "evaluate" else cls.persistent:
        _unstack_state(name, stacked, members)
    if keep is not None:
        keep.put(members, stacked)
    rows = _split_result(result, len(members))
    tuned: list[Candidate | None] = [None] * len(members)
    if phase == "finalize" and all(a.deployment.finetunes for a in members):
        tuned = _finetuned_rows(stacked, members, rounds, incoming)
    scores: list[dict[str, Score] | None] = [None] * len(members)
    if phase == "fit" and all(a.deployment.guarded and a.deployment.guard.active for a in members):
        scores = _guard_scores(stacked)
    out: list[FitResult] = [rows[0]] * len(algos)
    for a, row, i, t, sc in zip(members, rows, order, tuned, scores, strict=True):
        # What `fit` and `finalize` do after the stacked part, member by member (the guard).
        if phase == "fit":
            a.deployment.after_fit(round_, sc)
        elif phase == "finalize":
            row = a.deployment.after_finish(rounds, models[i], row, tuned=t)
        out[i] = row
    return out


def _positions(members: Sequence[ClientAlgorithm]) -> list[tuple[Any, int]]:
    """Each member's random stream and count of samples trained: what `_rewind` restores."""
    return [(a.ctx.trainer.rng_state(), a.ctx.trainer.samples) for a in members]


def _rewind(members: Sequence[ClientAlgorithm], positions: list[tuple[Any, int]]) -> None:
    """Every member's trainer back where `_positions` found it: as if nothing had run."""
    for a, (rng, samples) in zip(members, positions, strict=True):
        a.ctx.trainer.set_rng_state(rng)
        a.ctx.trainer.samples = samples


def _guard_scores(stacked: ClientAlgorithm) -> list[dict[str, Score] | None]:
    """What every member's guard scores after a fit, each candidate once for the whole stack:
    per member and candidate, the validation samples it gets right and its mean loss."""
    trainer, data = cast(CohortTrainer, stacked.ctx.trainer), stacked.ctx.data
    out: list[dict[str, Score] | None] = [{} for _ in range(trainer.size)]
    for name, (_, model) in stacked.guard_candidates().items():
        for member, score in zip(out, trainer.scores(model, data.x_val, data.y_val), strict=True):
            assert member is not None
            member[name] = score
    return out


def _finetuned_rows(
    stacked: ClientAlgorithm,
    members: Sequence[ClientAlgorithm],
    rounds: int,
    models: Mapping[str, WireModel],
) -> list[Candidate | None]:
    """The guards' fine-tuning of the federation's final model for every member at once (each
    member's batches from its own generator, as alone), one model per member; None for every
    member when it does not stack (each then trains its own, from the same random state)."""
    none: list[Candidate | None] = [None] * len(members)
    positions = _positions(members)
    try:
        tuned = stacked.deployment.finetune(rounds, models)
    except (CohortUnsupported, FloatingPointError) as exc:
        _rewind(members, positions)
        log.info("the guards' fine-tuning runs client by client: %s", exc)
        return none
    if tuned is None:
        return none
    spec, model = tuned
    return [
        (spec, a.ctx.materialize(WireModel(spec, unstack_module(model, k))))
        for k, a in enumerate(members)
    ]
