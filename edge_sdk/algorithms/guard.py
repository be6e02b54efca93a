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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, field_validator
from torch import nn

from edge_sdk.codec import WireModel
from edge_sdk.trainer import ClientData, Score, Trainer
from model_zoo import ArchSpec
from model_zoo.models.mixture import Mixture, mixture_spec

__all__ = ["BLEND", "FINETUNED", "PERSONAL", "Candidate", "Guard", "GuardConfig", "Pick", "blend"]

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
    """The config fields of every algorithm the guard serves."""

    # Deploy the best model seen on the validation split (see edge_sdk.algorithms.guard);
    # False deploys the algorithm's final personalized model, as the paper describes it.
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
    # and the fine-tuned model averaged (one `mixture` model: the device runs both); "personal",
    # the algorithm's own model (one model of the client's architecture, unless the guard finds
    # clear evidence for another).
    guard_default: Literal["mixture", "personal"] = "mixture"
    # [ours] The weights w of the personalized model tried for the "mixture" default,
    # w·personal + (1 − w)·finetuned; each client keeps the one with the lowest validation
    # loss (the first of equal ones). 1: the personalized model alone, 0: the fine-tuned one,
    # [0.5]: the equal mixture of earlier versions.
    guard_mix_weights: list[float] = Field(
        default_factory=lambda: [1.0, 0.75, 0.5, 0.25, 0.0], min_length=1
    )

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


@dataclass(frozen=True)
class Pick:
    """One scored candidate: which model, when, how it did on validation, and (once kept or
    deployed, `kept`) a copy of its weights."""

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
    def score(self) -> str:
        return f"{self.correct}/{self.total} (loss {self.loss:.3f})"

    def to_state(self) -> dict[str, Any]:
        assert self.model is not None, "only a kept pick is saved"
        return {
            "name": self.name,
            "round": self.round,
            "final": self.final,
            "hits": self.hits,
            "loss": self.loss,
            "model": self.model,
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
        )


class Guard:
    """Scores candidates on one client's validation split and remembers the best."""

    def __init__(self, trainer: Trainer, data: ClientData, z: float) -> None:
        self.trainer = trainer
        self.data = data
        self.z = z
        self.best: Pick | None = None  # the best candidate seen after a round's training
        self.deployed: Pick | None = None  # set by `decide` when it is not the final personal

    @property
    def active(self) -> bool:
        return len(self.data.y_val) > 0

    def _score(self, name: str, cand: Candidate, round_: int, final: bool) -> Pick:
        _, model = cand
        y = self.data.y_val
        z = self.trainer.logits(model, self.data.x_val)
        hits = (z.argmax(1) == y).cpu()
        loss = float(F.cross_entropy(z, y))
        return Pick(name, round_, final, hits, loss, source=cand)

    def observe(
        self,
        round_: int,
        candidates: Mapping[str, Candidate],
        scores: Mapping[str, Score] | None = None,
    ) -> None:
        """After a round's training: keep a copy of any candidate better than the best so far.
        `scores`: a candidate's score when a stack of clients scored theirs at once
        (edge_sdk.cohort); the others are scored here."""
        if not self.active:
            return
        for name, cand in candidates.items():
            if scores is not None and name in scores:
                hits, loss, correct = scores[name]
                pick = Pick(name, round_, False, hits, loss, source=cand, correct=correct)
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

    def decide(self, rounds: int, final: Mapping[str, Candidate]) -> dict[str, Any]:
        """After the last round: the model to deploy, and the finalize reply's details.

        `final` lists the models the client holds now, the default first (its personalized
        model, or what `weigh` chose). The best of the others and the kept copy replaces it
        only when the paired evidence is clear (see the module's docstring). `deployed` is the
        choice, None when it is the personalized model.
        """
        self.deployed = None
        if not self.active:
            return {
                "guard_choice": f"{PERSONAL} (final)",
                "guard_reason": "no validation data: the algorithm's final model is deployed",
            }
        picks = [self._score(name, cand, rounds, final=True) for name, cand in final.items()]
        default, others = picks[0], picks[1:] + ([self.best] if self.best is not None else [])
        rival: Pick | None = None
        for pick in others:
            if pick.beats(rival):
                rival = pick
        chosen, reason = default, f"the final {default.name} model, {default.score}"
        if rival is None:
            reason += ", was the only candidate"
        else:
            b = int((rival.hits & ~default.hits).sum())
            c = int((default.hits & ~rival.hits).sum())
            evidence = f"; {rival.label}, {rival.score}, right on {b} it missed, wrong on {c}"
            if b - c > self.z * math.sqrt(b + c):
                chosen = rival
                reason = f"{rival.label} on validation, {rival.score}, right on {b} samples the "
                reason += f"final {default.name} model, {default.score}, missed; wrong on {c}"
            else:
                reason += f", kept: no clear evidence against it{evidence}"
        if chosen.name != PERSONAL or not chosen.final:
            self.deployed = chosen.kept()
        return {
            "guard_choice": chosen.label,
            "guard_arch": chosen.spec.family,
            "guard_val_acc": chosen.correct / chosen.total,
            "guard_reason": reason[:_REASON_CHARS],
        }

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
