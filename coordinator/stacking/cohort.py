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

Any algorithm is tried but one whose clients read each other's models (`exchanges_models`);
`Stacking` checks one from outside the SDK against one client alone the first time. Its `fit`
stacks when it uses only what a CohortContext provides
(`ctx.build_model` / `ctx.materialize`, the trainer's batches, `run`, `step`,
`value_and_grad`, `evaluate`, elementwise updates, `data.n_train`) and takes no branch per
client on a value that differs between them (`PerMember` refuses it): a decision per client is
applied row by row (FML's and FedMe's gates weigh each member's loss, FedMe's members adopt
their exchanged model's rows, PersFL's members keep the rows of the teacher each chose), and a
persistent plain value that differs between members (PersFL's teacher's round) is held as a
PerMember list. Whatever cannot stack
(models with buffers such as batch norm, dropout, members whose state differs in kind, Adam with
unequal step counts) runs client by client, from the same state and random generators, so the
result does not depend on the path; the log says why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from coordinator.stacking.kept import KeptStacks
from coordinator.stacking.modules import stack_modules, stack_rows, unstack_module
from coordinator.stacking.stacked_data import Packed, StackedData
from coordinator.stacking.state import stack_models, stack_state, unstack_state
from coordinator.stacking.trainer import CohortTrainer
from edge_sdk.algorithms.base import (
    SPEC_ATTR,
    Candidate,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    TaskInfo,
)
from edge_sdk.algorithms.deployment import Final
from edge_sdk.algorithms.members import CohortUnsupported
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Score
from model_zoo import ArchSpec, build
from model_zoo.models.mixture import Mixture

__all__ = ["CohortContext", "run_stacked"]

log = logging.getLogger(__name__)


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
        return stack_rows(template, rows)


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
    """Ready a kept stack for the members' next fit, as a device's algorithm is between its
    rounds: its attributes kept (the optimizers a round restarts in place, `fresh_optimizer`,
    and the persistent state `stack_state` writes the members' into), its context's task and
    data the members' new ones. False where the stack no longer fits them (another config,
    context or trainer): a new one is built."""
    first, ctx = members[0], cast(CohortContext, stacked.ctx)
    trainer = cast(CohortTrainer, ctx.trainer)
    if (
        first.config != stacked.config
        or trainer.masked != (trainer.graphs if masked is None else masked)
        or any(c is not a.ctx for c, a in zip(ctx.members, members, strict=True))
        or any(t is not a.ctx.trainer for t, a in zip(trainer.members, members, strict=True))
    ):
        return False
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
    if cls.exchanges_models:
        raise CohortUnsupported(f"{cls.name}'s clients read each other's models during a round")
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
        setattr(stacked, name, stack_state(name, members, stacked, vars(stacked).get(name)))
    incoming = stack_models([models[i] for i in order], first.ctx.device)
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
        unstack_state(name, stacked, members)
    if keep is not None:
        keep.put(members, stacked)
    rows = _split_result(result, len(members))
    finals: list[Final | None] = [None] * len(members)
    students: list[list[Candidate]] = [[] for _ in members]
    if phase == "finalize" and all(a.deployment.finetunes for a in members):
        tuned = _finetuned_rows(stacked, members, rounds, incoming)
        if None not in tuned:
            finals = [
                a.deployment.final_candidates(rounds, models[i], t)
                for a, i, t in zip(members, order, tuned, strict=True)
            ]
            students = _student_rows(
                members, rounds, cast(list[Final], finals), [models[i] for i in order], masked
            )
    scores: list[dict[str, Score] | None] = [None] * len(members)
    if phase == "fit" and all(a.deployment.guarded and a.deployment.guard.active for a in members):
        scores = _guard_scores(stacked)
    out: list[FitResult] = [rows[0]] * len(algos)
    for a, row, i, f, sc, made in zip(members, rows, order, finals, scores, students, strict=True):
        # What `fit` and `finalize` do after the stacked part, member by member (the guard).
        if phase == "fit":
            a.deployment.after_fit(round_, sc)
        elif phase == "finalize":
            row = a.deployment.after_finish(rounds, models[i], row, final=f, students=made)
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


def _student_rows(
    members: Sequence[ClientAlgorithm],
    rounds: int,
    finals: Sequence[Final],
    models: Sequence[Mapping[str, WireModel]],
    masked: bool | None,
) -> list[list[Candidate]]:
    """The first students each member's guard asks for among its `finals` (on its training
    split and the inputs its finalize `models` carry, `Deployment.distillation_set`)
    (`Deployment.first_student`: of a default
    outside the device's budget, or of a model outside it that is clearly better, one from the
    device's model and one afresh), trained at once for the members that ask for the same kind
    (the teacher's architecture, the start's, the students' epochs: `Deployment.distil_epochs`),
    each member's batches and shifts from its own
    generator, as alone. [] for a member that asks for none, or whose stack does not train:
    its guard then trains its own, from the same random state.

    A student is most of what a finalize costs: 40 epochs of 4 views against the guard's 5
    epochs of fine-tuning, on every device whose default is a mixture."""
    out: list[list[Candidate]] = [[] for _ in members]
    asked: dict[Any, list[int]] = {}
    requests: list[tuple[Candidate, Candidate | None] | None] = []
    sets: list[list[torch.Tensor | None]] = []
    for k, (a, (final, _), m) in enumerate(zip(members, finals, models, strict=True)):
        request = a.deployment.first_student(rounds, final)
        requests.append(request)
        sets.append(a.deployment.learns_on(a.deployment.unlabeled(m)) if request else [])
        if request is not None:
            (spec, _), start = request
            n = len(a.ctx.data.y_train)
            kind = (
                spec.model_dump_json(),
                None if start is None else start[0].model_dump_json(),
                # one student each, or two to choose from, and their epochs
                tuple(
                    (u is None, a.deployment.distil_epochs(n + (0 if u is None else len(u))))
                    for u in sets[k]
                ),
            )
            asked.setdefault(kind, []).append(k)
    for ks in asked.values():
        if len(ks) < 2:
            continue  # (alone it trains as fast)
        group = [members[k] for k in ks]
        positions = _positions(group)
        try:
            made = _students_at_once(
                group, rounds, [requests[k] for k in ks], [sets[k] for k in ks], masked
            )
        except CohortUnsupported as exc:
            made = None
            log.info("the guards' students run client by client: %s", exc)
        if made is None:
            _rewind(group, positions)
            continue
        for k, rows in zip(ks, made, strict=True):
            out[k] = rows
    return out


def _students_at_once(
    group: Sequence[ClientAlgorithm],
    rounds: int,
    requests: Sequence[tuple[Candidate, Candidate | None] | None],
    learns_on: Sequence[Sequence[torch.Tensor | None]],
    masked: bool | None,
) -> list[list[Candidate]] | None:
    """The students `requests` (teacher, start) ask for, of every member of `group` at once,
    in the order its guard makes them: from the start (where there is one, and the guard has
    validation data to choose between two), then afresh; None where one diverged. Each is
    trained once per entry of the member's `learns_on` (`Deployment.learns_on`: as many for
    every member), each time from the same random state, and of two its `Deployment.either`
    keeps one, as alone."""
    first = group[0]
    cls = type(first)
    stacked = cls.__new__(cls)
    ClientAlgorithm.__init__(
        stacked, _cohort_context([a.ctx for a in group], first.ctx.task, masked), first.config
    )
    asked = [cast(tuple[Candidate, Candidate | None], r) for r in requests]
    # each member's images and labels, as alone (its teacher labels the inputs its task carries)
    inputs, epochs = [], []
    for j in range(len(learns_on[0])):
        sets = [
            a.deployment.distillation_set(t, u[j])
            for a, (t, _), u in zip(group, asked, learns_on, strict=True)
        ]
        inputs.append((Packed([x for x, _ in sets]), Packed([y for _, y in sets])))
        epochs.append(first.deployment.distil_epochs(len(sets[0][1])))  # every member's
    teacher = _stacked_candidate([t for t, _ in asked])
    begins = [s for _, s in asked]
    starts: list[Candidate | None] = [None]
    if begins[0] is not None:
        begin = _stacked_candidate(cast(list[Candidate], begins))
        starts = [begin, None] if first.deployment.guard.active else [begin]
    made: list[list[Candidate]] = [[] for _ in group]
    for start in starts:
        states = [a.ctx.trainer.rng_state() for a in group]
        students: list[list[Candidate]] = [[] for _ in group]
        for j, xy in enumerate(inputs):
            if j:  # every student of this start from the same random state
                for a, state in zip(group, states, strict=True):
                    a.ctx.trainer.set_rng_state(state)
            student = stacked.deployment.distil(rounds, teacher, start, cast(Any, xy), epochs[j])
            if student is None:
                return None
            spec, model = student
            for k, a in enumerate(group):
                built = a.ctx.materialize(WireModel(spec, unstack_module(model, k)))
                students[k].append((spec, built))
        for k, a in enumerate(group):
            chosen = students[k][0] if len(students[k]) == 1 else a.deployment.either(*students[k])
            assert chosen is not None  # (neither diverged)
            made[k].append(chosen)
    return made


def _stacked_candidate(candidates: Sequence[Candidate]) -> Candidate:
    """The members' candidates (of one spec) as one stacked model; a mixture as the mixture of
    its stacked members (CohortUnsupported where they do not stack)."""
    spec, model = candidates[0]
    if isinstance(model, Mixture):
        members = [
            stack_modules([cast(Mixture, m).members[j] for _, m in candidates])
            for j in range(len(model.members))
        ]
        mixed = Mixture(members, list(spec.kwargs["weights"]))
        return spec, mixed.to(model.log_weights.device)
    return spec, stack_modules([m for _, m in candidates])


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
