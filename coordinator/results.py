"""What a run produced: per-round records, per-client results, and the results.json document.

`build_results` turns the runs of one configuration (the algorithm and its baselines, same
split) into the typed results document (`coordinator.results_model.Results`): per-client
comparison with the baselines, the personalization metrics, each run's budget, the device.
`write_results` writes it as results.json (atomically, fsynced) with the report.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from coordinator.metrics import personalization_metrics
from coordinator.results_model import (
    AccSpread,
    Baseline,
    BaselineClient,
    BaselineSummary,
    ClientEntry,
    DeviceRecord,
    Outcome,
    Results,
    RoundEntry,
    Summary,
    spread,
)
from edge_sdk.algorithms import Detail
from model_zoo.files import write_atomic

if TYPE_CHECKING:  # config imports the server, which builds these records
    from coordinator.run_config import RunConfig
    from edge_sdk.device import DeviceChoice

__all__ = [
    "RESULTS_NAME",
    "ClientResult",
    "RoundRecord",
    "RunResult",
    "build_results",
    "device_record",
    "training_budget",
    "write_results",
]

RESULTS_NAME: Final[str] = "results.json"

log = logging.getLogger(__name__)


@dataclass
class RoundRecord:
    """One round as the coordinator saw it. A run keeps one a round (in memory, in its
    checkpoint and in results.json); the per-client parts (`trained`, `replied`,
    `client_details`, `client_acc`, `offline`) only while the fleet is small enough
    (`round.client_history`): beyond that, the kept record is `compact()`, its counts and the
    accuracies' spread, and every client's line is in the coordinator's rounds.jsonl only."""

    round: int
    seconds: float
    mean_personal_acc: float | None
    global_acc: float | None
    trained: list[str]
    replied: list[str]
    failed: bool = False
    train_metrics: dict[str, float] = field(default_factory=dict)
    client_details: dict[str, dict[str, Detail]] = field(default_factory=dict)  # from fit replies
    # each client's personalized accuracy (evaluate phase; {} when the round did not evaluate)
    client_acc: dict[str, float | None] = field(default_factory=dict)
    # How many clients were asked to train and replied validly (len of the lists above, kept
    # when a compact record drops them); -1: counted from the lists.
    n_trained: int = -1
    n_replied: int = -1
    # The personalized accuracies' spread over the clients evaluated (`spread`); {}: none.
    acc_spread: dict[str, float] = field(default_factory=dict)
    # Registered clients online at the round's end: how many, and which were not (a fleet of
    # thousands writes a record a round: the few offline, not the thousands online).
    online: int = 0
    offline: list[str] = field(default_factory=list)
    # Clients whose contribution aggregation bounded (clipped, weight capped), with why
    flagged: dict[str, str] = field(default_factory=dict)
    # Undone after its evaluation left most clients much worse (coordinator.robust); the
    # clients that most likely poisoned it
    rolled_back: bool = False
    suspects: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n_trained < 0:
            self.n_trained = len(self.trained)
        if self.n_replied < 0:
            self.n_replied = len(self.replied)
        if not self.acc_spread and self.client_acc:
            self.acc_spread = spread(self.client_acc.values())

    def compact(self) -> RoundRecord:
        """This round without its per-client parts: counts, means, the accuracies' spread, and
        the clients flagged or suspected (a few, and what a security review looks for)."""
        return replace(self, trained=[], replied=[], client_details={}, client_acc={}, offline=[])


@dataclass
class ClientResult:
    id: str
    arch: str
    spec: dict[str, Any]
    n_train: int
    personal_acc: float | None
    global_acc: float | None
    error: str | None = None
    details: dict[str, Detail] = field(default_factory=dict)  # from the finalize reply
    # as the client registered: its data set's name, its torch device and precision
    dataset: str | None = None
    device: str | None = None
    precision: str | None = None


@dataclass
class RunResult:
    algorithm: str
    rounds: list[RoundRecord]
    clients: list[ClientResult]
    wall_seconds: float
    global_spec: dict[str, Any] | None
    bytes_out: int = 0  # payload bytes the coordinator sent and received over the whole run
    bytes_in: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # the strategy's own results fields
    # The registered clients, when `clients` holds only the sample finalized (a simulation's
    # `round.eval_clients`); None: it holds every one.
    population: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        """What `to_dict` gave (a checkpointed simulation's finished run)."""
        return cls(
            **{
                **data,
                "rounds": [RoundRecord(**r) for r in data["rounds"]],
                "clients": [ClientResult(**c) for c in data["clients"]],
            }
        )


def _metrics_missing(
    cfg: RunConfig,
    personal: list[float | None],
    global_: list[float | None],
    local: list[float | None],
) -> str:
    """What the personalization metrics lacked, and the baseline that gives it."""
    if any(v is None for v in local):
        return "no local accuracy for some client (add local to the baselines)"
    if any(v is None for v in global_):
        if "fedavg" in cfg.baselines:
            return "the fedavg baseline has no global accuracy for some client"
        return (
            f"no global accuracy for some client ({cfg.algorithm}'s own global model is "
            "what they compare with, if it has one: add fedavg to the baselines)"
        )
    missing = sum(v is None for v in personal)
    return f"{missing} client(s) reported no personalized accuracy"


def build_results(
    cfg: RunConfig, runs: dict[str, RunResult], *, device: DeviceRecord | None = None
) -> Results:
    """The results.json document: main run, per-client comparison with baselines, metrics.

    `device`: where the run trained and why (the simulator's choice); None: the devices the
    main run's clients registered with.
    """
    main = runs[cfg.algorithm]
    local = _accs(runs, "local", "personal_acc")
    # QoI compares against the global *FedAvg* model (PersFL's G_i) when that baseline ran.
    fedavg = _accs(runs, "fedavg", "global_acc")
    fedavg_ft = _accs(runs, "fedavg_ft", "personal_acc")  # the fine-tuned models it deploys
    clients = [
        _client_entry(c, local.get(c.id), fedavg.get(c.id), fedavg_ft.get(c.id))
        for c in main.clients
    ]
    personal = [c.personal_acc for c in main.clients]
    curve = [r.mean_personal_acc for r in main.rounds if r.mean_personal_acc is not None]
    globals_ = [r.global_acc for r in main.rounds if r.global_acc is not None]
    final_personal = _mean(personal)
    summary = Summary(
        mean_personal_acc=final_personal,
        # The same mean over clients as every round's global_acc, of the final models.
        global_acc=_mean([c.global_acc for c in main.clients]),
        # pFedMe-style reporting takes the best round; we report both final and best. The final
        # models count too: fedavg_ft's personalized models exist only after its fine-tuning.
        best_mean_personal_acc=max(
            [*curve, *([final_personal] if final_personal is not None else [])], default=None
        ),
        best_global_acc=max(globals_, default=None),
        failed_rounds=sum(r.failed for r in main.rounds),
        outcome=_outcome(main.rounds),
        wall_seconds=sum(r.wall_seconds for r in runs.values()),
        # what crossed the coordinator's connection (payload bytes, the whole run)
        coordinator_bytes_out=main.bytes_out,
        coordinator_bytes_in=main.bytes_in,
    )
    g = [c.fedavg_acc if fedavg else c.global_acc for c in clients]
    loc = [c.local_acc for c in clients]
    if clients and all(v is not None for v in personal + g + loc):
        summary.metrics = personalization_metrics(
            np.array(personal, dtype=float), np.array(g, dtype=float), np.array(loc, dtype=float)
        )
        summary.metrics_global_from = "fedavg" if fedavg else cfg.algorithm
    elif cfg.baselines:
        log.warning("metrics skipped: %s", _metrics_missing(cfg, personal, g, loc))
    extra = {k: v for k, v in main.extra.items() if k not in Results.model_fields or k in _EXTRA}
    return Results.model_validate(
        {
            **extra,  # what the algorithm's server half adds (FedeRiCo: the collaboration matrix)
            "config": cfg.model_dump(mode="json"),
            "algorithm": cfg.algorithm,
            # What local training each run got: epochs, or iterations of one batch (pfml).
            "budget": {name: training_budget(cfg, name) for name in runs},
            "rounds": [_round_entry(r) for r in main.rounds],
            "clients": clients,
            "population": main.population,
            "summary": summary,
            "device": device or _registered_devices(main.clients),
            "baselines": {
                name: _baseline(run) for name, run in runs.items() if name != cfg.algorithm
            },
        }
    )


# Results fields a strategy's `results()` may fill (FedeRiCo's collaboration matrices).
_EXTRA = frozenset({"collaboration_clients", "collaboration", "collaboration_history"})


def _accs(runs: Mapping[str, RunResult], name: str, field: str) -> dict[str, float | None]:
    run = runs.get(name)
    return {c.id: getattr(c, field) for c in run.clients} if run else {}


def _client_entry(
    c: ClientResult, local: float | None, fedavg: float | None, fedavg_ft: float | None
) -> ClientEntry:
    entry = ClientEntry(
        id=c.id,
        arch=c.arch,
        n_train=c.n_train,
        personal_acc=c.personal_acc,
        global_acc=c.global_acc,
        local_acc=local,
        fedavg_acc=fedavg,
        fedavg_ft_acc=fedavg_ft,
        dataset=c.dataset,
        device=c.device,
        precision=c.precision,
        error=c.error,
    )
    # What the algorithm reported about this client at the end (teacher round, λ, T, the
    # architecture it ended with, a guard's choice...); it never overrides the fields above.
    details = {}
    for key, value in c.details.items():
        if key in ClientEntry.model_fields:
            log.warning("%s: detail %r collides with a results field; dropped", c.id, key)
        else:
            details[key] = value
    return ClientEntry.model_validate(entry.model_dump() | details)


def _round_entry(r: RoundRecord) -> RoundEntry:
    return RoundEntry(
        round=r.round,
        seconds=round(r.seconds, 4),
        mean_personal_acc=r.mean_personal_acc,
        global_acc=r.global_acc,
        failed=r.failed,
        replied=r.n_replied,
        trained=r.n_trained,
        clients=dict(r.client_details),  # per client, what its fit reply reported
        client_acc=dict(r.client_acc),  # per client, its personalized accuracy (when evaluated)
        acc_spread=AccSpread.model_validate(r.acc_spread) if r.acc_spread else None,
        flagged=dict(r.flagged),
        rolled_back=r.rolled_back or None,
        suspects=list(r.suspects),
    )


def _baseline(run: RunResult) -> Baseline:
    return Baseline(
        summary=BaselineSummary(
            mean_personal_acc=_mean([c.personal_acc for c in run.clients]),
            global_acc=_mean([c.global_acc for c in run.clients]),
            best_global_acc=max(
                (r.global_acc for r in run.rounds if r.global_acc is not None), default=None
            ),
            wall_seconds=run.wall_seconds,
        ),
        clients=[
            BaselineClient(
                id=c.id, arch=c.arch, personal_acc=c.personal_acc, global_acc=c.global_acc
            )
            for c in run.clients
        ],
    )


def _registered_devices(clients: list[ClientResult]) -> DeviceRecord | None:
    """The devices the clients registered with (a deployment: each device chose its own)."""
    devices = Counter(c.device for c in clients if c.device is not None)
    if not devices:
        return None
    precisions = sorted({c.precision for c in clients if c.precision is not None})
    used = (
        next(iter(devices))
        if len(devices) == 1
        else ", ".join(f"{d} ×{n}" for d, n in sorted(devices.items()))
    )
    return DeviceRecord(
        used=used,
        reason="as each client reported when it registered",
        precision=", ".join(precisions) or None,
    )


def device_record(choice: DeviceChoice, ranks: Sequence[str] = ()) -> DeviceRecord:
    """The results' record of the device a simulation chose; over several ranks, what each
    rank trained on (`ranks`, by rank)."""
    used, reason = str(choice.device), choice.reason
    if len(ranks) >= 2:
        each = ", ".join(f"{d} ×{n}" for d, n in sorted(Counter(ranks).items()))
        used = f"{each} ({len(ranks)} ranks)"
        if "cuda" in each:
            reason += "; a rank per GPU of its machine (its place there mod its GPUs)"
    return DeviceRecord(
        requested=choice.requested, used=used, reason=reason, precision=choice.precision
    )


_BUDGET_FIELDS = ("local_epochs", "local_iterations", "batch_size", "lr", "ft_epochs")


def training_budget(cfg: RunConfig, algorithm: str) -> dict[str, Any]:
    """The local-training budget fields of one algorithm's config, in its own units (a field
    left unset, such as PFML's local_epochs when it runs fixed iterations, is not one)."""
    section = cfg.algorithm_config(algorithm).model_dump()
    return {k: section[k] for k in _BUDGET_FIELDS if section.get(k) is not None}


def write_results(results: Results, out: Path) -> Path:
    """results.json (atomically, fsynced) plus report.md, report.html and their plots."""
    from coordinator.report import write_report

    path = write_atomic(Path(out) / RESULTS_NAME, results.to_json())
    write_report(results, out)
    return path


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _outcome(rounds: list[RoundRecord]) -> Outcome:
    """Whether every round (complete), some (partial) or none (failed) got its quorum."""
    failed = sum(r.failed for r in rounds)
    if rounds and failed == len(rounds):
        return "failed"
    return "partial" if failed else "complete"
