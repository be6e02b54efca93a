"""The device half of an algorithm: turns a task (round, incoming models) into a reply.

A ClientAlgorithm owns the client's private state (personalized model, auxiliary model, optimizer
momentum); `state_dict()` / `load_state_dict()` cover all of it (the attributes a class lists in
`persistent`, plus the trainer's random generator; `edge_sdk.algorithms.persistence`), so a
device that restarts continues where it left off. It never touches the network: the EdgeClient
decodes tasks, calls it, and encodes replies. Nor does it choose what the device deploys: its
`Deployment` (edge_sdk.algorithms.deployment) wraps it with the guard. Each algorithm is one file
in this package with a frozen config whose defaults come from `algorithms.md`, registered by
name; its server half lives in `coordinator/strategies/` under the same name and reads the same
config.

This module also re-exports what an algorithm's file needs from its neighbours: the configs
(`config`), the context and result types (`context`) and the registry (`registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

import torch
from torch import nn

from edge_sdk.algorithms.candidates import PERSONAL, Candidate
from edge_sdk.algorithms.config import AlgorithmConfig, BaseAlgorithmConfig
from edge_sdk.algorithms.context import (
    SPEC_ATTR,
    AlgorithmError,
    ClientContext,
    Detail,
    FitResult,
    TaskInfo,
)
from edge_sdk.algorithms.deployment import Deployment
from edge_sdk.algorithms.members import CohortUnsupported, PerMember, rows_taken, take_rows
from edge_sdk.algorithms.persistence import BASE_STATE, copied, decode, encode
from edge_sdk.algorithms.registry import algorithm_class, algorithm_names, register_algorithm
from edge_sdk.budget import footprint
from edge_sdk.codec import WireModel
from edge_sdk.optim_config import OptimConfig
from edge_sdk.trainer import EvalResult
from model_zoo import ArchSpec

# A model an algorithm holds (its architecture and module), None before it has one.
Held = tuple[ArchSpec | None, nn.Module | None]

__all__ = [
    "SPEC_ATTR",
    "AlgorithmConfig",
    "AlgorithmError",
    "BaseAlgorithmConfig",
    "ClientAlgorithm",
    "ClientContext",
    "Detail",
    "FitResult",
    "TaskInfo",
    "algorithm_class",
    "algorithm_names",
    "register_algorithm",
]


class ClientAlgorithm(ABC):
    """The device half of an algorithm.

    A subclass implements `train_round` (one round's local training), `trained_model` (the
    personalized model its training leads to) and, when it does more than evaluate after the
    last round, `finish`; it names the models the guard may choose from
    (`guard_candidates`, `finetune_base`, `finetune_optim`). Its `deployment` wraps it: `fit`
    and `finalize` are the algorithm's phases followed by the deployment's (the guard's look
    after a round, its choice after the last); `personalized_model` is what the client deploys.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type[BaseAlgorithmConfig]]
    # The attributes that hold this client's private state, in restore order (modules before
    # the optimizers that step them): modules built by `_build`/`_materialize`, optimizers,
    # tensors, ArchSpecs, WireModels, plain values, and dicts of any of these.
    persistent: ClassVar[tuple[str, ...]] = ()
    # The persistent attributes `evaluate` changes (FedMe keeps the model its task carries):
    # saved after an evaluation, as after a fit. Evaluation changes no other state.
    evaluation_keeps: ClassVar[tuple[str, ...]] = ()
    # Its clients exchange models with each other through `ctx.peers` (decentralized): a host
    # of many clients begins every task of a phase before any executes.
    exchanges_models: ClassVar[bool] = False

    def __init__(self, ctx: ClientContext, config: BaseAlgorithmConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.deployment = Deployment(self)  # the guard around this algorithm

    @property
    def partial_models(self) -> frozenset[str]:
        """Names of incoming models that may carry only a subset of their tensors."""
        return frozenset()

    def before_fit(self, round_: int, rounds: int) -> None:  # noqa: B027  (optional hook)
        """Called for every client of a fit step before any of them runs `fit` (the runtime
        that hosts many clients calls it for all first): what peers must see before this
        step starts goes out here (FedeRiCo publishes its model). Default: nothing."""

    # -- what a subclass implements ----------------------------------------------------------
    @abstractmethod
    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """Train locally for one round; return the models to send back."""

    @abstractmethod
    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        """The personalized model this algorithm's training leads to (before the guard)."""

    def finish(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """After the last round (fine-tuning, distillation...); default: final evaluation."""
        return FitResult(metrics=self.evaluate(models))

    def guard_candidates(self) -> dict[str, Candidate]:
        """The models this client could deploy now at no extra training, its personalized
        model first (as PERSONAL); the guard scores them after every round and at the end."""
        return {PERSONAL: self.trained_model()}

    # -- what the client runtime calls -------------------------------------------------------
    def fit(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """One round: `train_round`, then the guard's look at what it left."""
        result = self.train_round(round_, rounds, models)
        self.deployment.after_fit(round_)
        return result

    def finalize(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """`finish`, then the choice of the model to deploy (`Deployment.after_finish`)."""
        return self.deployment.after_finish(rounds, models, self.finish(round_, rounds, models))

    def personalized_model(self) -> tuple[ArchSpec, nn.Module]:
        """The model this client deploys (and exports to ONNX): the guard's choice after the
        last round, else the algorithm's own (`trained_model`)."""
        return self.deployment.model()

    # -- what the guard asks of the algorithm ------------------------------------------------
    def finetune_base(self, models: Mapping[str, WireModel]) -> Candidate | None:
        """The federation's final model, which the guard fine-tunes on this client's data as a
        candidate (a fresh copy: fine-tuning it changes nothing else). Default: the finalize
        task's global model, when it is whole and predicts this client's classes."""
        glob = self._full_global(models)
        return None if glob is None else (glob.spec, self._materialize(glob))

    def finetune_optim(self) -> OptimConfig | None:
        """How the guard fine-tunes and distils (at the last round's learning rate, as FedAvg+FT
        does): the algorithm's own optimizer settings where its config has them (an
        AlgorithmConfig); None, no fine-tuned candidate nor student, unless an algorithm with
        other settings says its own."""
        return self.config if isinstance(self.config, OptimConfig) else None

    def _full_global(self, models: Mapping[str, WireModel]) -> WireModel | None:
        """The task's global model when it is whole and predicts this client's classes."""
        glob = models.get("global")
        if (
            glob is None
            or "global" in self.partial_models
            or glob.spec.num_classes != self.ctx.data.num_classes
        ):
            return None
        return glob

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        """Personalized model on the client's own test split, and the global one if given."""
        _, model = self.personalized_model()
        out = self._scores("personal", model)
        glob = models.get("global")
        if glob is not None and glob.spec.num_classes == self.ctx.data.num_classes:
            out |= self._scores("global", self._materialize(glob))
        return out

    # -- persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything this client has learned, as tensors and plain values (no pickle)."""
        out: dict[str, Any] = {
            "__rng__": self.ctx.trainer.generator.get_state(),
            "__samples__": self.ctx.trainer.samples,
            "__guard__": encode(self.deployment.guard.state_dict(), f"{self.name}.guard"),
        }
        copies = not self._sharing
        for name in self.persistent:
            out[name] = encode(getattr(self, name), f"{self.name}.{name}", copies=copies)
        return out

    _sharing = False  # state_dict() leaves the models' and optimizers' tensors uncopied

    def shared_state(self) -> dict[str, Any]:
        """`state_dict()` with its models' and optimizers' tensors as they are, not copied.

        That is the state of this moment only while nothing changes those tensors in place (a
        stacked round gives its members new ones, `coordinator.stacking`); `copied_state` turns it
        into what `state_dict()` gives. A subclass's `state_dict` that extends the base's gets
        this for free."""
        self._sharing = True
        try:
            return self.state_dict()
        finally:
            self._sharing = False

    @staticmethod
    def copied_state(state: Mapping[str, Any]) -> dict[str, Any]:
        """`shared_state()`'s output with its tensors copied: what `state_dict()` gave at that
        moment, if nothing has changed them since."""
        return {k: copied(v) for k, v in state.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output (modules in place when their architecture matches)."""
        missing = [n for n in (*self.persistent, *BASE_STATE) if n not in state]
        if missing:
            raise AlgorithmError(f"{self.name}: the saved state lacks {missing}")
        self.ctx.trainer.generator.set_state(state["__rng__"])
        self.ctx.trainer.samples = int(state["__samples__"])
        self.deployment.guard.load_state_dict(self._decode(None, state["__guard__"]))
        for name in self.persistent:
            setattr(self, name, self._decode(getattr(self, name, None), state[name]))

    def _decode(self, current: Any, value: Any) -> Any:
        return decode(current, value, prepare=self.ctx.trainer.prepare, where=self.name)

    # -- helpers for subclasses ------------------------------------------------------------
    def _scores(self, prefix: str, model: nn.Module) -> dict[str, float]:
        d = self.ctx.data
        r = self.ctx.trainer.evaluate(model, d.x_test, d.y_test)
        return {
            f"{prefix}_correct": r.correct,
            f"{prefix}_total": r.total,
            f"{prefix}_loss": r.loss,
        }

    def _build(self, spec: ArchSpec, salt: int = 0) -> nn.Module:
        return self.ctx.build_model(spec, salt)

    def _materialize(self, model: WireModel) -> nn.Module:
        return self.ctx.materialize(model)

    @property
    def _stacked(self) -> bool:
        """Whether this runs for a stack of clients (coordinator.stacking)."""
        return isinstance(self.ctx.data.n_train, list)

    def _each(self, value: Any) -> list[Any]:
        """One value per member: a stack's PerMember (or tensor of one row per member) as a
        list, any other value the same for every member; a client's value in a list."""
        if not self._stacked:
            return [value]
        if isinstance(value, PerMember | torch.Tensor):
            return list(value)
        return [value] * len(cast(PerMember, self.ctx.data.n_train))

    def _like(self, values: list[Any]) -> Any:
        """One value per member as this algorithm holds it: a PerMember on a stack of
        clients, the value itself for one client."""
        return PerMember(values) if self._stacked else values[0]

    # -- per-client values and decisions, written once for one client -------------------------
    # The simulator may run a round once for many clients (coordinator.stacking), where these
    # hold one value per client and decide client by client; an algorithm that uses them (and
    # takes no branch of its own on such a value) is written as for one client.
    def _per_client(self, fn: Callable[..., Any], *values: Any) -> Any:
        """`fn` of this client's `values` (each client's, for many)."""
        return self._like([fn(*v) for v in zip(*map(self._each, values), strict=True)])

    def _one_for_all(self, value: Any, why: str) -> Any:
        """A per-client value the round takes as one (a loop's length): this client's (many
        clients', where it is the same for all; else CohortUnsupported(`why`), and the clients
        train one by one)."""
        values = self._each(value)
        if any(v != values[0] for v in values):
            raise CohortUnsupported(f"{why} ({sorted(set(values))})")
        return values[0]

    @staticmethod
    def _reported(value: float | torch.Tensor) -> float:
        """A per-client number as a reply's metric (a tensor of one per client as their list,
        which the simulator splits)."""
        return cast(float, value.tolist() if isinstance(value, torch.Tensor) else value)

    def _lacks_validation(self) -> bool:
        """Whether this client has no validation samples (any of many)."""
        return 0 in self._each(self.ctx.data.n_val)

    def _admits(self, spec: ArchSpec, model: nn.Module) -> bool:
        """Whether this device's budget admits `model` (of `spec`) (of many clients' copies,
        each one's parameters)."""
        params = footprint(model).params // len(self._each(self.ctx.data.n_train))
        return self.ctx.budget.refusal(spec, self.ctx.spec, params) is None

    def _may_choose(self, new: ArchSpec, old: ArchSpec | None) -> None:
        """Before training: a later `_choose` between models of `new` and `old` can be made
        (many clients trained at once hold one architecture: CohortUnsupported where they differ,
        and the clients then train one by one)."""
        if self._stacked and new != old:
            held = "none" if old is None else old.family
            raise CohortUnsupported(
                f"{self.name}: clients that may choose {new.family} over {held} cannot train "
                "as one model"
            )

    def _choose(self, which: Any, new: Candidate, old: Held) -> Held:
        """`new` where `which` holds for this client, else `old` (many clients: `new` or `old`
        where it holds for all or none; else, of one architecture, `old`'s module with `new`'s
        weights for the clients `which` marks)."""
        flags = self._each(which)
        if all(flags) or not any(flags):
            return new if flags[0] else old
        self._may_choose(new[0], old[0])
        assert old[1] is not None  # (of new's architecture)
        take_rows(old[1], new[1], flags)
        return old

    def _chosen_state(
        self, which: Any, new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """A module's state: `new` where `which` holds for this client, else `old` (many
        clients: a copy of `old` with `new`'s rows for the clients `which` marks)."""
        flags = self._each(which)
        if all(flags) or not any(flags):
            return new if flags[0] else old
        return rows_taken(old, new, flags)

    def _alone(self, why: str) -> None:
        """What follows is for one client only (a decision no value can carry): many clients
        training at once stop here (CohortUnsupported(`why`)) and train one by one."""
        if self._stacked:
            raise CohortUnsupported(why)

    def _teaches(
        self, teacher: nn.Module, student: nn.Module, gate: str = "validation"
    ) -> float | torch.Tensor:
        """How much `student` learns from `teacher` this round, by their cross-entropies on
        this client's validation split (L_t, L_s): the gate of FML's and FedMe's distillation.
        `gate` "validation": 1.0 when the teacher's is lower, else 0.0; "soft": min(1, L_s/L_t),
        so that a teacher no better learns in proportion, and the weight grows as it improves;
        either way 1.0 without validation data (nothing says otherwise). On a stack of clients
        (coordinator.stacking), a tensor of one weight per member: a step's loss takes its rows with
        `edge_sdk.losses.rows_of`."""
        d, trainer = self.ctx.data, self.ctx.trainer
        t = trainer.evaluate(teacher, d.x_val, d.y_val)
        s = trainer.evaluate(student, d.x_val, d.y_val)

        def weight(total: int, teacher_loss: float, student_loss: float) -> float:
            if total == 0:
                return 1.0
            if gate == "soft":
                return min(1.0, student_loss / teacher_loss) if teacher_loss > 0 else 1.0
            return 1.0 if teacher_loss < student_loss else 0.0

        if isinstance(t, EvalResult):
            return weight(t.total, t.loss, s.loss)
        weights = [weight(*v) for v in zip(t.total, t.loss, s.loss, strict=True)]
        return torch.tensor(weights, device=trainer.device)

    def _require(self, models: Mapping[str, WireModel], name: str) -> WireModel:
        if name not in models:
            raise AlgorithmError(f"{self.name}: the task carries no {name!r} model")
        return models[name]

    def _require_same_arch(self, incoming: WireModel) -> None:
        if incoming.spec != self.ctx.spec:
            raise AlgorithmError(
                f"{self.name}: the global model is {incoming.spec} but this client's "
                f"architecture is {self.ctx.spec}; {self.name} needs one architecture everywhere"
            )
