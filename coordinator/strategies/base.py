"""The server half of an algorithm: who trains, with what, and how replies fold into the state.

The round loop lives once in `coordinator.server`; a Strategy only fills in the per-round hooks
(`configure_fit`, `aggregate_fit`, the models sent for evaluation and finalisation) and keeps its
whole state round-trippable through `state_dict()` / `load_state_dict()` for checkpoints.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from coordinator.config_sections import RoundConfig
from coordinator.robust import Contribution, RobustConfig, cap_weights, combine
from coordinator.server_data import ServerData, load_unlabeled
from edge_sdk.algorithms import BaseAlgorithmConfig, Detail, algorithm_class
from edge_sdk.algorithms.deployment import UNLABELED, peer_name, unlabeled_model
from edge_sdk.algorithms.guard_config import GuardConfig
from edge_sdk.codec import WireModel
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec, build

__all__ = [
    "ClientInfo",
    "FitReply",
    "GlobalModelStrategy",
    "IncompatibleClients",
    "ServerData",
    "Strategy",
    "StrategyError",
    "by_what",
    "count_clients",
    "register_strategy",
    "strategy_class",
    "strategy_names",
    "weighted_mean",
]


class StrategyError(ValueError):
    """A reply or configuration the strategy cannot fold in."""


def by_what(said: Mapping[str, object], shown: int = 3) -> str:
    """Client ids grouped by what is said of each, the largest group first, naming at most
    `shown` of a group: `mlp(...): c1, c3, c5 and 497 more; lstm(...): c2`. An error about a
    population stays a line, not 10,000 ids."""
    groups: dict[str, list[str]] = {}
    for cid, what in said.items():
        groups.setdefault(str(what), []).append(cid)
    parts = []
    for what, ids in sorted(groups.items(), key=lambda g: -len(g[1])):
        more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
        parts.append(f"{what}: {', '.join(ids[:shown])}{more}")
    return "; ".join(parts)


def count_clients(ids: Mapping[str, object]) -> str:
    """`1 client`, `1,000 clients`: how many `ids` are, in English."""
    return f"{len(ids):,} client{'' if len(ids) == 1 else 's'}"


class IncompatibleClients(StrategyError):
    """The registered clients cannot run this algorithm together (e.g. FedAvg across archs)."""


@dataclass(frozen=True)
class ClientInfo:
    id: str
    spec: ArchSpec
    capabilities: Capabilities


@dataclass
class FitReply:
    client_id: str
    models: dict[str, WireModel]
    metrics: dict[str, float] = field(default_factory=dict)
    n_samples: int = 0
    details: dict[str, Detail] = field(default_factory=dict)


def weighted_mean(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Σ w_i·s_i / Σ w_i per float tensor; integer buffers (BN step counters) take the max."""
    if not states or len(states) != len(weights):
        raise StrategyError(f"cannot average {len(states)} states with {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        raise StrategyError(f"aggregation weights sum to {total}")
    first = states[0]
    floats = [k for k, t in first.items() if t.is_floating_point()]
    # One float64 accumulator per tensor, each state added to all of them in one foreach call
    # (a call per state, not per state and tensor: 20 clients' replies made a twentieth of a
    # stacked round's operator calls here).
    acc = [torch.zeros_like(first[k], dtype=torch.float64) for k in floats]
    for s, w in zip(states, weights, strict=True):
        torch._foreach_add_(acc, [s[k] for k in floats], alpha=w / total)
    out = {k: a.to(first[k].dtype) for k, a in zip(floats, acc, strict=True)}
    for key, t in first.items():
        if not t.is_floating_point():
            out[key] = torch.stack([s[key] for s in states]).max(dim=0).values
    return {k: out[k] for k in first}


class Strategy(ABC):
    name: ClassVar[str]
    # Facts of the algorithm, stated once here. Every client trains one architecture, the global
    # one (a baseline of a mixed federation runs it on every client):
    one_architecture: ClassVar[bool] = False
    # The server keeps a global model of `global_spec` (it needs one to start):
    has_global_model: ClassVar[bool] = False
    # Its aggregation makes models the clients receive (a round that makes most of them much
    # worse is rolled back, coordinator.robust); False for local training and FedeRiCo.
    aggregates: ClassVar[bool] = True
    # Its finalize tasks can carry the clients' trained copies of one global model for the
    # guard's `guard_peers` (GlobalModelStrategy).
    offers_peers: ClassVar[bool] = False
    # Its finalize tasks can carry unlabeled inputs of the coordinator's for the guard's
    # students (`guard_distill_unlabeled`; GlobalModelStrategy, FedMe, FedeRiCo).
    carries_unlabeled: ClassVar[bool] = False

    def __init__(
        self,
        config: BaseAlgorithmConfig,
        *,
        clients: Mapping[str, ClientInfo],
        global_spec: ArchSpec | None,
        rounds: int,
        clients_per_round: int | None = None,
        seed: int = 0,
        server_data: ServerData | None = None,
        robust: RobustConfig | None = None,
    ) -> None:
        self.config = config
        # The guard's settings, where the algorithm has a guard (none for the baselines).
        self.guard_config = config if isinstance(config, GuardConfig) else None
        self.server_data = server_data or ServerData()
        # How aggregation bounds each client (coordinator.robust), and the clients it flagged
        # in the round being aggregated (clipped, capped), with why; the coordinator clears it.
        self.robust = robust or RobustConfig()
        self.flags: dict[str, str] = {}
        # What the round's aggregation combined (per aggregate, each client's contribution):
        # the coordinator names suspects from it when it rolls a round back.
        self.cohort: dict[str, list[Contribution]] = {}
        self.clients = dict(sorted(clients.items()))
        self.global_spec = global_spec
        self.rounds = rounds
        self.clients_per_round = clients_per_round
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        # The clients the coordinator can reach now (None: all); offline ones are not sampled.
        self.available: set[str] | None = None
        # The inputs the finalize tasks carry for the guard's students (`guard_distill_unlabeled`;
        # `take_student_inputs`, from `setup`).
        self.student_inputs: WireModel | None = None
        # The most per-client entries a strategy keeps of its own history for results.json
        # (the run's `round.client_history`; the coordinator sets it).
        self.history_limit = RoundConfig().client_history
        guard = self.guard_config
        if guard is not None and guard.guard_peers and not self.offers_peers:
            raise StrategyError(
                f"{self.name}: guard_peers mixes the clients' trained copies of one global "
                "model, which this algorithm has not (fml, pfml and persfl have): set "
                f"{self.name}.guard_peers = 0"
            )
        if guard is not None and guard.guard_distill_unlabeled and not self.carries_unlabeled:
            raise StrategyError(
                f"{self.name}: guard_distill_unlabeled sends the coordinator's unlabeled inputs "
                "with the finalize tasks, which this algorithm's coordinator does not send (fml, "
                f"pfml, persfl, fedme and federico do): set {self.name}.guard_distill_unlabeled = 0"
            )

    @classmethod
    def unlabeled_holdout(cls, config: BaseAlgorithmConfig) -> int:
        """How many samples a simulation holds out of the dataset as this strategy's unlabeled set:
        the inputs the guard's students learn on (`guard_distill_unlabeled`), unless the config
        names a file of them (`unlabeled_path`).

        The simulator removes them before partitioning (so every run on that split, baselines
        included, trains on the same data) and passes them in as `server_data.unlabeled`.
        """
        if (
            not cls.carries_unlabeled
            or not isinstance(config, GuardConfig)
            or config.unlabeled_path
        ):
            return 0
        return config.guard_distill_unlabeled

    def unlabeled_set(self, input_shape: tuple[int, ...], needs: str) -> torch.Tensor:
        """The coordinator's unlabeled inputs: the file `unlabeled_path` names, else those a
        simulation held out (`server_data`); `needs` says what for where there are none."""
        assert self.guard_config is not None
        path = self.guard_config.unlabeled_path
        u = load_unlabeled(path) if path else self.server_data.unlabeled
        if u is None:
            raise StrategyError(
                f"{needs} an unlabeled set the coordinator holds: name a .npy or .safetensors "
                f"file of inputs in {self.name}.unlabeled_path"
            )
        if tuple(u.shape[1:]) != input_shape:
            raise StrategyError(
                f"the unlabeled inputs have shape {tuple(u.shape[1:])} but the clients' models "
                f"take {input_shape}"
            )
        return u

    def students_unlabeled(self, u: torch.Tensor, classes: int) -> WireModel | None:
        """The inputs of `u` the finalize tasks carry for the guards' students (one object for
        every client: the network sends it once): `guard_distill_unlabeled` of them, a draw
        seeded by the run's seed alone, in `u`'s order; None where the students make none."""
        cfg = self.guard_config
        assert cfg is not None
        count = min(cfg.guard_distill_unlabeled, len(u))
        if count == 0 or cfg.guard_distill_epochs == 0:
            return None
        if count < len(u):
            drawn = np.random.default_rng(self.seed).choice(len(u), size=count, replace=False)
            u = u[torch.from_numpy(np.sort(drawn))]
        return unlabeled_model(u.float().contiguous(), classes)

    def take_student_inputs(self, spec: ArchSpec) -> None:
        """With `guard_distill_unlabeled`, draw the coordinator's inputs that the finalize tasks
        carry for the guard's students (`student_inputs`), for models taking `spec`'s inputs;
        a strategy that `carries_unlabeled` calls it from `setup`."""
        cfg = self.guard_config
        if cfg is None or not cfg.guard_distill_unlabeled:
            return
        by = ""
        if cfg.preset == "trusted":
            by = f" ({cfg.guard_distill_unlabeled}: the preset 'trusted')"
        u = self.unlabeled_set(
            tuple(spec.input_shape),
            f"{self.name}'s guard_distill_unlabeled{by} sends its students inputs of",
        )
        self.student_inputs = self.students_unlabeled(u, spec.num_classes)

    def with_student_inputs(self, models: Mapping[str, WireModel]) -> dict[str, WireModel]:
        """`models` and, where there are any, the students' inputs (`UNLABELED`)."""
        if self.student_inputs is None:
            return dict(models)
        return {**models, UNLABELED: self.student_inputs}

    def _combine(
        self, groups: Mapping[str, list[Contribution]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Each group's contributions combined into one state (`coordinator.robust.combine`)."""
        self.cohort = dict(groups)
        return combine(groups, self.robust, self.flags)

    # -- hooks -----------------------------------------------------------------------------
    def setup(self) -> None:  # noqa: B027  (optional hook: most strategies need no setup)
        """Check the clients can run together and build the initial state."""

    def online(self) -> list[str]:
        """The registered clients that are reachable now, in id order."""
        return [c for c in self.clients if self.available is None or c in self.available]

    def sample(self, round_: int) -> list[str]:
        """Clients that train this round: all reachable ones, or `clients_per_round` of them
        drawn without replacement."""
        ids = self.online()
        k = self.clients_per_round
        if k is None or k >= len(ids):
            return ids
        return sorted(self.rng.choice(ids, size=k, replace=False).tolist())

    def configure_fit(self, round_: int) -> dict[str, dict[str, WireModel]]:
        """Per client that trains this round, the models its task carries."""
        shared = self.eval_models()
        return {cid: shared for cid in self.sample(round_)}

    @abstractmethod
    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        """Fold the valid replies (sorted by client id) into the state."""

    # A round's fit phase as several steps with a barrier after each (decentralized algorithms:
    # exchange, then update); the default is one step, `configure_fit` / `aggregate_fit`.
    steps: ClassVar[tuple[str, ...]] = ("",)

    def configure_step(self, round_: int, step: str) -> dict[str, dict[str, WireModel]]:
        """Per client that takes part in this step, the models its task carries."""
        return self.configure_fit(round_)

    def aggregate_step(self, round_: int, step: str, replies: Mapping[str, FitReply]) -> None:
        """Fold one step's valid replies in (the last step's are the round's)."""
        self.aggregate_fit(round_, replies)

    def task_params(self, round_: int, step: str, client_id: str) -> dict[str, Any]:
        """Per-client parameters of a fit step's task (JSON values; default none)."""
        return {}

    def late_joiner_models(self) -> dict[str, WireModel]:
        """Models published (retained) after the run for clients that join later, named as a
        finalize task would carry them (default none; PersFL: its archived global models)."""
        return {}

    def results(self) -> dict[str, Any]:
        """Algorithm-specific fields for results.json (e.g. FedeRiCo's collaboration)."""
        return {}

    def quorum_clients(self, plan: Mapping[str, object]) -> set[str]:
        """The clients of this round's `plan` whose fit replies the aggregation needs: the
        round's quorum counts valid replies among these only (default: every client planned)."""
        return set(plan)

    def expected_models(self, client_id: str) -> dict[str, ArchSpec]:
        """Models (name → spec) a fit reply from this client must carry."""
        return {}

    @property
    def partial_models(self) -> frozenset[str]:
        """Names of reply models that may carry a subset of their tensors."""
        return frozenset()

    def eval_models(self) -> dict[str, WireModel]:
        """Models sent with evaluation tasks (typically the global model)."""
        return {}

    def finalize_models(self) -> dict[str, WireModel]:
        """Models sent with the finalize tasks: `eval_models` and the students' inputs."""
        return self.with_student_inputs(self.eval_models())

    def configure_evaluate(self, round_: int) -> dict[str, dict[str, WireModel]]:
        """Per client, the models its evaluation task carries (default: `eval_models` to all).

        Every client receives the same dict object, so the coordinator encodes it once.
        """
        shared = self.eval_models()
        return {cid: shared for cid in self.clients}

    def configure_finalize(self) -> dict[str, dict[str, WireModel]]:
        """Per client, the models its finalize task carries (default: `finalize_models` to all)."""
        shared = self.finalize_models()
        return {cid: shared for cid in self.clients}

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class GlobalModelStrategy(Strategy):
    """A strategy with one global model of `global_spec` (FedAvg and friends, FML, PFML)."""

    has_global_model = True
    offers_peers = True
    carries_unlabeled = True

    def setup(self) -> None:
        if self.global_spec is None:
            raise StrategyError(
                f"{self.name} needs a global model architecture: the clients run different "
                "architectures, so name one with `global_model` (e.g. --set global_model=lenet5)"
            )
        self.global_weights = {
            k: v.detach().clone()
            for k, v in build(self.global_spec, seed=self.seed).state_dict().items()
        }
        # The last aggregation's trained copies the finalize tasks offer (`guard_peers`).
        self.copies: dict[str, dict[str, torch.Tensor]] = {}
        self.take_student_inputs(self.global_spec)

    @property
    def global_model(self) -> WireModel:
        assert self.global_spec is not None
        return WireModel(self.global_spec, self.global_weights)

    def eval_models(self) -> dict[str, WireModel]:
        return {"global": self.global_model}

    def finalize_models(self) -> dict[str, WireModel]:
        """The global model and, with `guard_peers`, the last aggregation's trained copies of it,
        at most `guard_peers_offered` (a draw seeded by the run's seed alone), named by client
        (`peer_name`); with `guard_distill_unlabeled`, the inputs the guard's students learn on
        (`UNLABELED`)."""
        out = self.with_student_inputs(self.eval_models())
        assert self.global_spec is not None
        return out | {
            peer_name(c): WireModel(self.global_spec, self.copies[c]) for c in self._offered()
        }

    def _offered(self, ids: Iterable[str] | None = None) -> list[str]:
        """Of `ids` (default: the copies kept), those a finalize task carries: every one, or
        `guard_peers_offered` of them, a draw seeded by the run's seed alone, in id order."""
        ids = sorted(self.copies if ids is None else ids)
        offered = self.guard_config.guard_peers_offered if self.guard_config else 0
        if len(ids) > offered:
            drawn = np.random.default_rng(self.seed).choice(len(ids), size=offered, replace=False)
            ids = [ids[i] for i in sorted(drawn)]
        return ids

    def _require_classes(self) -> None:
        assert self.global_spec is not None
        bad = {
            c.id: c.capabilities.num_classes
            for c in self.clients.values()
            if c.capabilities.num_classes != self.global_spec.num_classes
        }
        if bad:
            raise IncompatibleClients(
                f"{self.name}: global model has {self.global_spec.num_classes} classes but "
                f"{count_clients(bad)} {'has' if len(bad) == 1 else 'have'} others ({by_what(bad)})"
            )

    def _require_same_arch(self) -> None:
        archs = {c.id: str(c.spec) for c in self.clients.values() if c.spec != self.global_spec}
        if archs:
            raise IncompatibleClients(
                f"{self.name} averages one architecture; the global model is {self.global_spec} "
                f"but {count_clients(archs)} registered another ({by_what(archs)}). Use fml, pfml, "
                "persfl or fedme for heterogeneous models."
            )

    def _weights(self, replies: Mapping[str, FitReply]) -> list[float]:
        """Each reply's weight: 1, or (`weighting = "by_samples"`) the samples it trained on,
        capped (coordinator.robust) so that no client can claim the aggregate."""
        if getattr(self.config, "weighting", "uniform") == "by_samples":
            claimed = {cid: float(max(1, r.n_samples)) for cid, r in replies.items()}
            return cap_weights(claimed, self.robust, self.flags)
        return [1.0] * len(replies)

    def _aggregate(
        self, states: Mapping[str, Mapping[str, torch.Tensor]], weights: Sequence[float]
    ) -> dict[str, torch.Tensor]:
        """The clients' states (each trained from `global_weights`) combined into one, each
        update bounded and combined as `robust` says: the weighted mean of the states where
        none is clipped."""
        group = [
            Contribution(cid, state, self.global_weights, w)
            for (cid, state), w in zip(states.items(), weights, strict=True)
        ]
        before = dict(self.flags)
        out = self._combine({"global": group})["global"]
        if self.guard_config is not None and self.guard_config.guard_peers:
            # Kept for the finalize tasks (`finalize_models`): the copies aggregation took as
            # they came, not those it had to bound (clipped, pulled in, left out by krum); of a
            # larger cohort, only those a finalize would carry (held and checkpointed each round).
            kept = [cid for cid in states if self.flags.get(cid) == before.get(cid)]
            self.copies = {cid: dict(states[cid]) for cid in self._offered(kept)}
        return out

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict() | {"global": dict(self.global_weights)}
        if self.copies:
            out["copies"] = {cid: dict(state) for cid, state in self.copies.items()}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_weights = {k: v.clone() for k, v in state["global"].items()}
        self.copies = {
            cid: {k: v.clone() for k, v in copy.items()}
            for cid, copy in state.get("copies", {}).items()
        }


_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    if cls.name in _REGISTRY:
        raise ValueError(f"strategy {cls.name!r} is already registered")
    algorithm_class(cls.name)  # every strategy has its device half under the same name
    _REGISTRY[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    import coordinator.strategies  # noqa: F401  (registers every strategy)

    try:
        return _REGISTRY[name]
    except KeyError:
        raise StrategyError(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def strategy_names() -> list[str]:
    import coordinator.strategies  # noqa: F401

    return sorted(_REGISTRY)
