"""The guard: each client deploys the best model it has seen on its own validation split.

A personalized algorithm can leave a client worse off than training alone: a weak global model
distilled into it, a schedule that suits other clients, an aggregation that pulled its model
towards other clients' data. The guard costs no extra training. After every round's local
training it scores the models the client could deploy at that moment (the algorithm names them:
its personalized model and, for most, a model of the global architecture it has just trained on
its own data) on the client's **validation** split, and keeps a copy of the best one so far (more
correct samples; on equal counts, the lower loss). After the last round it compares the best of
that copy and the final models with the algorithm's own final personalized model, sample by
sample, and deploys the other only when the evidence is clear:

    b = validation samples the other gets right and the final personalized model wrong
    c = validation samples the final personalized model gets right and the other wrong
    switch  ⇔  b − c > z·√(b + c)          (z = `guard_z`, 2 by default)

(a sign test on the samples where the two disagree, McNemar's). Picking the best of a dozen
candidates on a few dozen validation samples otherwise picks noise: on the benchmark's label
groups, switching on one or two more correct samples lost points against the model it replaced,
and with the weighed mixture as the default, z = 1 left more clients below training alone than
z = 2 (36 rows of 45 within 2 points against 38).

Two more candidates come from what the federation produced (`guard_ft_epochs`, `guard_default`):
- *finetuned*: a copy of the federation's final model (the global model; FedMe's aggregate; for
  FedeRiCo the client's own model) fine-tuned on the client's training split after the last
  round, the step of the FedAvg+FT baseline. Where data is scarce, that model, trained on
  everyone's data, is what a client of a small architecture cannot learn alone.
- *personal+finetuned*: the mixture w·personal + (1 − w)·finetuned of the two models' predicted
  probabilities (one `mixture` model), w chosen per client from `guard_mix_weights` by the lowest
  validation loss; w = 1 is the personalized model alone and w = 0 the fine-tuned one, so a
  device runs two models only where their mixture scores better. It is the default the others
  must clearly beat: measured on the benchmark's splits, the equal mixture was the best single
  choice on average, and weighing it per client kept more clients within 2 points of training
  alone (on the scarce splits, 14 of 20 rows against 11 with the equal mixture).

The test split is never looked at. A client without validation data deploys the algorithm's final
model. What the guard keeps (the best copy, its scores and which validation samples it got
right) is part of the client's persistent state, so a restarted device, or a round done again,
continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, field_validator, model_validator
from torch import nn

from edge_sdk.budget import DeployBudget, arch_name, footprint
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Score, Trainer
from model_zoo import ArchSpec
from model_zoo.models.mixture import Mixture, mixture_spec

__all__ = [
    "BLEND",
    "DISTILLED",
    "FINETUNED",
    "PERSONAL",
    "Candidate",
    "Distil",
    "Guard",
    "GuardConfig",
    "Pick",
    "blend",
]

# What the guard may deploy: a name ("personal", "meme"...) → (architecture, model).
Candidate = tuple[ArchSpec, nn.Module]

# The name of the algorithm's own personalized model among the candidates.
PERSONAL = "personal"
# The federation's final model fine-tuned on the client's data, and its mixture with PERSONAL.
FINETUNED = "finetuned"
BLEND = f"{PERSONAL}+{FINETUNED}"

_REASON_CHARS = 256  # a reply detail's limit
_LOSS_ROUNDING = 1e-6  # relative: validation losses closer than this are equal


def _lower(loss: float, than: float) -> bool:
    """`loss` is below `than` by more than float rounding (_LOSS_ROUNDING)."""
    return loss < than - _LOSS_ROUNDING * max(1.0, abs(than))


class GuardConfig(BaseModel):
    """The config fields of every algorithm the guard serves, and its `preset`."""

    # The published algorithm for each algorithm config: every [ours] value at the paper's
    # (or its authors' code's), the guard off. A subclass lists its own values in `paper`.
    PAPER: ClassVar[dict[str, Any]] = {"guard": False}
    paper: ClassVar[dict[str, Any]] = {}

    # "paper": the algorithm exactly as published (`paper`'s values and the guard off), for
    # every field not set explicitly; "edgefl": our defaults (docs/algorithms.md says which
    # differ and why).
    preset: Literal["edgefl", "paper"] = "edgefl"
    # Deploy the best model seen on the validation split (see edge_sdk.algorithms.guard);
    # False deploys the algorithm's final personalized model, as the paper describes it (or,
    # where that model is outside the device's budget, its own-architecture model).
    guard: bool = True
    # [ours] How clear the evidence must be to deploy another model than the default:
    # b − c > guard_z·√(b + c) over the validation samples where the two disagree.
    guard_z: float = Field(2.0, ge=0)
    # [ours] After the last round, fine-tune a copy of the federation's final model (the global
    # model; FedMe: the aggregate it returns; FedeRiCo: the client's own model) for this many
    # epochs on the training split, as one more candidate: the step of the FedAvg+FT baseline,
    # whose `ft_epochs` default is the same. 0: no such candidate. Counted in samples_processed.
    guard_ft_epochs: int = Field(5, ge=0)
    # [ours] The candidate kept unless another is clearly better: "mixture", the personalized
    # and the fine-tuned model averaged (one `mixture` model: the device runs both), where the
    # device's budget allows mixtures; "personal", the algorithm's own model.
    guard_default: Literal["mixture", "personal"] = "mixture"
    # [ours] The weights w of the personalized model tried for the "mixture" default,
    # w·personal + (1 − w)·finetuned; each client keeps the one with the lowest validation
    # loss (the first of equal ones). 1: the personalized model alone, 0: the fine-tuned one,
    # [0.5]: the equal mixture of earlier versions.
    guard_mix_weights: list[float] = Field(
        default_factory=lambda: [1.0, 0.75, 0.5, 0.25, 0.0], min_length=1
    )
    # [ours] Where a model outside the device's budget (a global model, a mixture) is clearly
    # better on validation than what it may deploy, a student of the device's own architecture
    # learns from it for this many epochs on the training split, starting from the device's
    # best model of its architecture: (1 − λ)·CE + λ·T²·KL(teacher ‖ student), PersFL's loss.
    # The student is deployed when it is clearly better than that model. 0: no student.
    # Counted in samples_processed.
    guard_distill_epochs: int = Field(10, ge=0)
    guard_distill_lambda: float = Field(0.5, ge=0, le=1)  # [ours] λ
    guard_distill_temperature: float = Field(2.0, gt=0)  # [ours] T

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        # The preset's values under whatever is given explicitly.
        if isinstance(data, Mapping) and data.get("preset") == "paper":
            return {**cls.PAPER, **cls.paper, **data}
        return data

    @field_validator("guard_mix_weights")
    @classmethod
    def _weights_in_0_1(cls, weights: list[float]) -> list[float]:
        if not all(0 <= w <= 1 for w in weights):
            raise ValueError(f"each weight of the personalized model is in [0, 1], got {weights}")
        return weights


def _log(w: float) -> float:
    """log w, −∞ at 0 (a mixture's weight)."""
    return math.log(w) if w > 0 else -math.inf


def blend(a: Candidate, b: Candidate, weight: float = 0.5) -> Candidate:
    """The mixture weight·a + (1 − weight)·b of two candidates' predicted probabilities, as one
    `mixture` model built around the same modules (a mixture's members are taken as members,
    their weights scaled, so that a mixture never holds a mixture). 0 < weight < 1."""
    if not 0 < weight < 1:
        raise ValueError(f"a blend's weight is strictly between 0 and 1, got {weight}")
    members: list[tuple[ArchSpec, nn.Module, float]] = []
    for (spec, model), share in ((a, weight), (b, 1 - weight)):
        if isinstance(model, Mixture):
            weights = spec.kwargs["weights"]
            inner = [ArchSpec.model_validate(m) for m in spec.kwargs["members"]]
            total = float(sum(weights))
            members += [
                (s, m, share * w / total)
                for s, m, w in zip(inner, model.members, weights, strict=True)
            ]
        else:
            members.append((spec, model, share))
    weights = [w for _, _, w in members]
    spec = mixture_spec([s for s, _, _ in members], weights)
    mixture = Mixture([m for _, m, _ in members], weights)
    device = next(a[1].parameters()).device
    return spec, mixture.to(device)


# How a reply's reasons name each candidate.
_PROSE = {
    PERSONAL: "its personalized model",
    FINETUNED: "the final model fine-tuned here",
    BLEND: "its personalized and the fine-tuned model mixed",
    "global": "the final global model",
    "meme": "its meme",
    "local": "its local model",
    "teacher": "its teacher",
    "own": "its own model",
    "tuned_global": "the global model trained here",
}
DISTILLED = "distilled"


@dataclass(frozen=True)
class Pick:
    """One scored candidate: which model, when, how it did on validation, whether the device's
    budget admits it (`refusal`: why not), and (once kept or deployed, `kept`) a copy of its
    weights."""

    name: str
    round: int  # the round whose training produced it
    final: bool  # one of the models the client held after the last round (finalize)
    hits: torch.Tensor  # bool, per validation sample: predicted right
    loss: float  # mean validation cross-entropy
    model: WireModel | None = None  # the weights, copied when kept
    # The live model it was scored from, until it is kept (a candidate that is not kept is
    # never copied: the guard scores a few each round, on every client).
    source: Candidate | None = field(default=None, compare=False, repr=False)
    correct: int = -1  # hits' count; counted here unless given (a stack counts its members')
    params: int = 0  # the model's parameters
    refusal: str | None = None  # why the device's budget does not admit it; None: it does
    teacher: str | None = None  # a distilled student's: the teacher's label

    def __post_init__(self) -> None:
        if self.correct < 0:
            object.__setattr__(self, "correct", int(self.hits.sum()))

    @property
    def total(self) -> int:
        return len(self.hits)

    @property
    def spec(self) -> ArchSpec:
        if self.model is not None:
            return self.model.spec
        assert self.source is not None
        return self.source[0]

    def kept(self) -> Pick:
        """This pick holding a copy of its model's weights (what the guard keeps)."""
        if self.model is not None:
            return self
        assert self.source is not None
        return replace(self, model=WireModel.of(*self.source), source=None)

    def beats(self, other: Pick | None) -> bool:
        """More correct validation samples; on a tie, a lower validation loss (losses equal to
        float rounding are a tie: the same model scored alone or in a stack of clients, whose
        batched sums round otherwise, keeps the earlier)."""
        if other is None:
            return True
        if self.correct != other.correct:
            return self.correct > other.correct
        return _lower(self.loss, other.loss)

    @property
    def label(self) -> str:
        when = "final" if self.final else f"round {self.round}"
        return f"{self.name} ({when}, {self.spec.family})"

    @property
    def prose(self) -> str:
        """The candidate as a reason names it: "its meme (mlp, round 3)"."""
        family = arch_name(self.spec)
        when = "" if self.final else f", round {self.round}"
        if self.name == DISTILLED:
            return f"a student ({family}) of {self.teacher}"
        return f"{_PROSE.get(self.name, self.name)} ({family}{when})"

    @property
    def score(self) -> str:
        return f"{self.correct}/{self.total}"

    def to_state(self) -> dict[str, Any]:
        assert self.model is not None, "only a kept pick is saved"
        return {
            "name": self.name,
            "round": self.round,
            "final": self.final,
            "hits": self.hits,
            "loss": self.loss,
            "model": self.model,
            "params": self.params,
            "teacher": self.teacher or "",
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Pick:
        return cls(
            name=str(state["name"]),
            round=int(state["round"]),
            final=bool(state["final"]),
            hits=state["hits"].to(torch.bool),
            loss=float(state["loss"]),
            model=state["model"],
            params=int(state.get("params", 0)),  # (states saved before it was kept: 0)
            teacher=str(state.get("teacher", "")) or None,
        )


# A student of the device's own architecture distilled from a teacher it may not deploy:
# (teacher, the model it starts from or None) -> the student, or None where it cannot be made.
Distil = Callable[[Candidate, Candidate | None], Candidate | None]


class Guard:
    """Scores candidates on one client's validation split and remembers the best one its
    deployment budget admits (`budget`, for a device whose own architecture is `own`)."""

    def __init__(
        self,
        trainer: Trainer,
        data: ClientData,
        z: float,
        budget: DeployBudget | None = None,
        own: ArchSpec | None = None,
    ) -> None:
        self.trainer = trainer
        self.data = data
        self.z = z
        self.budget = budget or DeployBudget()
        self.own = own  # None: no budget applies (any model is admitted)
        self.best: Pick | None = None  # the best admitted candidate seen after a round
        self.deployed: Pick | None = None  # set by `decide` when it is not the final personal

    @property
    def active(self) -> bool:
        return len(self.data.y_val) > 0

    def _fit(self, cand: Candidate) -> tuple[int, str | None]:
        """`cand`'s parameters, and why the budget refuses it (None: it admits it)."""
        spec, model = cand
        params = footprint(model).params
        if self.own is None:
            return params, None
        return params, self.budget.refusal(spec, self.own, params)

    def admits(self, cand: Candidate) -> bool:
        return self._fit(cand)[1] is None

    def _score(self, name: str, cand: Candidate, round_: int, final: bool) -> Pick:
        _, model = cand
        y = self.data.y_val
        z = self.trainer.logits(model, self.data.x_val)
        hits = (z.argmax(1) == y).cpu()
        loss = float(F.cross_entropy(z, y))
        params, refusal = self._fit(cand)
        return Pick(name, round_, final, hits, loss, source=cand, params=params, refusal=refusal)

    def observe(
        self,
        round_: int,
        candidates: Mapping[str, Candidate],
        scores: Mapping[str, Score] | None = None,
    ) -> None:
        """After a round's training: keep a copy of any candidate the budget admits that is
        better than the best so far. `scores`: a candidate's score when a stack of clients
        scored theirs at once (coordinator.stacking); the others are scored here."""
        if not self.active:
            return
        for name, cand in candidates.items():
            params, refusal = self._fit(cand)
            if refusal is not None:
                continue
            if scores is not None and name in scores:
                hits, loss, correct = scores[name]
                pick = Pick(
                    name, round_, False, hits, loss, source=cand, correct=correct, params=params
                )
            else:
                pick = self._score(name, cand, round_, final=False)
            if pick.beats(self.best):
                self.best = pick.kept()

    def weigh(
        self, personal: Candidate, tuned: Candidate, weights: Sequence[float]
    ) -> tuple[float, str, Candidate]:
        """The default the other candidates must beat: of the mixtures w·personal +
        (1 − w)·tuned over `weights`, the one with the lowest validation loss (on losses equal
        to float rounding, the earlier). Returns w, the candidate's name and the candidate:
        w = 1 is `personal` itself (PERSONAL), w = 0 `tuned` (FINETUNED), a device runs one model
        where mixing does not help; otherwise their `blend` (BLEND)."""
        x, y = self.data.x_val, self.data.y_val[:, None]
        own = F.log_softmax(self.trainer.logits(personal[1], x), 1).gather(1, y)
        other = F.log_softmax(self.trainer.logits(tuned[1], x), 1).gather(1, y)
        losses = [
            -float(torch.logaddexp(own + _log(w), other + _log(1 - w)).mean()) for w in weights
        ]
        best = 0
        for i, loss in enumerate(losses):
            if _lower(loss, losses[best]):
                best = i
        w = weights[best]
        if w == 1:
            return w, PERSONAL, personal
        if w == 0:
            return w, FINETUNED, tuned
        return w, BLEND, blend(personal, tuned, w)

    def clearly(self, a: Pick, b: Pick) -> tuple[bool, int, int]:
        """Whether `a` is clearly better than `b` on validation (b_ − c > z·√(b_ + c), see the
        module's docstring), with b_, the samples `a` alone gets right, and c, `b`'s."""
        wins = int((a.hits & ~b.hits).sum())
        losses = int((b.hits & ~a.hits).sum())
        return wins - losses > self.z * math.sqrt(wins + losses), wins, losses

    def replaces(self, student: Pick, chosen: Pick) -> bool:
        """Whether a student distilled from a clearly better teacher replaces `chosen`: when it
        is clearly better too."""
        return self.clearly(student, chosen)[0]

    def decide(
        self, rounds: int, final: Mapping[str, Candidate], distil: Distil | None = None
    ) -> dict[str, Any]:
        """After the last round: the model to deploy, and the finalize reply's details.

        `final` lists the models the client holds now, the default first (its personalized
        model, or what `weigh` chose). The default is the first the budget admits; the best of
        the other admitted ones and the kept copy replaces it only when the paired evidence is
        clear. Where a candidate the budget refuses is clearly better still, `distil` makes a
        student of the device's own architecture from it, which replaces the choice when it is
        clearly better in turn. `deployed` is the choice, None when it is the algorithm's final
        personalized model.
        """
        self.deployed = None
        if not self.active:
            return self.deploy_first(final, distil, "it has no validation data to choose by")
        picks = [self._score(name, cand, rounds, final=True) for name, cand in final.items()]
        admitted = [p for p in picks if p.refusal is None]
        others = admitted[1:] + ([self.best] if self.best is not None else [])
        chosen = admitted[0] if admitted else None
        reason = ""
        if chosen is not None:
            rival = _best(others)
            reason = f"{_cap(chosen.prose)} had {chosen.score} right on validation"
            if rival is None:
                reason += "; it was the only candidate within its budget"
            else:
                clear, b, c = self.clearly(rival, chosen)
                if clear:
                    reason = (
                        f"{_cap(rival.prose)} had {rival.score} right on validation: {b} that "
                        f"{chosen.prose} ({chosen.score}) missed, {c} the other way"
                    )
                    chosen = rival
                else:
                    reason += (
                        "; no other candidate within its budget was clearly better (the best, "
                        f"{rival.prose}, had {rival.score}: {b} more right, {c} fewer)"
                    )
        teacher = _best([p for p in picks if p.refusal is not None])
        outside = None
        if teacher is not None and (chosen is None or self.clearly(teacher, chosen)[0]):
            outside = f"{_cap(teacher.prose)} had {teacher.score} but {teacher.refusal}"
            student = self._student(teacher, chosen, distil, rounds)
            if student is not None and (chosen is None or self.replaces(student, chosen)):
                reason = f"{_cap(student.prose)} had {student.score} right on validation"
                if chosen is not None:
                    reason += f", against {chosen.score} for {chosen.prose}"
                chosen = student
                outside += "; a student of its own architecture learnt from it"
        if chosen is None:
            raise RuntimeError(
                "the guard found no model within the device's budget to deploy: "
                f"{'; '.join(f'{p.prose}: {p.refusal}' for p in picks)}"
            )
        self._deploy(chosen)
        details: dict[str, Any] = {"guard_val_acc": chosen.correct / chosen.total}
        details |= self._record(chosen, reason + ".", outside)
        return details

    def deploy_first(
        self, final: Mapping[str, Candidate], distil: Distil | None, why: str
    ) -> dict[str, Any]:
        """Without choosing on validation (the guard off, or no validation data, `why`): the
        first model of `final` the budget admits (the algorithm's own where it does); where
        none is admitted, a student of the device's own architecture distilled from the first
        (`distil`)."""
        self.deployed = None
        picks = [_unscored(name, c, *self._fit(c)) for name, c in final.items()]
        first = picks[0]
        chosen = next((p for p in picks if p.refusal is None), None)
        reason = f"{_cap(first.prose)}: the algorithm's final model ({why})"
        outside = None
        if chosen is not first:
            outside = f"{_cap(first.prose)}, the algorithm's final model, {first.refusal}"
            if chosen is None:
                chosen = self._student(first, None, distil, 0)
                if chosen is None:
                    raise RuntimeError(f"no model within the device's budget: {outside}")
                outside += "; a student of its own architecture learnt from it"
            reason = f"{_cap(chosen.prose)}: the first within its budget ({why})"
        self._deploy(chosen)
        return self._record(chosen, reason + ".", outside)

    def _student(
        self, teacher: Pick, start: Pick | None, distil: Distil | None, rounds: int
    ) -> Pick | None:
        """A student of the device's own architecture distilled from `teacher`, starting from
        `start` where that is one plain model of that architecture; None without `distil`.

        With validation data, a second student starts afresh and the better of the two on
        validation is returned: a start can be a model gradient descent no longer moves (a
        FedeRiCo client's own model, trained by its peers' gradients to their labels, saturates:
        its students from it kept its 0% on the device's labels, at the long size of
        benchmarks/personalization.py)."""
        if distil is None or teacher.source is None:
            return None
        begin: Candidate | None = None
        if start is not None and start.spec == self.own:  # live, or a kept copy
            begin = start.source or (start.spec, _built(start))
        starts = [begin, None] if begin is not None and self.active else [begin]
        best: Pick | None = None
        for origin in starts:
            made = distil(teacher.source, origin)
            if made is None:
                continue
            if self.active:
                pick = self._score(DISTILLED, made, rounds, final=True)
            else:
                pick = _unscored(DISTILLED, made, *self._fit(made))
            if best is None or pick.beats(best):
                best = pick
        return None if best is None else replace(best, teacher=teacher.prose)

    def _deploy(self, chosen: Pick) -> None:
        if chosen.name != PERSONAL or not chosen.final:
            self.deployed = chosen.kept()

    def _record(self, chosen: Pick, reason: str, outside: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"deployed": chosen.label, "deployed_reason": reason[:_REASON_CHARS]}
        if outside is not None:
            out["deployed_outside_budget"] = (outside + ".")[:_REASON_CHARS]
        return out

    # -- persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "best": None if self.best is None else self.best.to_state(),
            "deployed": None if self.deployed is None else self.deployed.to_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        best, deployed = state["best"], state["deployed"]
        self.best = None if best is None else Pick.from_state(best)
        self.deployed = None if deployed is None else Pick.from_state(deployed)


def _unscored(name: str, cand: Candidate, params: int, refusal: str | None) -> Pick:
    """A final candidate deployed without scoring it (no validation data, or the guard off)."""
    none = torch.zeros(0, dtype=torch.bool)
    return Pick(name, 0, True, none, 0.0, source=cand, params=params, refusal=refusal)


def _built(pick: Pick) -> nn.Module:
    assert pick.model is not None
    return pick.model.build()


def _best(picks: Sequence[Pick]) -> Pick | None:
    """The best of `picks` (`Pick.beats`; the first of equal ones)."""
    out: Pick | None = None
    for p in picks:
        if p.beats(out):
            out = p
    return out


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]
