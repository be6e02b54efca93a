"""The cohort executor: simulated clients of one architecture train as one stacked model.

A simulation runs many EdgeClients in one process. Each would run its algorithm's ~100 tiny
torch ops per step on its own; here the clients that have a fit task at the same time run their
algorithm's `fit` **once**, on models whose parameters carry a leading client dimension
(`torch.func.vmap` over `functional_call`), so every op runs once for all of them. The shared
losses give one value per client for stacked logits; no client's loss depends on another's
parameters, so the gradient of their sum holds each client's own gradient in its row, and the
algorithm's update rule, written once, applies row by row.

Nothing is forked: the algorithm's own `fit` runs, on a `CohortContext` whose trainer draws each
client's batch from that client's own generator and data and whose `build_model` builds each
client's model with its own seed. Every
message still crosses the transport: each EdgeClient decodes its own task and encodes its own
reply; only the compute in between is shared. Before the stacked fit each member's persistent
state is stacked, after it each member gets its row back, so evaluation, persistence, rollback
and ONNX export stay per client.

An algorithm opts in with `stackable = True` (its `fit` uses only what a CohortContext provides:
`ctx.build_model` / `ctx.materialize`, `trainer.sample_batch`, `trainer.value_and_grad`,
`trainer.average`, elementwise updates, `data.n_train`). Whatever cannot stack (models with
buffers or dropout, members whose state differs in kind, unequal batch sizes) runs client by
client, from the same state and random generators, so the result does not depend on the path.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, vmap

from edge_sdk.algorithms.base import (
    SPEC_ATTR,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    TaskInfo,
)
from edge_sdk.codec import WireModel
from edge_sdk.trainer import ClientData, Trainer
from model_zoo import ArchSpec, build

__all__ = ["Cohort", "CohortUnsupported", "stack_modules", "unstack_module"]

log = logging.getLogger(__name__)

# After the last member with a task in hand has submitted, wait this long for more to arrive
# (tasks reach the client threads one after another) before the stacked fit starts.
SETTLE_S = 0.02
# Never wait longer than this for a member that announced a task but has not submitted it.
MAX_WAIT_S = 2.0


class CohortUnsupported(ValueError):
    """This group cannot train stacked (its members then train one by one)."""


# -- stacked modules ---------------------------------------------------------------------------
_TEMPLATE = "_edgefl_template"  # the meta-device copy whose forward each row runs


class _Stacked(nn.Module):
    """Mixed into a model's own class: parameters with a leading client dimension, and a
    forward that runs the original forward once per row (vmapped)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        template = getattr(self, _TEMPLATE)
        params: dict[str, torch.Tensor] = dict(self.named_parameters())

        def one(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return cast(torch.Tensor, functional_call(template, p, (xi,)))

        return cast(torch.Tensor, vmap(one)(params, x))

    def train(self, mode: bool = True) -> _Stacked:
        getattr(self, _TEMPLATE).train(mode)
        return cast(_Stacked, super().train(mode))


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


def stack_modules(modules: Sequence[nn.Module]) -> nn.Module:
    """One module whose every parameter is the members' parameters stacked (row i = member i),
    with the same parameter names, so that `state_dict()` / `load_state_dict()` take stacked
    tensors under the usual keys. Its forward takes inputs with the same leading dimension."""
    first = modules[0]
    spec = getattr(first, SPEC_ATTR, None)
    if any(getattr(m, SPEC_ATTR, None) != spec or type(m) is not type(first) for m in modules):
        raise CohortUnsupported("the members' models differ in architecture")
    rows = {
        name: torch.stack([m.get_parameter(name).detach() for m in modules])
        for name, _ in first.named_parameters()
    }
    return _stacked(first, rows)


def _stacked(template: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Module:
    """A copy of `template` whose parameters are `params` (stacked rows, under the template's
    names) and whose forward runs the template's once per row."""
    _check_stackable(template)
    shell = copy.deepcopy(template)
    meta = copy.deepcopy(template).to("meta")
    for name, p in template.named_parameters():
        owner, _, leaf = name.rpartition(".")
        stacked = nn.Parameter(params[name], requires_grad=p.requires_grad)
        setattr(shell.get_submodule(owner), leaf, stacked)
    shell.__class__ = _stacked_class(type(template))
    object.__setattr__(shell, _TEMPLATE, meta)  # not a submodule: no parameters, no state
    meta.train(template.training)
    setattr(shell, SPEC_ATTR, getattr(template, SPEC_ATTR, None))
    return shell


def unstack_module(stacked: nn.Module, i: int) -> dict[str, torch.Tensor]:
    """Row `i` of a stacked module's state (views)."""
    return {k: v[i] for k, v in stacked.state_dict().items()}


# -- what a stacked fit sees -------------------------------------------------------------------
class _StackedData(ClientData):
    """The members' training data side by side (lists, one tensor per member)."""

    def __post_init__(self) -> None:  # rows are per member: nothing to check across them
        pass

    @property
    def n_train(self) -> Any:  # one count per member
        return [len(y) for y in cast(list[torch.Tensor], self.y_train)]


class CohortTrainer(Trainer):
    """A Trainer over stacked models: each member's batch from its own generator and data,
    averages per member (value_and_grad is Trainer's: the losses give one value per row)."""

    def __init__(self, members: Sequence[Trainer]) -> None:
        first = members[0]
        self.device = first.device
        self.generator = first.generator  # unused: each member draws from its own
        self.amp = first.amp
        self._amp_dtype = first._amp_dtype
        self._scaler = None
        if first._scaler is not None:
            raise CohortUnsupported("fp16 loss scaling is per client")
        self.members = list(members)

    def sample_batch(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = cast(list[torch.Tensor], x), cast(list[torch.Tensor], y)
        sizes = {min(batch_size, len(yi)) for yi in ys}
        if len(sizes) > 1:
            raise CohortUnsupported(f"the members' batches differ in size ({sorted(sizes)})")
        picks = [
            t.sample_batch(xi, yi, batch_size)
            for t, xi, yi in zip(self.members, xs, ys, strict=True)
        ]
        return torch.stack([p[0] for p in picks]), torch.stack([p[1] for p in picks])

    def batches(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> Any:
        raise CohortUnsupported("epoch batches are not stacked yet")

    def average(self, values: Sequence[torch.Tensor]) -> Any:
        """One mean per member, as Trainer.average takes it for one client."""
        rows = torch.stack(list(values)).tolist() if values else [[0.0] * len(self.members)]
        return [sum(col) / max(1, len(values)) for col in zip(*rows, strict=True)]


@dataclass
class CohortContext(ClientContext):
    """The context of a stacked fit: its models are built per member and stacked."""

    members: list[ClientContext] = field(default_factory=list)

    def build_model(self, spec: ArchSpec, salt: int) -> nn.Module:
        return stack_modules([c.build_model(spec, salt) for c in self.members])

    def materialize(self, model: WireModel) -> nn.Module:
        template = build(model.spec)
        setattr(template, SPEC_ATTR, model.spec)
        rows = {
            name: model.weights[name].to(self.device, copy=True)
            for name, _ in template.named_parameters()
        }
        return _stacked(template, rows)


def _cohort_context(members: Sequence[ClientContext], task: TaskInfo) -> CohortContext:
    first = members[0]
    data = _StackedData(
        x_train=cast(torch.Tensor, [c.data.x_train for c in members]),
        y_train=cast(torch.Tensor, [c.data.y_train for c in members]),
        x_val=first.data.x_val[:0],
        y_val=first.data.y_val[:0],
        x_test=first.data.x_test[:0],
        y_test=first.data.y_test[:0],
        num_classes=first.data.num_classes,
    )
    return CohortContext(
        client_id="+".join(c.client_id for c in members),
        spec=first.spec,
        data=data,
        device=first.device,
        seed=first.seed,
        trainer=CohortTrainer([c.trainer for c in members]),
        peers=None,
        task=task,
        members=list(members),
    )


# -- stacking and unstacking algorithm state ---------------------------------------------------
def _stack_state(value: list[Any]) -> Any:
    if all(v is None for v in value):
        return None
    if all(isinstance(v, nn.Module) for v in value):
        return stack_modules(value)
    raise CohortUnsupported("the members' states differ in kind or hold what cannot stack")


def _stack_models(models: Sequence[Mapping[str, WireModel]]) -> dict[str, WireModel]:
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
        out[name] = WireModel(
            wires[0].spec, {k: torch.stack([w.weights[k] for w in wires]) for k in wires[0].weights}
        )
    return out


def _row(value: Any, i: int, n: int) -> Any:
    """Member i's share of a stacked fit's output value: a list holds one per member (what
    `data.n_train` and `trainer.average` give in a cohort); anything else is everyone's."""
    if isinstance(value, list) and len(value) == n:
        return value[i]
    return value  # the same for every member (a constant, a setting)


def _split_result(result: FitResult, n: int) -> list[FitResult]:
    return [
        FitResult(
            models={
                name: WireModel(w.spec, {k: v[i] for k, v in w.weights.items()})
                for name, w in result.models.items()
            },
            metrics={k: _row(v, i, n) for k, v in result.metrics.items()},
            n_samples=int(_row(result.n_samples, i, n)),
            details={k: _row(v, i, n) for k, v in result.details.items()},
        )
        for i in range(n)
    ]


def fit_stacked(
    algos: Sequence[ClientAlgorithm],
    round_: int,
    rounds: int,
    models: Sequence[Mapping[str, WireModel]],
) -> list[FitResult]:
    """Run `fit` once for all `algos` (same class, config and architecture) on stacked state,
    then give every member its row back. Raises CohortUnsupported before changing anything."""
    first = algos[0]
    cls = type(first)
    if not cls.stackable:
        raise CohortUnsupported(f"{cls.name} does not train stacked")
    ctx = _cohort_context([a.ctx for a in algos], first.ctx.task)
    stacked = cls.__new__(cls)
    ClientAlgorithm.__init__(stacked, ctx, first.config)
    for name in cls.persistent:
        setattr(stacked, name, _stack_state([getattr(a, name) for a in algos]))
    incoming = _stack_models(models)
    rngs = [(a.ctx.trainer.generator.get_state(), a.ctx.trainer.samples) for a in algos]
    try:
        result = stacked.train_round(round_, rounds, incoming)
    except BaseException:
        for a, (rng, samples) in zip(algos, rngs, strict=True):  # as if nothing had run
            a.ctx.trainer.generator.set_state(rng)
            a.ctx.trainer.samples = samples
        raise
    n = len(algos)
    for name in cls.persistent:
        value = getattr(stacked, name)
        for i, a in enumerate(algos):
            if value is None:
                setattr(a, name, None)
                continue
            spec = getattr(value, SPEC_ATTR)
            saved = {"__module__": spec.to_json(), "weights": unstack_module(value, i)}
            setattr(a, name, a._decode(getattr(a, name), saved))
    for a in algos:  # what `fit` does after `train_round`, member by member (the guard)
        a.after_fit(round_)
    return _split_result(result, n)


# -- the executor ------------------------------------------------------------------------------
@dataclass
class _Request:
    client_id: str
    algo: ClientAlgorithm
    round: int
    rounds: int
    models: Mapping[str, WireModel]
    done: threading.Event = field(default_factory=threading.Event)
    result: FitResult | None = None
    error: BaseException | None = None

    def key(self) -> tuple[Any, ...]:
        a = self.algo
        task = a.ctx.task
        state = tuple(_kind(getattr(a, n)) for n in type(a).persistent)
        return (
            type(a),
            a.config.model_dump_json(),
            a.ctx.spec.to_json(),
            self.round,
            self.rounds,
            task.step,
            json.dumps(dict(task.params), sort_keys=True, default=str),
            state,
            tuple((n, w.spec.to_json()) for n, w in sorted(self.models.items())),
        )


def _kind(value: Any) -> Any:
    if isinstance(value, nn.Module):
        spec = getattr(value, SPEC_ATTR, None)
        return spec.to_json() if spec is not None else type(value)
    return type(value)


class Cohort:
    """Batches the fit tasks of simulated clients that arrive together and trains each group
    of compatible ones (same algorithm, config, architecture, round, kind of state) stacked.

    Each EdgeClient calls `announce` when a fit task reaches it and `fit` once it has decoded
    the task. The first member to submit collects: once every member that announced a task has
    submitted it and none has arrived for `settle_s`, it runs the batch while the others wait
    for their rows. `gate` is the simulator's compute semaphore, the one its EdgeClients get as
    `compute_gate`: members call `fit` holding it (as for any task) and give it up while they
    wait, so that the others decode their tasks a few at a time (not a hundred threads at once,
    convoying on the interpreter lock); the collector takes it back to compute.
    """

    def __init__(
        self, gate: threading.Semaphore | None = None, *, settle_s: float = SETTLE_S
    ) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()  # something changed: the collector looks again
        self._announced: set[str] = set()
        self._pending: list[_Request] = []
        self._collecting = False
        self._changed = time.monotonic()
        self._gate = gate
        self._settle = settle_s
        self.batches: list[int] = []  # how many members each stacked fit trained

    def announce(self, client_id: str) -> None:
        with self._lock:
            self._announced.add(client_id)
            self._changed = time.monotonic()

    def withdraw(self, client_id: str) -> None:
        with self._lock:
            self._announced.discard(client_id)
            self._changed = time.monotonic()
        self._wake.set()

    def fit(
        self,
        client_id: str,
        algo: ClientAlgorithm,
        round_: int,
        rounds: int,
        models: Mapping[str, WireModel],
    ) -> FitResult:
        """This member's fit, run with whichever members submit theirs at the same time."""
        req = _Request(client_id, algo, round_, rounds, models)
        with self._lock:
            self._announced.add(client_id)
            self._pending.append(req)
            self._changed = time.monotonic()
            collect = not self._collecting
            self._collecting = True
        self._wake.set()
        held = False
        self._give_gate()
        try:
            if collect:
                batch = self._collect()
                self._take_gate()
                held = True
                self._run(batch)
            req.done.wait()
        finally:
            if not held:
                self._take_gate()  # the caller's `with` gives it back
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def _give_gate(self) -> None:
        if self._gate is not None:
            self._gate.release()

    def _take_gate(self) -> None:
        if self._gate is not None:
            self._gate.acquire()

    def _collect(self) -> list[_Request]:
        start = time.monotonic()
        while True:
            self._wake.clear()
            with self._lock:
                waiting = {r.client_id for r in self._pending}
                settled = time.monotonic() - self._changed >= self._settle
                if (self._announced <= waiting and settled) or (
                    time.monotonic() - start > MAX_WAIT_S
                ):
                    batch, self._pending, self._collecting = self._pending, [], False
                    return batch
            self._wake.wait(self._settle)

    def _run(self, batch: list[_Request]) -> None:
        groups: dict[tuple[Any, ...], list[_Request]] = {}
        for r in batch:
            groups.setdefault(r.key(), []).append(r)
        for group in groups.values():
            self._run_group(group)
        for r in batch:
            r.done.set()

    def _run_group(self, group: list[_Request]) -> None:
        if len(group) > 1:
            try:
                results = fit_stacked(
                    [r.algo for r in group],
                    group[0].round,
                    group[0].rounds,
                    [r.models for r in group],
                )
            except CohortUnsupported as exc:
                log.info("%d clients train one by one: %s", len(group), exc)
            except Exception as exc:  # each member gets its own error below
                log.info(
                    "a stacked fit failed (%s); its %d clients train one by one", exc, len(group)
                )
            else:
                self.batches.append(len(group))
                for r, res in zip(group, results, strict=True):
                    r.result = res
                return
        for r in group:
            try:
                r.result = r.algo.fit(r.round, r.rounds, r.models)
            except Exception as exc:  # that client's error, raised on its thread
                r.error = exc
