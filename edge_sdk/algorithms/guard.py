"""The guard: each client deploys the best model it has seen on its own validation split.

A personalized algorithm can leave a client worse off than training alone: a weak global model
distilled into it, a schedule that suits other clients, a round that overshot. The guard costs no
extra training. After every round's local training it scores the models the client could deploy
at that moment (the algorithm names them: its personalized model and, for most, a model of the
global architecture it has just trained on its own data) on the client's **validation** split, and
keeps a copy of the best one so far. After the last round it compares that copy with the final
models and deploys whichever is best. The test split is never looked at.

Order: more correct validation samples wins; on equal counts, the lower validation loss. The
algorithm's own final personalized model is the default: another candidate replaces it only when
strictly better. A client without validation data deploys the algorithm's final model.

What the guard keeps (the best copy and its scores) is part of the client's persistent state, so a
restarted device, or a round done again, continues exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field
from torch import nn

from edge_sdk.codec import WireModel
from edge_sdk.trainer import ClientData, Trainer
from model_zoo import ArchSpec

__all__ = ["PERSONAL", "Candidate", "Guard", "GuardConfig", "Pick"]

# What the guard may deploy: a name ("personal", "meme"...) → (architecture, model).
Candidate = tuple[ArchSpec, nn.Module]

# The name of the algorithm's own personalized model among the candidates.
PERSONAL = "personal"


class GuardConfig(BaseModel):
    """The config field of every algorithm the guard serves."""

    # Deploy the best model seen on the validation split (see edge_sdk.algorithms.guard);
    # False deploys the algorithm's final personalized model, as the paper describes it.
    guard: bool = Field(True)


@dataclass(frozen=True)
class Pick:
    """One scored candidate: which model, when, how it did on validation, and its weights."""

    name: str
    round: int  # the round whose training produced it
    final: bool  # one of the models the client held after the last round (finalize)
    correct: int
    total: int
    loss: float
    model: WireModel

    def beats(self, other: Pick | None) -> bool:
        """More correct validation samples; on a tie, a lower validation loss."""
        if other is None:
            return True
        if self.correct != other.correct:
            return self.correct > other.correct
        return self.loss < other.loss

    @property
    def label(self) -> str:
        when = "final" if self.final else f"round {self.round}"
        return f"{self.name} ({when}, {self.model.spec.family})"

    @property
    def score(self) -> str:
        return f"{self.correct}/{self.total} (loss {self.loss:.3f})"

    def to_state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "round": self.round,
            "final": self.final,
            "correct": self.correct,
            "total": self.total,
            "loss": self.loss,
            "model": self.model,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Pick:
        return cls(
            name=str(state["name"]),
            round=int(state["round"]),
            final=bool(state["final"]),
            correct=int(state["correct"]),
            total=int(state["total"]),
            loss=float(state["loss"]),
            model=state["model"],
        )


class Guard:
    """Scores candidates on one client's validation split and remembers the best."""

    def __init__(self, trainer: Trainer, data: ClientData) -> None:
        self.trainer = trainer
        self.data = data
        self.best: Pick | None = None  # the best candidate seen after a round's training
        self.deployed: Pick | None = None  # set by `decide` when it is not the final personal

    @property
    def active(self) -> bool:
        return len(self.data.y_val) > 0

    def _score(self, name: str, cand: Candidate, round_: int, final: bool) -> Pick:
        spec, model = cand
        r = self.trainer.evaluate(model, self.data.x_val, self.data.y_val)
        return Pick(name, round_, final, r.correct, r.total, r.loss, WireModel.of(spec, model))

    def observe(self, round_: int, candidates: Mapping[str, Candidate]) -> None:
        """After a round's training: keep a copy of any candidate better than the best so far."""
        if not self.active:
            return
        for name, cand in candidates.items():
            pick = self._score(name, cand, round_, final=False)
            if pick.beats(self.best):
                self.best = pick

    def decide(self, rounds: int, final: Mapping[str, Candidate]) -> dict[str, Any]:
        """After the last round: deploy the best of the final models and the kept copy.

        `final` lists the models the client holds now, its personalized model first (under
        PERSONAL); the others replace it only when strictly better. Returns the details for the
        finalize reply: what was chosen, its architecture and validation accuracy, and why.
        """
        self.deployed = None
        if not self.active:
            return {
                "guard_choice": f"{PERSONAL} (final)",
                "guard_reason": "no validation data: the algorithm's final model is deployed",
            }
        picks = [self._score(name, cand, rounds, final=True) for name, cand in final.items()]
        if self.best is not None:
            picks.append(self.best)
        default = picks[0]
        chosen = default
        for pick in picks[1:]:
            if pick.beats(chosen):
                chosen = pick
        if chosen is default:
            runner = max(
                picks[1:],
                key=lambda p: (p.correct, -p.loss),
                default=None,
            )
            reason = f"the final {default.name} model did best on validation, {default.score}"
            if runner is not None:
                reason += f"; next: {runner.label}, {runner.score}"
        else:
            self.deployed = chosen
            reason = (
                f"on validation, {chosen.score} against {default.score} for the final "
                f"{default.name} model"
            )
        return {
            "guard_choice": chosen.label,
            "guard_arch": chosen.model.spec.family,
            "guard_val_acc": chosen.correct / chosen.total,
            "guard_reason": reason,
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
