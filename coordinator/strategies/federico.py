"""federico: the coordinator keeps only membership and the round clock.

No model or gradient passes through it. Each round is two steps with a barrier after each:
`exchange` (every online client fetches its neighbours' published models and sends them
gradients) and `update` (each client applies its own gradient plus those it was sent; its task
names who sent it one, from the exchange replies). From the update replies it records each
client's weights over the others, the matrix FedeRiCo's paper draws (its Figure 3), into
results.json as `collaboration` (rows: clients, columns: the models they weigh) and its history.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from coordinator.strategies.base import FitReply, Strategy, StrategyError, register_strategy
from edge_sdk.algorithms.federico import FedeRiCoConfig
from edge_sdk.codec import WireModel

log = logging.getLogger(__name__)


@register_strategy
class FedeRiCoStrategy(Strategy):
    name = "federico"
    aggregates = False
    # No model passes through its coordinator; its finalize tasks can carry inputs of the
    # coordinator's own for the guard's students (`guard_distill_unlabeled`).
    carries_unlabeled = True
    config: FedeRiCoConfig
    steps = ("exchange", "update")

    def setup(self) -> None:
        if len(self.clients) < 2:
            raise StrategyError("federico needs at least two clients to collaborate")
        classes = {c.spec.num_classes for c in self.clients.values()}
        if len(classes) > 1:
            raise StrategyError("federico mixes whole models: every client needs the same classes")
        self._members: list[str] = []
        self._exchanged: list[str] = []
        self._senders: dict[str, list[str]] = {}
        # Each client's latest row of weights, and every round's rows while the matrices fit
        # `history_limit` entries (clients² a round): a large fleet keeps only the latest.
        self.latest: dict[str, dict[str, float]] = {}
        self.history: list[dict[str, Any]] | None = []
        self.take_student_inputs(next(iter(self.clients.values())).spec)

    def configure_step(self, round_: int, step: str) -> dict[str, dict[str, WireModel]]:
        if step == "exchange":
            self._members = self.sample(round_)
            return {cid: {} for cid in self._members}
        return {cid: {} for cid in self._exchanged}

    def task_params(self, round_: int, step: str, client_id: str) -> dict[str, Any]:
        if step == "exchange":
            return {"members": list(self._members)}
        return {"from": self._senders.get(client_id, [])}

    def aggregate_step(self, round_: int, step: str, replies: Mapping[str, FitReply]) -> None:
        if step == "exchange":
            self._exchanged = sorted(replies)
            self._senders = {}
            for sender, reply in replies.items():
                sent = reply.details.get("sent_to") or ""
                if not isinstance(sent, str):
                    raise StrategyError(f"federico: {sender} reported sent_to={sent!r}")
                for to in filter(None, sent.split(",")):
                    self._senders.setdefault(to, []).append(sender)
            return
        row = {
            cid: {
                k[2:]: float(v)
                for k, v in reply.details.items()
                if k.startswith("w:") and isinstance(v, int | float)
            }
            for cid, reply in replies.items()
        }
        self.latest |= row  # a client that missed this round keeps its last row
        if self.history is None:
            return
        if (len(self.history) + 1) * len(self.clients) ** 2 > self.history_limit:
            log.info(
                "federico: %d rounds of %d×%d collaboration matrices exceed "
                "round.client_history (%d): results keep the latest matrix only",
                len(self.history) + 1,
                len(self.clients),
                len(self.clients),
                self.history_limit,
            )
            self.history = None
            return
        self.history.append({"round": round_, "weights": row})

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        self.aggregate_step(round_, self.steps[-1], replies)

    def _matrix(
        self, weights: Mapping[str, Mapping[str, float]], ids: list[str]
    ) -> list[list[float]]:
        return [[float(weights.get(i, {}).get(j, 0.0)) for j in ids] for i in ids]

    def _weighed(self) -> list[str]:
        """The clients of the final matrix: every one while clients² fits `history_limit`;
        beyond (a population), those with a row or a weight of their model, which loses no
        entry but zeros (1,000 clients of FedeRiCo wrote 11 MB of matrix, 10,000 would 1 GB)."""
        ids = list(self.clients)
        if len(ids) ** 2 <= self.history_limit:
            return ids
        rows = self.latest.values()
        weighed = set(self.latest) | {j for row in rows for j, w in row.items() if w}
        kept = [c for c in ids if c in weighed]
        log.info(
            "federico: a %d×%d collaboration matrix exceeds round.client_history (%d): results "
            "keep the %d clients with a row or a weight (every other entry is 0)",
            len(ids),
            len(ids),
            self.history_limit,
            len(kept),
        )
        return kept

    def results(self) -> dict[str, Any]:
        ids = self._weighed()
        if not ids:  # no round's weights arrived
            return {}
        found: dict[str, Any] = {
            "collaboration_clients": ids,
            "collaboration": self._matrix(self.latest, ids),
        }
        if self.history is not None:
            found["collaboration_history"] = [
                {"round": e["round"], "matrix": self._matrix(e["weights"], ids)}
                for e in self.history
            ]
        return found

    def state_dict(self) -> dict[str, Any]:
        history = None if self.history is None else list(self.history)
        return super().state_dict() | {"history": history, "latest": dict(self.latest)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        history = state["history"]
        self.history = None if history is None else list(history)
        if "latest" in state:
            self.latest = {cid: dict(row) for cid, row in state["latest"].items()}
        else:  # a checkpoint from before the latest rows were kept apart
            self.latest = {}
            for entry in self.history or []:
                self.latest |= entry["weights"]
