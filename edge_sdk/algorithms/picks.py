"""A candidate the guard scored (`Pick`): which model, from which round, how it did on the
client's validation split, whether the device's budget admits it, how a reply's reasons name it,
and, once kept, a copy of its weights that the client's persistent state saves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from edge_sdk.algorithms.candidates import BLEND, DISTILLED, FINETUNED, PEERS, PERSONAL, Candidate
from edge_sdk.budget import arch_name
from edge_sdk.codec import WireModel
from model_zoo import ArchSpec

__all__ = ["Pick", "lower"]

_LOSS_ROUNDING = 1e-6  # relative: validation losses closer than this are equal


def lower(loss: float, than: float) -> bool:
    """`loss` is below `than` by more than float rounding (_LOSS_ROUNDING)."""
    return loss < than - _LOSS_ROUNDING * max(1.0, abs(than))


# How a reply's reasons name each candidate.
_PROSE = {
    PERSONAL: "its personalized model",
    FINETUNED: "the final model fine-tuned here",
    BLEND: "its personalized and the fine-tuned model mixed",
    PEERS: "the trained copies of the global model that do best here, mixed",
    f"{PERSONAL}+{PEERS}": "its personalized model and the best trained copies mixed",
    f"{FINETUNED}+{PEERS}": "the final model fine-tuned here and the best trained copies mixed",
    f"{BLEND}+{PEERS}": "its personalized, the fine-tuned model and the best trained copies mixed",
    "global": "the final global model",
    "meme": "its meme",
    "local": "its local model",
    "teacher": "its teacher",
    "own": "its own model",
    "peer": "a peer's model",
    "tuned_global": "the global model trained here",
}


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
        return lower(self.loss, other.loss)

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
            teacher=str(state.get("teacher", "")) or None,
        )
