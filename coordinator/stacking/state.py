"""An algorithm's state stacked for its members and given back: modules, optimizers (their
momentum laid out as the stacked parameters), equal plain values, `PerMember` values, and the
incoming models of a stacked phase.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from coordinator.stacking.modules import stack_modules, unstack_module
from edge_sdk.algorithms.base import (
    SPEC_ATTR,
    ClientAlgorithm,
)
from edge_sdk.algorithms.members import CohortUnsupported, PerMember
from edge_sdk.codec import WireModel, clones

__all__ = ["stack_models", "stack_state", "state_kind", "unstack_state"]


# -- stacking and unstacking algorithm state ---------------------------------------------------
def stack_state(
    name: str, members: Sequence[ClientAlgorithm], stacked: ClientAlgorithm, into: Any = None
) -> Any:
    """The members' persistent attribute `name` as one value of the stacked algorithm: modules
    and optimizers stacked (written into `into`, a kept stack's own, where it fits); plain
    values (numbers, None, lists, ArchSpecs...) as one value where every member holds an equal
    one, else as a `PerMember` list, one value per member (PersFL's teacher's round)."""
    values = [getattr(a, name) for a in members]
    first = values[0]
    if all(v is None for v in values):
        return None
    if all(isinstance(v, nn.Module) for v in values):
        return stack_modules(values, into if isinstance(into, nn.Module) else None)
    if all(isinstance(v, torch.optim.Optimizer) for v in values):
        module = getattr(stacked, _owner(first, members[0]))
        kept = into if isinstance(into, torch.optim.Optimizer) else None
        return _stack_optimizer(values, list(module.parameters()), kept)
    if not any(isinstance(v, nn.Module | torch.optim.Optimizer | torch.Tensor) for v in values):
        return copy.deepcopy(first if _equal(values) else PerMember(values))
    raise CohortUnsupported(f"the members' {name!r} differ in kind or hold what cannot stack")


def state_kind(algo: ClientAlgorithm) -> tuple[str, ...]:
    """What `stack_state` needs alike of the members of one stack, per persistent attribute: a
    module's architecture, an optimizer, a tensor, or a plain value (None included). Members
    of a population that never trained (no meme, no optimizer yet) and those that did stack
    apart, not client by client."""

    def kind(v: Any) -> str:
        if isinstance(v, nn.Module):
            spec = getattr(v, SPEC_ATTR, None)
            return f"module {type(v).__name__} {spec.to_json() if spec is not None else ''}"
        if isinstance(v, torch.optim.Optimizer):
            return f"optimizer {type(v).__name__}"
        return "tensor" if isinstance(v, torch.Tensor) else "plain"

    return tuple(kind(getattr(algo, name)) for name in type(algo).persistent)


def _equal(values: Sequence[Any]) -> bool:
    """Whether plain values are all equal (where comparing them says so plainly)."""
    try:
        return all(bool(v == values[0]) for v in values)
    except (RuntimeError, TypeError, ValueError):
        return False


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
    layout, see modules.stack_rows, where they are rows of p), a step count kept where all agree."""
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


def unstack_state(name: str, stacked: ClientAlgorithm, members: Sequence[ClientAlgorithm]) -> None:
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


def stack_models(
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
