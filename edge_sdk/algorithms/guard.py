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
  FedeRiCo the model of its architecture it weighs most, its own or a peer's) fine-tuned on the
  client's training split after the last round, the step of the FedAvg+FT baseline. Where data
  is scarce, that model, trained on everyone's data, is what a client of a small architecture
  cannot learn alone.
- *personal+finetuned*: the mixture w·personal + (1 − w)·finetuned of the two models' predicted
  probabilities (one `mixture` model), w chosen per client from `guard_mix_weights` by the lowest
  validation loss; w = 1 is the personalized model alone and w = 0 the fine-tuned one, so a
  device runs two models only where their mixture scores better. It is the default the others
  must clearly beat: measured on the benchmark's splits, the equal mixture was the best single
  choice on average, and weighing it per client kept more clients within 2 points of training
  alone (on the scarce splits, 14 of 20 rows against 11 with the equal mixture).

Under a deployment budget (edge_sdk.budget) the guard chooses among the candidates the budget
admits. Where it refuses the default (FedeRiCo's mixture of several models; the weighed mixture,
or the fine-tuned global model alone, on a device of another architecture than the global one),
the default within it is a student of that model of the device's own architecture, as with the
guard off: the first admitted candidate would otherwise be the default, and it can be far worse
(FedeRiCo's own model, trained by its neighbours to their labels, was useless to some clients).
At the long size of benchmarks/personalization.py, lg-digits, 10 seeds, that default lifted
FedeRiCo's own-architecture mean from 86.6 to 93.5, and its worst client from 7.2 points below
training alone to 3.5 above; docs/algorithms.md has the other algorithms' tables.

The test split is never looked at. A client without validation data deploys the algorithm's final
model. What the guard keeps (the best copy, its scores and which validation samples it got
right) is part of the client's persistent state, so a restarted device, or a round done again,
continues exactly.

Here: the `Guard`, which scores, keeps and chooses. What it chooses among (candidates, their
names, `blend`) is in edge_sdk.algorithms.candidates, a scored candidate (`Pick`) in
edge_sdk.algorithms.picks, its settings (`GuardConfig`) in edge_sdk.algorithms.guard_config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from edge_sdk.algorithms.candidates import (
    BLEND,
    DISTILLED,
    FINETUNED,
    PERSONAL,
    Candidate,
    blend,
)
from edge_sdk.algorithms.guard_config import GuardConfig
from edge_sdk.algorithms.picks import Pick, lower
from edge_sdk.budget import DeployBudget, footprint
from edge_sdk.client_data import ClientData
from edge_sdk.trainer import Score, Trainer
from model_zoo import ArchSpec

# The candidates' names, blend, GuardConfig and Pick are importable from here, as before.
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

_REASON_CHARS = 256  # a reply detail's limit


def _log(w: float) -> float:
    """log w, −∞ at 0 (a mixture's weight)."""
    return math.log(w) if w > 0 else -math.inf


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

    def _refusal(self, cand: Candidate) -> str | None:
        """Why the budget refuses `cand` (None: it admits it)."""
        spec, model = cand
        if self.own is None:
            return None
        return self.budget.refusal(spec, self.own, footprint(model).params)

    def admits(self, cand: Candidate) -> bool:
        return self._refusal(cand) is None

    def _score(self, name: str, cand: Candidate, round_: int, final: bool) -> Pick:
        _, model = cand
        y = self.data.y_val
        z = self.trainer.logits(model, self.data.x_val)
        hits = (z.argmax(1) == y).cpu()
        loss = float(F.cross_entropy(z, y))
        return Pick(name, round_, final, hits, loss, source=cand, refusal=self._refusal(cand))

    def better(self, a: Candidate, b: Candidate) -> bool:
        """Whether `a` does better than `b` on validation: more samples right, on a tie a lower
        loss (`Pick.beats`, as between the two students `_student` makes)."""
        return self._score(DISTILLED, a, 0, True).beats(self._score(DISTILLED, b, 0, True))

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
            if self._refusal(cand) is not None:
                continue
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
            if lower(loss, losses[best]):
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
        model, or what `weigh` chose). Where the budget refuses the default, the default within
        it is a student of it (`distil`; without one, the first model the budget admits), as
        with the guard off. The best of the other admitted ones and the kept copy replaces it
        only when the paired evidence is clear. Where a candidate the budget refuses is clearly
        better still, `distil` makes a student of the device's own architecture from it, which
        replaces the choice when it is clearly better in turn. `deployed` is the choice, None
        when it is the algorithm's final personalized model.
        """
        self.deployed = None
        if not self.active:
            return self.deploy_first(final, distil, "it has no validation data to choose by")
        picks = [self._score(name, cand, rounds, final=True) for name, cand in final.items()]
        admitted = [p for p in picks if p.refusal is None]
        # The default outside the budget (FedeRiCo's mixture; the weighed mixture of the
        # personalized and the fine-tuned model, or the fine-tuned global model alone, on a
        # device of another architecture): the default within it is a student of that model,
        # as with the guard off (`deploy_first`).
        default = picks[0] if picks else None
        outside = None
        if default is not None and default.refusal is not None:
            taught = self._student(default, admitted[0] if admitted else None, distil, rounds)
            if taught is not None:
                admitted.insert(0, taught)
                outside = (
                    f"{_cap(default.prose)} had {default.score} but {default.refusal}; a "
                    "student of its own architecture learnt from it"
                )
        others = admitted[1:] + ([self.best] if self.best is not None else [])
        chosen = admitted[0] if admitted else None
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
        details |= self._record(chosen, reason, outside)
        return details

    def first_student(
        self, rounds: int, final: Mapping[str, Candidate]
    ) -> tuple[Candidate, Candidate | None] | None:
        """The teacher and start of the first student `decide` makes for `final` (None: it makes
        none), found by running it up to that student and taking nothing of the run: where a
        stack of clients distils theirs at once (coordinator.stacking). Until its first
        student, `decide` draws no random numbers and changes nothing but what it deploys."""

        class _Wanted(Exception):
            pass

        def wanted(teacher: Candidate, start: Candidate | None) -> Candidate | None:
            raise _Wanted(teacher, start)

        deployed = self.deployed
        try:
            self.decide(rounds, final, wanted)
        except _Wanted as request:
            return cast(tuple[Candidate, Candidate | None], request.args)
        except RuntimeError:  # nothing within the budget: `decide` itself says so
            return None
        finally:
            self.deployed = deployed
        return None

    def deploy_first(
        self, final: Mapping[str, Candidate], distil: Distil | None, why: str
    ) -> dict[str, Any]:
        """Without choosing on validation (the guard off, or no validation data, `why`): the
        first model of `final`, the algorithm's own, where the budget admits it; where it does
        not, a student of the device's own architecture distilled from it (`distil`, starting
        from the first model the budget admits), or without one that first admitted model."""
        self.deployed = None
        picks = [_unscored(name, c, self._refusal(c)) for name, c in final.items()]
        first = picks[0]
        chosen = next((p for p in picks if p.refusal is None), None)
        reason = f"{_cap(first.prose)}: the algorithm's final model ({why})"
        outside = None
        if chosen is not first:
            outside = f"{_cap(first.prose)}, the algorithm's final model, {first.refusal}"
            student = self._student(first, chosen, distil, 0)
            if student is not None:
                chosen = student
                outside += "; a student of its own architecture learnt from it"
                reason = f"{_cap(chosen.prose)}: the algorithm's final model in its budget ({why})"
            elif chosen is None:
                raise RuntimeError(f"no model within the device's budget: {outside}")
            else:
                reason = f"{_cap(chosen.prose)}: the first within its budget ({why})"
        self._deploy(chosen)
        return self._record(chosen, reason, outside)

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
                pick = _unscored(DISTILLED, made, self._refusal(made))
            if best is None or pick.beats(best):
                best = pick
        return None if best is None else replace(best, teacher=teacher.prose)

    def _deploy(self, chosen: Pick) -> None:
        if chosen.name != PERSONAL or not chosen.final:
            self.deployed = chosen.kept()

    def _record(self, chosen: Pick, reason: str, outside: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"deployed": chosen.label, "deployed_reason": _sentence(reason)}
        if outside is not None:
            out["deployed_outside_budget"] = _sentence(outside)
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


def _unscored(name: str, cand: Candidate, refusal: str | None) -> Pick:
    """A final candidate deployed without scoring it (no validation data, or the guard off)."""
    none = torch.zeros(0, dtype=torch.bool)
    return Pick(name, 0, True, none, 0.0, source=cand, refusal=refusal)


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


def _sentence(clauses: str) -> str:
    """`clauses` ("a; b; c") as one sentence within a reply detail's limit (_REASON_CHARS):
    the last clauses left out until it fits, then cut."""
    text = clauses + "."
    while len(text) > _REASON_CHARS and "; " in text:
        text = text[: text.rindex("; ")] + "."
    return text[:_REASON_CHARS]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]
