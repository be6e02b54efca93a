"""fedme: cluster the personalized models by their outputs, exchange within clusters, and average
every trained copy of each model (paper 004, Algorithm 1).

The coordinator holds every client's current personalized model (any architecture; it is what it
returned to the client last round, or an initialisation of the client's registered ArchSpec
before the first) and an unlabeled set U. Each round:

1. it computes every sampled model's raw logits on U and clusters them with scikit-learn's
   KMeans (seeded) into K_t clusters, K_t following `cluster_counts` / `cluster_starts`;
2. each client gets a random other member of its cluster as its exchanged model, or a random
   other client when its cluster is a singleton;
3. with the trained replies, each model m becomes the mean of its owner's trained copy and every
   trained exchanged copy of it: w_m ← (w_m + Σ copies) / (s_m + 1);
4. each client gets back the aggregate of the model it chose (its own, or the exchanged one when
   it adopted it), in its next task, evaluation and finalize tasks.

The finalize task also carries up to `guard_distill_unlabeled` inputs of U (one seeded draw,
the same for every client), for the students of the device's guard to learn the teacher on
(each keeps them where it does better with them on the device's validation split).

This ships personalized models to other clients through the coordinator: a privacy cost the other
algorithms do not have.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from coordinator.robust import Contribution, RobustConfig, combine
from coordinator.strategies.base import (
    FitReply,
    IncompatibleClients,
    Strategy,
    StrategyError,
    register_strategy,
)
from edge_sdk.algorithms import BaseAlgorithmConfig
from edge_sdk.algorithms.fedme import FedMeConfig
from edge_sdk.codec import WireModel
from model_zoo import ArchSpec, build

LOGIT_LIMIT = 1e15  # squared distances of such outputs still fit in float32

__all__ = [
    "FedMeStrategy",
    "cluster_models",
    "exchange_partners",
    "per_model_average",
    "trained_copies",
]


def model_logits(models: Sequence[WireModel], inputs: torch.Tensor) -> np.ndarray:
    """Each model's raw logits on `inputs`, flattened: shape (len(models), N·classes).

    Each architecture is built once and runs every model's weights as they are
    (`functional_call`; the replies were checked to hold its tensors): building and loading a
    network per model was half of this for 100 mlps on 1,000 inputs."""
    rows = []
    nets: dict[str, torch.nn.Module] = {}
    with torch.inference_mode():
        for m in models:
            key = m.spec.to_json()
            if key not in nets:
                nets[key] = build(m.spec, seed=0).eval()
            net = nets[key]
            z = torch.cat(
                [
                    functional_call(net, m.weights, inputs[i : i + 1024])
                    for i in range(0, len(inputs), 1024)
                ]
            )
            rows.append(z.float().reshape(-1).numpy())
    # A model whose outputs overflow (weights within robust.max_abs can still multiply past
    # float32 through a deep network) must not crash the clustering: its non-finite or huge
    # outputs are clipped far beyond any sane model's (which stay untouched), so it sits alone.
    return np.clip(np.nan_to_num(np.stack(rows), nan=0.0), -LOGIT_LIMIT, LOGIT_LIMIT)


def cluster_models(features: np.ndarray, k: int, seed: int) -> np.ndarray:
    """KMeans labels of each row (one model's outputs), with at most one cluster per model."""
    k = min(k, len(features))
    if k == 1:
        return np.zeros(len(features), dtype=int)
    # Imported here: scikit-learn's import costs seconds in every process that loads the
    # strategies (each `edgefl client` does), and only FedMe's coordinator clusters.
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        # Two clients holding the same model give duplicate points: fewer distinct clusters.
        warnings.simplefilter("ignore", ConvergenceWarning)
        return KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(features)


def exchange_partners(
    ids: Sequence[str], labels: Sequence[int], rng: np.random.Generator
) -> dict[str, str]:
    """Per client, a random other member of its cluster; a random other client if it is alone."""
    if len(ids) < 2:
        raise StrategyError("fedme exchanges models between at least two clients per round")
    out: dict[str, str] = {}
    for cid, label in zip(ids, labels, strict=True):
        mates = [o for o, lab in zip(ids, labels, strict=True) if lab == label and o != cid]
        pool = mates or [o for o in ids if o != cid]
        out[cid] = pool[int(rng.integers(len(pool)))]
    return out


def trained_copies(
    replies: Mapping[str, FitReply],
    exchange: Mapping[str, str],
    starts: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, list[Contribution]]:
    """Per model owner m, the trained copies of m: the owner's own first ("personal" of its
    reply), then the "exchanged" models of the clients that were sent m, each with the state it
    started from (`starts`; None: itself, an update of nothing)."""
    trained: dict[str, list[Contribution]] = {}
    for cid, reply in replies.items():
        for m, name in ((cid, "personal"), (exchange[cid], "exchanged")):
            state = reply.models[name].weights
            copy = Contribution(cid, state, starts[m] if starts is not None else state)
            copies = trained.setdefault(m, [])
            if name == "personal":  # the owner's own copy first
                copies.insert(0, copy)
            else:
                copies.append(copy)
    return trained


def per_model_average(
    replies: Mapping[str, FitReply], exchange: Mapping[str, str]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per model owner m: (w_m + Σ trained copies of m) / (s_m + 1), uniformly (the strategy
    combines `trained_copies` with their starts, so that each update is bounded first).

    A model whose owner did not reply is the mean of its copies; one nobody trained is absent.
    """
    return combine(trained_copies(replies, exchange), RobustConfig(), {})


@register_strategy
class FedMeStrategy(Strategy):
    name = "fedme"
    config: FedMeConfig
    carries_unlabeled = True

    @classmethod
    def unlabeled_holdout(cls, config: BaseAlgorithmConfig) -> int:
        assert isinstance(config, FedMeConfig)
        return 0 if config.unlabeled_path else config.unlabeled_size

    def setup(self) -> None:
        if self.robust.aggregator == "krum":
            raise StrategyError(
                "fedme averages each model over its owner's copy and the two or three copies "
                "others trained: too few for krum (2f + 3); use robust.aggregator = median or "
                "trimmed_mean"
            )
        infos = list(self.clients.values())
        if len(infos) < 2 or (self.clients_per_round is not None and self.clients_per_round < 2):
            raise IncompatibleClients(
                "fedme exchanges models between clients: it needs at least 2 clients per round"
            )
        classes = {c.id: c.spec.num_classes for c in infos}
        if len(set(classes.values())) > 1:
            raise IncompatibleClients(
                f"fedme exchanges whole models, so every client needs the same classes: {classes}"
            )
        self.unlabeled = self.unlabeled_set(
            tuple(infos[0].spec.input_shape), "fedme clusters models on"
        )
        # Each client's personalized model starts as its own architecture, freshly initialised.
        self.models: dict[str, WireModel] = {
            c.id: WireModel(c.spec, build(c.spec, seed=self.seed * 1009 + i).state_dict())
            for i, c in enumerate(infos)
        }
        self.exchange: dict[str, str] = {}
        # The inputs the finalize tasks carry for the guard's students, drawn once, as
        # GlobalModelStrategy's.
        self.student_inputs = self.students_unlabeled(self.unlabeled, infos[0].spec.num_classes)

    def configure_fit(self, round_: int) -> dict[str, dict[str, WireModel]]:
        ids = self.sample(round_)
        k = self.config.clusters_at(round_, self.rounds)
        features = model_logits([self.models[c] for c in ids], self.unlabeled)
        labels = cluster_models(features, k, seed=int(self.rng.integers(2**31)))
        self.exchange = exchange_partners(ids, labels.tolist(), self.rng)
        return {
            c: {"personal": self.models[c], "exchanged": self.models[self.exchange[c]]} for c in ids
        }

    def expected_models(self, client_id: str) -> dict[str, ArchSpec]:
        return {
            "personal": self.models[client_id].spec,
            "exchanged": self.models[self.exchange[client_id]].spec,
        }

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        adopted: dict[str, bool] = {}
        for cid, reply in replies.items():
            flag = reply.metrics.get("adopted")
            if flag not in (0.0, 1.0):
                raise StrategyError(f"fedme: {cid} did not say whether it adopted (got {flag})")
            adopted[cid] = flag == 1.0
        starts = {m: model.weights for m, model in self.models.items()}
        averaged = self._combine(trained_copies(replies, self.exchange, starts))
        new = {m: WireModel(self.models[m].spec, weights) for m, weights in averaged.items()}
        # Each client gets back the aggregate of the model it chose; the rest keep their own.
        self.models = {
            cid: new.get(chosen, self.models[chosen])
            for cid in self.clients
            for chosen in [self.exchange[cid] if adopted.get(cid) else cid]
        }

    def configure_evaluate(self, round_: int) -> dict[str, dict[str, WireModel]]:
        return {cid: {"personal": m} for cid, m in self.models.items()}

    def configure_finalize(self) -> dict[str, dict[str, WireModel]]:
        plan = self.configure_evaluate(self.rounds)
        if self.student_inputs is None:
            return plan
        return {cid: self.with_student_inputs(models) for cid, models in plan.items()}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "models": {
                cid: {"spec": m.spec.to_json(), "weights": dict(m.weights)}
                for cid, m in self.models.items()
            },
            "exchange": dict(self.exchange),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.models = {
            cid: WireModel(
                ArchSpec.from_json(m["spec"]), {k: v.clone() for k, v in m["weights"].items()}
            )
            for cid, m in state["models"].items()
        }
        self.exchange = dict(state["exchange"])
