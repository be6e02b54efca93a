"""The device half of an algorithm: turns a task (round, incoming models) into a reply.

A ClientAlgorithm owns the client's private state (personalized model, auxiliary model, optimizer
momentum); `state_dict()` / `load_state_dict()` cover all of it (the attributes a class lists in
`persistent`, plus the trainer's random generator), so a device that restarts continues where it
left off. It never touches the network: the EdgeClient decodes tasks, calls it, and encodes
replies. Each algorithm is one file in this package with a frozen config whose defaults come from
`algorithms.md`, registered by name; its server half lives in `coordinator/strategies/` under the
same name and reads the same config.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn

from edge_sdk.algorithms.guard import (
    FINETUNED,
    PERSONAL,
    Candidate,
    Distil,
    Guard,
    GuardConfig,
    Pick,
)
from edge_sdk.budget import DeployBudget, arch_name, footprint
from edge_sdk.codec import WireModel, cpu_copies, state_of
from edge_sdk.cohort_trainer import PerMember
from edge_sdk.losses import distillation_loss
from edge_sdk.peers import Peers
from edge_sdk.trainer import ClientData, EvalResult, OptimConfig, Score, Trainer
from model_zoo import ArchSpec, build

__all__ = [
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

log = logging.getLogger(__name__)


class AlgorithmError(ValueError):
    """A task this algorithm cannot run (missing model, incompatible architecture...)."""


class BaseAlgorithmConfig(BaseModel):
    """Base of every algorithm's config: frozen, and a field it does not know is an error.

    An algorithm's config holds only the settings it honours. `refused` names settings users
    often expect but the algorithm does not take, each with the reason, so that setting one
    fails with that reason instead of a bare "extra inputs are not permitted".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    refused: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            bad = [k for k in cls.refused if k in data]
            if bad:
                raise ValueError("; ".join(f"{k}: {cls.refused[k]}" for k in bad))
        return data


class AlgorithmConfig(OptimConfig, BaseAlgorithmConfig):
    """Config of an algorithm that trains whole local epochs with the shared Trainer's optimizer
    (every field of OptimConfig is honoured), plus the algorithm's own fields."""


@dataclass
class TaskInfo:
    """The step of the current task and the parameters the coordinator gave it."""

    step: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ClientContext:
    """What an algorithm may use: its client's id, architecture, data, device and trainer;
    `peers`, the channel to other clients (decentralized algorithms); `task`, the current
    task's step and parameters; `budget`, what the device may deploy (edge_sdk.budget; its
    own architecture by default)."""

    client_id: str
    spec: ArchSpec
    data: ClientData
    device: torch.device
    seed: int
    trainer: Trainer
    peers: Peers | None = None
    task: TaskInfo = field(default_factory=TaskInfo)
    budget: DeployBudget = field(default_factory=DeployBudget)

    def build_model(self, spec: ArchSpec, salt: int) -> nn.Module:
        """A fresh `spec` network on this client's device, seeded by the client and `salt`."""
        model = self.trainer.prepare(build(spec, seed=self.seed * 1009 + salt))
        setattr(model, SPEC_ATTR, spec)  # what persistence rebuilds it from
        return model

    def materialize(self, model: WireModel) -> nn.Module:
        """A received model as a network on this client's device."""
        module = self.trainer.prepare(model.build())
        setattr(module, SPEC_ATTR, model.spec)
        return module


# A per-client fact a reply reports as it is (a choice made on the device, an architecture name),
# as opposed to a metric, which the coordinator averages over clients.
Detail = str | int | float | bool | None


@dataclass
class FitResult:
    models: dict[str, WireModel] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    n_samples: int = 0
    # Reaches results.json: from finalize, as fields of the client's entry; from fit, per round.
    details: dict[str, Detail] = field(default_factory=dict)


class ClientAlgorithm(ABC):
    """The device half of an algorithm.

    A subclass implements `train_round` (one round's local training), `trained_model` (the
    personalized model its training leads to) and, when it does more than evaluate after the
    last round, `finish`. The base class wraps them: `fit` and `finalize` add the guard
    (edge_sdk.algorithms.guard) for algorithms whose config has `guard`, and the count of
    training samples processed; `personalized_model` is what the client deploys.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type[BaseAlgorithmConfig]]
    # The attributes that hold this client's private state, in restore order (modules before
    # the optimizers that step them): modules built by `_build`/`_materialize`, optimizers,
    # tensors, ArchSpecs, WireModels, plain values, and dicts of any of these.
    persistent: ClassVar[tuple[str, ...]] = ()
    # True when `train_round` can run once for many clients on stacked models
    # (edge_sdk.cohort): it builds models through ctx, draws batches with
    # trainer.sample_batch, takes gradients with trainer.value_and_grad, averages with
    # trainer.average and updates elementwise.
    stackable: ClassVar[bool] = False
    # Per-round attributes (not persistent) that `train_round` restarts in place rather than
    # builds anew (Trainer.fresh_optimizer's optimizers): a stack of clients kept from round to
    # round (edge_sdk.cohort) carries them into its next round, so that their tensors, and the
    # captured step that reads them, stay. Every other per-round attribute starts afresh.
    restarted: ClassVar[tuple[str, ...]] = ()
    # The persistent attributes `evaluate` changes (FedMe keeps the model its task carries): a
    # stacked evaluation gives them back to its members. Evaluation changes no other state.
    evaluation_keeps: ClassVar[tuple[str, ...]] = ()
    # Persistent plain values that may differ between the members of a stack (PersFL's
    # teacher's round and loss): a stacked phase holds each as a PerMember list, one value per
    # member, and every member gets its own back. Any other plain value must be equal.
    per_member: ClassVar[tuple[str, ...]] = ()
    # Its clients exchange models with each other through `ctx.peers` (decentralized): a host
    # of many clients begins every task of a phase before any executes.
    exchanges_models: ClassVar[bool] = False

    def __init__(self, ctx: ClientContext, config: BaseAlgorithmConfig) -> None:
        self.ctx = ctx
        self.config = config
        # (an algorithm without the guard's fields never consults it: its z is the default)
        guarded = config if isinstance(config, GuardConfig) else GuardConfig()
        self.guard = Guard(ctx.trainer, ctx.data, guarded.guard_z, ctx.budget, ctx.spec)
        self._deployed: tuple[Pick, nn.Module] | None = None  # the guard's pick, built once

    @property
    def partial_models(self) -> frozenset[str]:
        """Names of incoming models that may carry only a subset of their tensors."""
        return frozenset()

    @property
    def guarded(self) -> bool:
        return isinstance(self.config, GuardConfig) and self.config.guard

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
        """One round: `train_round`, then the guard's look at what it left (`after_fit`)."""
        result = self.train_round(round_, rounds, models)
        self.after_fit(round_)
        return result

    def after_fit(self, round_: int, scores: Mapping[str, Score] | None = None) -> None:
        """The guard keeps the best candidate so far (a cohort calls it per member, with the
        `scores` it computed for the whole stack)."""
        if self.guarded:
            self.guard.observe(round_, self.guard_candidates(), scores)

    def finalize(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """`finish`, then `after_finish`."""
        return self.after_finish(rounds, models, self.finish(round_, rounds, models))

    def after_finish(
        self,
        rounds: int,
        models: Mapping[str, WireModel],
        result: FitResult,
        tuned: Candidate | None = None,
    ) -> FitResult:
        """The choice of the model to deploy, after `finish` (a cohort calls it per member):
        the guard's where the config has it on, else the algorithm's final model, within the
        device's budget either way. The reply's details say what it deployed (architecture,
        parameters, size) and why, and how many training samples this client processed.
        `tuned`: this client's fine-tuned final model when a stack of clients trained theirs at
        once (edge_sdk.cohort); otherwise it is trained here."""
        final = self.guard_candidates()
        distil = self._distiller(rounds)
        if self.guarded:
            glob = self._full_global(models)
            if glob is not None:
                final.setdefault("global", (glob.spec, self._materialize(glob)))
            if tuned is None and self.finetunes:
                try:
                    tuned = self.finetune(rounds, models)
                except FloatingPointError as exc:  # not a candidate; the others remain
                    log.warning(
                        "%s: the guard's fine-tuning diverged (%s)", self.ctx.client_id, exc
                    )
            if tuned is not None:
                final[FINETUNED] = tuned
                assert isinstance(self.config, GuardConfig)
                if self.config.guard_default == "mixture" and PERSONAL in final:
                    w, name, mixed = self.guard.weigh(
                        final[PERSONAL], tuned, self.config.guard_mix_weights
                    )
                    final = {name: mixed, **final}  # first: the default
                    result.details["guard_mix_weight"] = w
            result.details |= self.guard.decide(rounds, final, distil)
            m = result.metrics
            if m.get("personal_total"):  # the algorithm's own model on the test split, for reports
                result.details["guard_unguarded_acc"] = m["personal_correct"] / m["personal_total"]
        else:
            why = "the guard is off" if isinstance(self.config, GuardConfig) else "no guard"
            result.details |= self.guard.deploy_first(final, distil, why)
        if self.guard.deployed is not None:
            result.metrics |= self._scores("personal", self.personalized_model()[1])
        result.details |= self.deployment()
        result.details["samples_processed"] = self.ctx.trainer.samples
        return result

    def deployment(self) -> dict[str, Any]:
        """The deployed model's architecture ("mixture of mlr+mlp" for several), parameters and
        size (KiB of its weights), beside the device's own architecture's parameters."""
        spec, model = self.personalized_model()
        own = self._build(self.ctx.spec, salt=0) if spec != self.ctx.spec else model
        size = footprint(model)
        return {
            "deployed_arch": arch_name(spec),
            "deployed_params": size.params,
            "deployed_kib": round(size.kib, 1),
            "own_params": footprint(own).params,
        }

    def _distiller(self, rounds: int) -> Distil | None:
        """What the guard distils a model outside the device's budget with (`distil`, at the
        last round's rate); None where the config makes no student."""
        cfg = self.config
        if not isinstance(cfg, GuardConfig) or cfg.guard_distill_epochs == 0:
            return None
        if self.finetune_optim() is None:
            return None
        return lambda teacher, start: self.distil(rounds, teacher, start)

    def distil(self, rounds: int, teacher: Candidate, start: Candidate | None) -> Candidate | None:
        """A student of this device's own architecture, starting from `start`'s weights (a
        fresh one without), trained for `guard_distill_epochs` on the training split with
        (1 − λ)·CE + λ·T²·KL(teacher ‖ student) and the algorithm's optimizer settings at the
        last round's rate (`finetune_optim`); None where its training diverges. Its samples
        count as processed."""
        cfg, optim = self.config, self.finetune_optim()
        assert isinstance(cfg, GuardConfig) and optim is not None
        trainer, d = self.ctx.trainer, self.ctx.data
        student = self._build(self.ctx.spec, salt=3)
        if start is not None:
            student.load_state_dict(start[1].state_dict())
        z_teacher = trainer.logits(teacher[1], d.x_train)  # the teacher is fixed: once
        opt = trainer.optimizer(student.parameters(), optim, lr=optim.lr_at(rounds, rounds))
        lam, temperature = cfg.guard_distill_lambda, cfg.guard_distill_temperature
        student.train()

        def step(x: torch.Tensor, y: torch.Tensor, z_t: torch.Tensor) -> tuple[torch.Tensor]:
            with trainer.autocast():
                z_s = student(x)
            loss = distillation_loss("kl", z_s, z_t, y, lam, temperature)
            return (trainer.step(loss, [opt]),)

        batches = trainer.epochs(
            d.x_train, d.y_train, optim.batch_size, cfg.guard_distill_epochs, z_teacher
        )
        try:
            trainer.run(step, batches)
        except FloatingPointError as exc:
            log.warning("%s: the guard's distillation diverged (%s)", self.ctx.client_id, exc)
            return None
        return self.ctx.spec, student

    @property
    def finetunes(self) -> bool:
        """Whether the guard fine-tunes the federation's final model after the last round: it is
        on, `guard_ft_epochs` > 0, and the client has validation data to judge the result by."""
        cfg = self.config
        return (
            isinstance(cfg, GuardConfig)
            and cfg.guard
            and cfg.guard_ft_epochs > 0
            and self.guard.active
            and self.finetune_optim() is not None
        )

    def finetune_base(self, models: Mapping[str, WireModel]) -> Candidate | None:
        """The federation's final model, which the guard fine-tunes on this client's data as a
        candidate (a fresh copy: fine-tuning it changes nothing else). Default: the finalize
        task's global model, when it is whole and predicts this client's classes."""
        glob = self._full_global(models)
        return None if glob is None else (glob.spec, self._materialize(glob))

    def finetune_optim(self) -> OptimConfig | None:
        """How the guard fine-tunes (at the last round's learning rate, as FedAvg+FT does): the
        algorithm's own optimizer settings where its config has them (an AlgorithmConfig); None,
        no fine-tuned candidate, unless an algorithm with other settings says its own."""
        return self.config if isinstance(self.config, OptimConfig) else None

    def finetune(self, rounds: int, models: Mapping[str, WireModel]) -> Candidate | None:
        """The guard's candidate: `finetune_base` trained for `guard_ft_epochs` on the training
        split (its samples count as processed); None without a base or optimizer settings.
        FloatingPointError when the training diverges."""
        assert isinstance(self.config, GuardConfig)
        base = self.finetune_base(models)
        if base is None:
            return None
        spec, model = base
        cfg = self.finetune_optim()
        if cfg is None:
            return None
        trainer = self.ctx.trainer
        opt = trainer.optimizer(model.parameters(), cfg, lr=cfg.lr_at(rounds, rounds))
        trainer.train_epochs(
            model, self.ctx.data, cfg, optimizer=opt, epochs=self.config.guard_ft_epochs
        )
        return spec, model

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

    def personalized_model(self) -> tuple[ArchSpec, nn.Module]:
        """The model this client deploys (and exports to ONNX): the guard's choice after the
        last round, else the algorithm's own (`trained_model`)."""
        pick = self.guard.deployed
        if pick is None:
            return self.trained_model()
        if self._deployed is None or self._deployed[0] is not pick:
            assert pick.model is not None  # a deployed pick is kept
            self._deployed = (pick, self._materialize(pick.model))
        return pick.spec, self._deployed[1]

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
            "__guard__": _encode(self.guard.state_dict(), f"{self.name}.guard"),
        }
        copies = not self._sharing
        for name in self.persistent:
            out[name] = _encode(getattr(self, name), f"{self.name}.{name}", copies=copies)
        return out

    _sharing = False  # state_dict() leaves the models' and optimizers' tensors uncopied

    def shared_state(self) -> dict[str, Any]:
        """`state_dict()` with its models' and optimizers' tensors as they are, not copied.

        That is the state of this moment only while nothing changes those tensors in place (a
        stacked round gives its members new ones, `edge_sdk.cohort`); `copied_state` turns it
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
        return {k: _copied(v) for k, v in state.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output (modules in place when their architecture matches)."""
        missing = [n for n in (*self.persistent, *_BASE_STATE) if n not in state]
        if missing:
            raise AlgorithmError(f"{self.name}: the saved state lacks {missing}")
        self.ctx.trainer.generator.set_state(state["__rng__"])
        self.ctx.trainer.samples = int(state["__samples__"])
        self.guard.load_state_dict(self._decode(None, state["__guard__"]))
        for name in self.persistent:
            setattr(self, name, self._decode(getattr(self, name, None), state[name]))

    def _decode(self, current: Any, value: Any) -> Any:
        if isinstance(value, dict) and "__module__" in value:
            spec = ArchSpec.from_json(value["__module__"])
            module = current
            if not (isinstance(current, nn.Module) and getattr(current, SPEC_ATTR, None) == spec):
                module = self.ctx.trainer.prepare(build(spec))
                setattr(module, SPEC_ATTR, spec)
            module.load_state_dict(value["weights"])
            return module
        if isinstance(value, dict) and "__optimizer__" in value:
            if not isinstance(current, torch.optim.Optimizer):
                raise AlgorithmError(f"{self.name}: an optimizer was saved where none exists now")
            saved = value["__optimizer__"]
            # torch's load_state_dict adopts the saved tensors (momentum, Adam's moments) as
            # they are, and the next step would change them in place: the saved state (a
            # node's state before a round, which a retry and a failed round load again) must
            # stay as it was.
            current.load_state_dict(
                {
                    "state": {
                        int(k): {
                            n: t.clone() if isinstance(t, torch.Tensor) else t
                            for n, t in entry.items()
                        }
                        for k, entry in saved["state"].items()
                    },
                    "param_groups": _with_execution_of(current, saved["param_groups"]),
                }
            )
            return current
        if isinstance(value, dict) and "__spec__" in value:
            return ArchSpec.from_json(value["__spec__"])
        if isinstance(value, dict) and "__wire__" in value:
            return WireModel(ArchSpec.from_json(value["__wire__"]), dict(value["weights"]))
        if isinstance(value, dict):
            old = current if isinstance(current, dict) else {}
            return {k: self._decode(old.get(k), v) for k, v in value.items()}
        return value

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
        """Whether this runs for a stack of clients (edge_sdk.cohort)."""
        return isinstance(self.ctx.data.n_train, list)

    def _each(self, value: Any) -> list[Any]:
        """One value per member: a stack's PerMember as a list, a client's value in a list."""
        return list(value) if self._stacked else [value]

    def _like(self, values: list[Any]) -> Any:
        """One value per member as this algorithm holds it: a PerMember on a stack of
        clients, the value itself for one client."""
        return PerMember(values) if self._stacked else values[0]

    def _teaches(
        self, teacher: nn.Module, student: nn.Module, gate: str = "validation"
    ) -> float | torch.Tensor:
        """How much `student` learns from `teacher` this round, by their cross-entropies on
        this client's validation split (L_t, L_s): the gate of FML's and FedMe's distillation.
        `gate` "validation": 1.0 when the teacher's is lower, else 0.0; "soft": min(1, L_s/L_t),
        so that a teacher no better learns in proportion, and the weight grows as it improves;
        either way 1.0 without validation data (nothing says otherwise). On a stack of clients
        (edge_sdk.cohort), a tensor of one weight per member: a step's loss takes its rows with
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


# What the base class saves besides `persistent`: the random generator, the count of training
# samples processed, and what the guard keeps.
_BASE_STATE = ("__rng__", "__samples__", "__guard__")

# How an optimizer runs its step, not what the step computes: chosen for the tensors and the
# device it steps now (edge_sdk.optim.SGD's fused kernel on the CPU), never taken from a saved
# state, which may come from another device or from a version that chose otherwise.
_EXECUTION = ("fused", "foreach", "capturable")


def _with_execution_of(
    current: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The saved param `groups`, each with `current`'s group's `_EXECUTION` settings, and none it
    lacks (where the group counts differ, torch's load_state_dict refuses them as they are)."""
    if len(groups) != len(current.param_groups):
        return groups
    return [
        {k: v for k, v in g.items() if k not in _EXECUTION}
        | {k: now[k] for k in _EXECUTION if k in now}
        for g, now in zip(groups, current.param_groups, strict=True)
    ]


SPEC_ATTR = "_edgefl_spec"  # the ArchSpec a module was built from (set by _build/_materialize)


def _encode(value: Any, where: str, *, copies: bool = True) -> Any:
    if isinstance(value, nn.Module):
        spec = getattr(value, SPEC_ATTR, None)
        if spec is None:
            raise AlgorithmError(f"{where}: a module not built by _build/_materialize")
        weights = state_of(value) if copies else dict(value.state_dict())  # detached either way
        return {"__module__": spec.to_json(), "weights": weights}
    if isinstance(value, torch.optim.Optimizer):
        saved = value.state_dict()  # its per-parameter state holds the live buffers
        state = {str(k): dict(v) for k, v in saved["state"].items()}
        opt = {"state": state, "param_groups": saved["param_groups"]}
        return {"__optimizer__": copy.deepcopy(opt) if copies else opt}
    if isinstance(value, ArchSpec):
        return {"__spec__": value.to_json()}
    if isinstance(value, WireModel):
        return {"__wire__": value.spec.to_json(), "weights": dict(value.weights)}
    if isinstance(value, dict):  # e.g. a table per peer, a cache of peers' models
        return {str(k): _encode(v, f"{where}.{k}", copies=copies) for k, v in value.items()}
    return value


def _copied(value: Any) -> Any:
    """An `_encode(..., copies=False)` value as `_encode` would have copied it: a module's
    weights as CPU copies (as `state_of` makes them), an optimizer's state copied where it is."""
    if isinstance(value, dict) and "__module__" in value:
        return {"__module__": value["__module__"], "weights": cpu_copies(value["weights"])}
    if isinstance(value, dict) and "__optimizer__" in value:
        return {"__optimizer__": copy.deepcopy(value["__optimizer__"])}
    if isinstance(value, dict) and "__wire__" not in value and "__spec__" not in value:
        return {k: _copied(v) for k, v in value.items()}
    return value


_REGISTRY: dict[str, type[ClientAlgorithm]] = {}


def register_algorithm(cls: type[ClientAlgorithm]) -> type[ClientAlgorithm]:
    if cls.name in _REGISTRY:
        raise ValueError(f"client algorithm {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def algorithm_class(name: str) -> type[ClientAlgorithm]:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AlgorithmError(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def algorithm_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def _load() -> None:
    import edge_sdk.algorithms  # noqa: F401  (importing the package registers every algorithm)
