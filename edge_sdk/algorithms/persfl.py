"""persfl: distillation from a per-client optimal teacher (PersFL thesis, paper 002, Algorithm 1).

Stage 1 is plain FedAvg on the global architecture. Every global model a client receives after
an aggregation is scored on its validation split; the one with the lowest validation
cross-entropy so far is kept as the client's *optimal teacher* (no extra communication). The
thesis picks among "the FedAvg model learned in each global aggregation round", so the untrained
initial model is never a candidate: on a skewed split its near-uniform outputs can have a lower
CE than every trained global model, and distilling it teaches nothing.

Stage 2 runs on the device in the finalize phase, after the last round: the teacher is distilled
into a student of the client's own architecture, for every (λ, T) of a grid, and the student
with the best validation accuracy is kept:

    L = (1−λ)·CE(z_s, y) + λ·T²·KL(softmax(z_t/T) || softmax(z_s/T))     distill_loss = "kl"
    L = (1−λ)·CE(z_s, y) + λ·T²·CE(softmax(z_t/T), softmax(z_s/T))        distill_loss = "gd"

The student starts from the teacher when it has the teacher's architecture (the paper) and from
a seeded random initialisation otherwise. Every grid point starts from that same student, with a
fresh optimizer and the same batch order, so only λ and T differ between them.

New participants (thesis, section 7.1): a client that joins after training receives the global
models the coordinator archived, named `archive_name(round)`, in its finalize task, and runs
stage 2 against them (`personalize`).

The client's choices (its teacher, with its round and loss; its best grid point) are per-client
values (`ClientAlgorithm._per_client`, `_choose`), so the simulator may run both stages for many
clients of one architecture at once (coordinator.stacking). A distillation that diverges at a
grid point is skipped for that client alone (`_alone`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from pydantic import Field, field_validator
from torch import nn

from edge_sdk.algorithms.base import (
    AlgorithmConfig,
    AlgorithmError,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.algorithms.candidates import PERSONAL, Candidate
from edge_sdk.algorithms.fedavg import FedAvgConfig
from edge_sdk.algorithms.guard_config import SHARED, PatientGuardConfig
from edge_sdk.codec import WireModel, state_of
from edge_sdk.losses import distillation_loss
from model_zoo import ArchSpec

__all__ = [
    "ARCHIVE_PREFIX",
    "GridPoint",
    "PersFL",
    "PersFLConfig",
    "archive_name",
    "archive_round",
    "distillation_loss",
]

log = logging.getLogger(__name__)

ARCHIVE_PREFIX = "global@"


def archive_name(round_: int) -> str:
    """The model name under which the global model after `round_` aggregations travels."""
    return f"{ARCHIVE_PREFIX}{round_}"


def archive_round(name: str) -> int | None:
    """The round of an archived model's name, None for any other name."""
    if not name.startswith(ARCHIVE_PREFIX):
        return None
    tail = name[len(ARCHIVE_PREFIX) :]
    if not tail.isdigit():
        raise AlgorithmError(f"persfl: archived model name {name!r} does not end in a round")
    return int(tail)


class PersFLConfig(FedAvgConfig, PatientGuardConfig):
    trusted: ClassVar[dict[str, Any]] = SHARED
    distill_loss: Literal["kl", "gd"] = "kl"  # "gd": PersFL-GD (soft cross-entropy) [paper]
    # [ours] λ/T grids (the paper's chosen values range over λ 0–0.75, T 1–25): 5 students, each
    # trained on the local budget (distill_epochs). λ = 0 is the undistilled student. The grid
    # of the first version, λ ∈ {0, 0.1, 0.25, 0.5, 0.75, 0.9} × T ∈ {1, 2, 4, 8, 16} (26
    # students), is a setting away.
    distill_lambdas: list[float] = Field(default_factory=lambda: [0.0, 0.5, 0.75], min_length=1)
    distill_temperatures: list[float] = Field(default_factory=lambda: [1.0, 4.0], min_length=1)
    # [ours] Epochs of each grid point's distillation. None: the local-training budget of the
    # run, rounds × local_epochs, so that the λ = 0 point (plain cross-entropy) gets the passes
    # over the data that training alone gets (5, the earlier default, left students from scratch
    # far below local training).
    distill_epochs: int | None = Field(None, ge=1)
    # Images of stage 2 shifted by up to this many pixels each way, every batch afresh, and
    # labelled by the teacher as shifted (as the guard's students, `guard_distill_shift`); 0:
    # the images as they are, the thesis's. Other inputs (features, sequences) are never
    # shifted. 1 gained on the long digits split and lost on the long Fashion-MNIST one and on
    # most quick splits (docs/algorithms.md, "Defaults measured at two sizes"): 0 stays.
    distill_shift: int = Field(0, ge=0)
    # [ours] On a device of another architecture than the global one, the guard's default is
    # never PersFL's student alone: a student of its mixture with the fine-tuned global model
    # (under a budget of its own architecture), starting from PersFL's student and afresh;
    # PersFL's student is deployed where it is clearly better. It gained at the long size and
    # was level at the quick one (docs/algorithms.md, "Defaults measured at two sizes").
    guard_mix_weights_other_arch: list[float] | None = Field(
        default_factory=lambda: [0.75, 0.5, 0.25, 0.0], min_length=1
    )
    # Coordinator: how many of the latest global models it keeps for new participants [ours].
    archive_size: int = Field(10, ge=0)

    @field_validator("distill_lambdas")
    @classmethod
    def _lambdas_in_unit_interval(cls, v: list[float]) -> list[float]:
        if any(not 0 <= x <= 1 for x in v):
            raise ValueError(f"every λ must lie in [0, 1], got {v}")
        return v

    @field_validator("distill_temperatures")
    @classmethod
    def _temperatures_positive(cls, v: list[float]) -> list[float]:
        if any(not x > 0 for x in v):
            raise ValueError(f"every temperature must be > 0, got {v}")
        return v


@dataclass(frozen=True)
class GridPoint:
    lam: float
    temperature: float
    val_correct: int
    val_total: int
    val_loss: float

    @property
    def val_acc(self) -> float:
        return self.val_correct / self.val_total if self.val_total else float("nan")

    def beats(self, other: GridPoint | None) -> bool:
        """Higher validation accuracy wins; on a tie, lower validation loss; else the earlier."""
        if other is None:
            return True
        if self.val_correct != other.val_correct:
            return self.val_correct > other.val_correct
        return self.val_loss < other.val_loss


@register_algorithm
class PersFL(ClientAlgorithm):
    name = "persfl"
    config_cls = PersFLConfig
    config: PersFLConfig
    opt: torch.optim.Optimizer | None = None  # stage 1's, per round (restarted), not persistent
    persistent = (
        "model",
        "model_spec",
        "teacher",
        "teacher_spec",
        "teacher_round",
        "teacher_loss",
        "student",
        "student_init",
        "diverged",
        "grid",
        "choice",
    )

    def __init__(self, ctx: ClientContext, config: AlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.model: nn.Module | None = None  # stage 1: this client's copy of the global model
        self.model_spec: ArchSpec | None = None
        self.teacher: nn.Module | None = None
        self.teacher_spec: ArchSpec | None = None
        self.teacher_round: int | None = None
        self.teacher_loss = math.inf
        self.student: nn.Module | None = None
        self.choice: GridPoint | None = None
        self.grid: list[GridPoint] = []
        self.diverged: list[tuple[float, float]] = []  # (λ, T) whose training loss went NaN/inf
        self.student_init: Literal["teacher", "scratch"] | None = None
        self.rounds = 1  # the run's length (finalize says it), for the distillation budget

    def state_dict(self) -> dict[str, Any]:
        grid = [dataclasses.asdict(p) for p in self.grid]
        choice = dataclasses.asdict(self.choice) if self.choice is not None else None
        return super().state_dict() | {"grid": grid, "choice": choice}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.diverged = [(float(lam), float(t)) for lam, t in self.diverged]
        self.grid = [GridPoint(**p) for p in state["grid"]]
        self.choice = GridPoint(**state["choice"]) if state["choice"] is not None else None

    # -- stage 1 ---------------------------------------------------------------------------
    def _val_loss(self, model: nn.Module) -> Any:
        """`model`'s validation cross-entropy."""
        d = self.ctx.data
        if self._lacks_validation():
            raise AlgorithmError(
                "persfl picks its teacher (and λ, T) on the validation split and this client has "
                "none; give it validation data (e.g. data.split = [0.6, 0.2, 0.2])"
            )
        return self.ctx.trainer.evaluate(model, d.x_val, d.y_val).loss

    def consider_teacher(self, round_: int, candidate: WireModel) -> Any:
        """Keep `candidate` as the teacher when its validation CE is the lowest so far; whether
        it was kept."""
        d = self.ctx.data
        if candidate.spec.num_classes != d.num_classes:
            raise AlgorithmError(
                f"persfl: the global model predicts {candidate.spec.num_classes} classes, this "
                f"client has {d.num_classes}"
            )
        model = self._materialize(candidate)
        loss, better = self._below_teacher(model)
        self.teacher_spec, self.teacher = self._choose(
            better, (candidate.spec, model), (self.teacher_spec, self.teacher)
        )
        self.teacher_round = self._per_client(
            lambda b, kept: round_ if b else kept, better, self.teacher_round
        )
        self.teacher_loss = self._per_client(
            lambda b, new, kept: new if b else kept, better, loss, self.teacher_loss
        )
        return better

    def _below_teacher(self, model: nn.Module) -> tuple[Any, Any]:
        """`model`'s validation CE, and whether it is below the teacher's."""
        loss = self._val_loss(model)
        return loss, self._per_client(lambda new, kept: new < kept, loss, self.teacher_loss)

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        glob = self._require(models, "global")
        # The task of round r carries the global model after r−1 aggregations (none in round 1).
        if round_ > 1:
            self.consider_teacher(round_ - 1, glob)
        if self.model is None or glob.spec != self.model_spec:
            self.model, self.model_spec = self._materialize(glob), glob.spec
        else:
            self.model.load_state_dict(glob.weights)
        cfg, trainer = self.config, self.ctx.trainer
        lr = cfg.lr_at(round_, rounds)
        # A new optimizer each round (kept and restarted in place: Trainer.fresh_optimizer).
        opt = self.opt = trainer.fresh_optimizer(self.opt, self.model.parameters(), cfg, lr)
        loss = trainer.train_epochs(self.model, self.ctx.data, cfg, optimizer=opt)
        return FitResult(
            models={"model": WireModel.of(glob.spec, self.model)},
            metrics={"train_loss": loss},
            n_samples=self.ctx.data.n_train,
        )

    # -- stage 2 ---------------------------------------------------------------------------
    def finish(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        """Stage 2 against the final global model ("global") and any archived ones."""
        self.rounds = rounds
        candidates = [
            (r, m) for name, m in models.items() if (r := archive_round(name)) is not None
        ]
        if "global" in models:
            candidates.append((rounds, models["global"]))
        result = self.personalize(sorted(candidates, key=lambda c: c[0]))
        glob = models.get("global")
        if glob is not None and glob.spec.num_classes == self.ctx.data.num_classes:
            result.metrics |= self._scores("global", self._materialize(glob))
        return result

    def personalize(self, candidates: Iterable[tuple[int, WireModel]]) -> FitResult:
        """Pick the teacher among the kept one and `candidates` (round, model), then distil.

        A client that took part in training already holds a teacher; a new participant brings
        none and chooses among the archived global models it is given.
        """
        for round_, model in candidates:
            self.consider_teacher(round_, model)
        if self.teacher is None or self.teacher_spec is None:
            raise AlgorithmError(
                "persfl: no teacher to distil from; the finalize task carried no global model"
            )
        self.student, self.choice = self._distill_grid(self.teacher, self.teacher_spec)
        return FitResult(
            metrics=self._scores("personal", self.student),
            n_samples=self.ctx.data.n_train,
            details={
                "teacher_round": self.teacher_round,
                "teacher_val_loss": self.teacher_loss,
                "distill_lambda": self._per_client(lambda c: c.lam, self.choice),
                "distill_T": self._per_client(lambda c: c.temperature, self.choice),
                "student_init": self.student_init,
                "diverged_points": self._per_client(len, self.diverged),
            },
        )

    def _grid(self) -> list[tuple[float, float]]:
        # λ = 0 is plain supervised training whatever T is: run it once.
        temps = self.config.distill_temperatures
        points: list[tuple[float, float]] = []
        for lam in self.config.distill_lambdas:
            for t in temps[:1] if lam == 0 else temps:
                if (lam, t) not in points:
                    points.append((lam, t))
        return points

    def _distill_grid(self, teacher: nn.Module, teacher_spec: ArchSpec) -> tuple[nn.Module, Any]:
        """The student of the best grid point on this client's validation split, and that
        point."""
        trainer, d = self.ctx.trainer, self.ctx.data
        student = self._build(self.ctx.spec, salt=2)
        if self.ctx.spec == teacher_spec:
            student.load_state_dict(teacher.state_dict())
            self.student_init = "teacher"
        else:
            self.student_init = "scratch"
        init = state_of(student)
        batch_order = trainer.rng_state()
        best: Any = self._per_client(lambda _: None, d.n_train)
        best_state: Mapping[str, torch.Tensor] = init
        grid: Any = self._per_client(lambda _: [], d.n_train)
        diverged: list[tuple[float, float]] = []
        for lam, t in self._grid():
            student.load_state_dict(init)
            trainer.set_rng_state(batch_order)
            try:
                self.distill(student, teacher, lam, t)
            except FloatingPointError as exc:  # a bad (λ, T) for this lr: not a candidate
                self._alone(f"persfl: a distillation diverged at λ={lam:g}, T={t:g}")
                log.warning(
                    "%s: distillation at λ=%g, T=%g diverged (%s)", self.ctx.client_id, lam, t, exc
                )
                diverged.append((lam, t))
                continue
            r = trainer.evaluate(student, d.x_val, d.y_val)
            point = self._per_client(
                lambda c, n, v, lam=lam, t=t: GridPoint(lam, t, c, n, v), r.correct, r.total, r.loss
            )
            grid = self._per_client(lambda g, p: [*g, p], grid, point)
            wins = self._per_client(lambda p, b: p.beats(b), point, best)
            best = self._per_client(lambda w, p, b: p if w else b, wins, point, best)
            best_state = self._chosen_state(wins, state_of(student), best_state)
        self.grid = grid
        self.diverged = self._per_client(lambda _: list(diverged), d.n_train)
        if None in self._each(best):  # (many clients at once: none diverged, all have one)
            raise AlgorithmError(
                f"persfl: distillation diverged at every (λ, T) of the grid {diverged}; "
                "lower the learning rate"
            )
        student.load_state_dict(best_state)
        return student, best

    def epochs(self) -> int:
        """Each grid point's epochs: `distill_epochs`, or rounds × local_epochs."""
        cfg = self.config
        return cfg.distill_epochs or self.rounds * cfg.local_epochs

    def distill(
        self, student: nn.Module, teacher: nn.Module, lam: float, temperature: float
    ) -> Any:
        """`epochs()` of the distillation loss from `teacher` on the training split (its
        images shifted by up to `distill_shift` pixels: `Trainer.distillation_batches`); mean
        batch loss."""
        cfg, trainer, d = self.config, self.ctx.trainer, self.ctx.data
        opt = trainer.optimizer(student.parameters(), cfg)
        student.train()

        def step(x: torch.Tensor, y: torch.Tensor, z_t: torch.Tensor) -> tuple[torch.Tensor]:
            with trainer.autocast():
                z_s = student(x)
            loss = distillation_loss(cfg.distill_loss, z_s, z_t, y, lam, temperature)
            return (trainer.step(loss, [opt]),)

        batches = trainer.distillation_batches(
            teacher, d.x_train, d.y_train, cfg.batch_size, self.epochs(), shift=cfg.distill_shift
        )
        (loss,) = trainer.run(step, batches)
        return loss

    # -- evaluation ------------------------------------------------------------------------
    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        """The distilled student; before stage 2, the teacher (the best global model so far)."""
        if self.student is not None:
            return self.ctx.spec, self.student
        if self.teacher is not None and self.teacher_spec is not None:
            return self.teacher_spec, self.teacher
        raise RuntimeError("persfl: no model before the first global model arrived")

    def guard_candidates(self) -> dict[str, Candidate]:
        # During stage 1: this client's copy of the global model after its local epochs (the
        # teacher is a candidate at the end anyway). After stage 2: the student and the teacher.
        if self.student is not None:
            out: dict[str, Candidate] = {PERSONAL: self.trained_model()}
            if self.teacher is not None and self.teacher_spec is not None:
                out["teacher"] = (self.teacher_spec, self.teacher)
            return out
        if self.model is not None and self.model_spec is not None:
            return {"tuned_global": (self.model_spec, self.model)}
        return {}

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        """The student after stage 2; before it, the model that would be the teacher now.

        That is the received global model when its validation CE beats the kept teacher's (the
        next fit task carries it again and keeps it, labelled with its round).
        """
        glob = models.get("global")
        g_model = self._materialize(glob) if glob is not None else None
        if self.student is not None:
            model = self.student
        elif g_model is not None and self.teacher is None:
            model = g_model
        elif g_model is not None:
            assert self.teacher is not None and self.teacher_spec is not None and glob is not None
            _, newer = self._below_teacher(g_model)
            older = self._per_client(lambda b: not b, newer)
            # (a copy of the global model: g_model is scored as the global model below)
            _, chosen = self._choose(
                older, (self.teacher_spec, self.teacher), (glob.spec, self._materialize(glob))
            )
            model = cast(nn.Module, chosen)
        elif self.teacher is not None:
            model = self.teacher
        else:
            raise AlgorithmError("persfl: nothing to evaluate before the first global model")
        out = self._scores("personal", model)
        if (
            g_model is not None
            and glob is not None
            and glob.spec.num_classes == self.ctx.data.num_classes
        ):
            out |= self._scores("global", g_model)
        return out
