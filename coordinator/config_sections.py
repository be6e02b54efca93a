"""The sections of a run's config (`[round]`, `[robust]`, `[data]`, `[client]`, `[deploy]`):
typed settings whose descriptions are their help (coordinator.run_config holds them all)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edge_sdk.budget import DeployBudget

__all__ = [
    "Aggregator",
    "ClientConfig",
    "DataConfig",
    "DeployConfig",
    "RobustConfig",
    "RoundConfig",
]


class RoundConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Defaults for a small fleet: a phase waits up to two minutes for a client that is online
    # but slow (one whose connection drops, `reconnect_grace_s`), and a round counts with half
    # of its replies, so one dead client never stalls or fails a round.
    deadline_s: float = Field(
        120.0, gt=0, description="seconds a round's phase waits for the clients' replies"
    )
    finalize_deadline_s: float | None = Field(
        None,
        gt=0,
        description="seconds the finalize phase (fine-tuning, distillation, ONNX export and its "
        "verification) waits, which may take longer than a round's phases; none: deadline_s",
    )
    quorum: float = Field(
        0.5, gt=0, le=1, description="the fraction of a round's tasks that must reply validly"
    )
    reconnect_grace_s: float = Field(
        10.0,
        ge=0,
        description="seconds a client whose connection dropped is still given tasks and waited "
        "for: a flaky network or a broker restart costs no reply, a dead client one such wait",
    )
    register_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds the coordinator waits for its clients to register (clients started "
        "by hand, or slow to import torch, take minutes)",
    )
    eval_every: int = Field(1, ge=1, description="evaluate every N rounds (and after the last)")
    eval_clients: int | None = Field(
        None,
        ge=1,
        description="evaluate this many clients, a sample drawn once from the seed with every "
        "architecture in proportion (the same each round and in each baseline); a simulation "
        "finalizes only them too, and its results are theirs, while a deployment finalizes "
        "every device; none: every client",
    )
    min_clients: int | None = Field(
        None,
        ge=1,
        description="start with this many registered clients if the others do not come within "
        "register_timeout_s; none: all",
    )
    retries: int = Field(
        1,
        ge=0,
        description="how often a round that misses its quorum runs again (new sampling, from "
        "where the clients were before it) before it is recorded as failed, state unchanged",
    )
    client_history: int = Field(
        100_000,
        ge=0,
        description="the most client-rounds (registered clients x rounds) whose per-client parts "
        "the run keeps in memory, its checkpoint and results.json; a larger fleet keeps counts, "
        "means and spreads per round (rounds.jsonl always has every client's line)",
    )


Aggregator = Literal["mean", "median", "trimmed_mean", "krum"]


class RobustConfig(BaseModel):
    """`[robust]` of a run config: how the coordinator bounds what one client can do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    aggregator: Aggregator = Field(
        "mean",
        description="how the (clipped) updates combine: mean (weighted), median, trimmed_mean "
        "or krum",
    )
    trim: float = Field(
        0.2, ge=0, lt=0.5, description="trimmed_mean's share cut at each end (its beta)"
    )
    krum_f: int = Field(
        1, ge=0, description="krum's f: the attackers it tolerates (it needs 2f + 3 replies)"
    )
    # These defaults met the attack benchmark's goals at a measured cost to honest runs
    # (docs/security.md).
    clip: float = Field(
        3.0, ge=0, description="bound an update's norm at clip x the cohort's median (0: no bound)"
    )
    center_clip: float = Field(
        2.0,
        ge=0,
        description="pull a contribution farther than center_clip x the median distance from the "
        "coordinate-wise median of its aggregate's contributions in to that distance (0: never)",
    )
    weight_cap: float = Field(
        1.5,
        ge=0,
        description="cap a sample weight (weighting by_samples) at weight_cap x the round's "
        "median (0: no cap)",
    )
    max_samples: int | None = Field(
        None, ge=1, description="cap a sample weight at this many samples; none: no maximum"
    )
    max_abs: float = Field(
        1e6,
        gt=0,
        description="reject a fit reply with a weight (or buffer) larger than this in absolute "
        "value",
    )
    rollback: bool = Field(
        True,
        description="roll back a round whose evaluation shows more than rollback_share of the "
        "clients rollback_drop or more below the last evaluation",
    )
    rollback_drop: float = Field(
        0.1, gt=0, le=1, description="the accuracy drop (a fraction) that counts for rollback"
    )
    rollback_share: float = Field(
        0.5, ge=0, lt=1, description="the share of clients that must drop for a rollback"
    )


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(
        "digits", description="the dataset: digits, fashion_mnist, synthetic, ... (`edgefl zoo`)"
    )
    root: str | None = Field(
        None,
        description="directory of the dataset files (never downloaded); none: the dataset's own",
    )
    max_samples: int | None = Field(
        None, ge=1, description="a seeded subset of the pooled data, this many samples; none: all"
    )
    options: dict[str, Any] = Field(
        {}, description='the loader\'s keyword arguments, e.g. {"size": 8} for digits'
    )
    partition: str = Field(
        "dirichlet",
        description="how the data is split among the clients: iid, shards, dirichlet, "
        "ds1..ds4, ... (`edgefl zoo`)",
    )
    partition_params: dict[str, Any] = Field(
        {}, description='the partition\'s parameters, e.g. {"alpha": 0.5}'
    )
    split: tuple[float, float, float] = Field(
        (0.6, 0.2, 0.2), description="each client's train/val/test fractions [PersFL]"
    )
    seed: int | None = Field(
        None,
        description="the data side's seed (the subset, the split, a held-out set): fixed while "
        "seed varies, the clients keep their data and only training's randomness changes; "
        "none: the run's seed",
    )


class ClientConfig(BaseModel):
    """`edgefl client`: which client of the split this process is (its data, id, model)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="this client's id; none: the split's, c<INDEX>")
    # No default: two clients started without it would both be client 0.
    index: int | None = Field(
        None,
        ge=0,
        description="which client of the split this process is, which decides its data "
        "(required by `edgefl client`)",
    )
    model: str | None = Field(
        None, description="this client's architecture family; none: models[INDEX]"
    )
    state_dir: str = Field(
        "edgefl-state",
        description="its state, its run config and, after the run, its ONNX model",
    )
    late: bool = Field(
        False,
        description="join a finished run: personalize from its archive (PersFL), without "
        "training in it",
    )


class DeployConfig(DeployBudget):
    """What the clients may deploy, by what their devices can run (edge_sdk.budget): `allow`
    and `max_params` for every client, and `clients` for those with budgets of their own, by
    id. Default: every client deploys a model of its own architecture only."""

    clients: dict[str, DeployBudget] = Field(
        default_factory=dict,
        description='budgets of their own, by client id (e.g. {"c3": {"allow": ["any"]}})',
    )

    def for_client(self, client_id: str) -> DeployBudget:
        """`client_id`'s budget: its own where `clients` names it, else the common one."""
        own = self.clients.get(client_id)
        if own is not None:
            return own
        return DeployBudget(allow=self.allow, max_params=self.max_params)
