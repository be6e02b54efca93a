"""What a run produced: per-round records, per-client results, and the results.json document.

`build_results` turns the runs of one configuration (the algorithm and its baselines, same
split) into the results.json structure: per-client comparison with the baselines, the
personalization metrics, each run's budget. `write_results` writes it with the report.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.metrics import personalization_metrics
from edge_sdk.algorithms import Detail

if TYPE_CHECKING:  # config imports the server, which builds these records
    from coordinator.config import RunConfig

__all__ = [
    "ClientResult",
    "RoundRecord",
    "RunResult",
    "build_results",
    "training_budget",
    "write_results",
]

log = logging.getLogger(__name__)


@dataclass
class RoundRecord:
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
    online: list[str] = field(default_factory=list)  # registered clients online at the round's end


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_RESULT_KEYS = frozenset(
    {"config", "algorithm", "budget", "rounds", "clients", "summary", "baselines"}
)


def build_results(cfg: RunConfig, runs: dict[str, RunResult]) -> dict[str, Any]:
    """The results.json structure: main run, per-client comparison with baselines, metrics."""
    main = runs[cfg.algorithm]
    local = {c.id: c.personal_acc for c in runs["local"].clients} if "local" in runs else {}
    # QoI compares against the global *FedAvg* model (PersFL's G_i) when that baseline ran.
    fedavg = {c.id: c.global_acc for c in runs["fedavg"].clients} if "fedavg" in runs else {}
    clients: list[dict[str, Any]] = []
    for c in main.clients:
        glob = c.global_acc if c.global_acc is not None else fedavg.get(c.id)
        entry: dict[str, Any] = {
            "id": c.id,
            "arch": c.arch,
            "n_train": c.n_train,
            "personal_acc": c.personal_acc,
            "global_acc": glob,
            "local_acc": local.get(c.id),
            "fedavg_acc": fedavg.get(c.id),
            **({"error": c.error} if c.error else {}),
        }
        # What the algorithm reported about this client at the end (teacher round, λ, T, the
        # architecture it ended with...); it never overrides the fields above.
        for key, value in c.details.items():
            if key in entry:
                log.warning("%s: detail %r collides with a results field; dropped", c.id, key)
            else:
                entry[key] = value
        clients.append(entry)
    personal = [c.personal_acc for c in main.clients]
    curve = [r.mean_personal_acc for r in main.rounds if r.mean_personal_acc is not None]
    globals_ = [r.global_acc for r in main.rounds if r.global_acc is not None]
    final_personal = _mean(personal)
    summary: dict[str, Any] = {
        "mean_personal_acc": final_personal,
        "global_acc": main.rounds[-1].global_acc if main.rounds else None,
        # pFedMe-style reporting takes the best round; we report both final and best. The final
        # models count too: fedavg_ft's personalized models exist only after its fine-tuning.
        "best_mean_personal_acc": max(
            [*curve, *([final_personal] if final_personal is not None else [])], default=None
        ),
        "best_global_acc": max(globals_, default=None),
        "failed_rounds": sum(r.failed for r in main.rounds),
        "wall_seconds": sum(r.wall_seconds for r in runs.values()),
        # what crossed the coordinator's connection (payload bytes, the whole run)
        "coordinator_bytes_out": main.bytes_out,
        "coordinator_bytes_in": main.bytes_in,
    }
    source = "fedavg" if fedavg else cfg.algorithm
    g: list[float | None] = [c["fedavg_acc"] if fedavg else c["global_acc"] for c in clients]
    loc: list[float | None] = [c["local_acc"] for c in clients]
    if clients and all(v is not None for v in personal + g + loc):
        summary["metrics"] = personalization_metrics(
            np.array(personal, dtype=float), np.array(g, dtype=float), np.array(loc, dtype=float)
        )
        summary["metrics_global_from"] = source
    elif cfg.baselines:
        log.warning("metrics skipped: some client lacks a personal, global or local accuracy")
    return {
        "config": cfg.model_dump(mode="json"),
        "algorithm": cfg.algorithm,
        # What local training each run got: epochs, or iterations of one batch (pfml).
        "budget": {name: training_budget(cfg, name) for name in runs},
        "rounds": [
            {
                "round": r.round,
                "seconds": round(r.seconds, 4),
                "mean_personal_acc": r.mean_personal_acc,
                "global_acc": r.global_acc,
                "failed": r.failed,
                "replied": len(r.replied),
                "trained": len(r.trained),
                # per client, what its fit reply reported (e.g. the architecture it chose)
                **({"clients": r.client_details} if r.client_details else {}),
                # per client, its personalized accuracy after the round (when evaluated)
                **({"client_acc": r.client_acc} if r.client_acc else {}),
            }
            for r in main.rounds
        ],
        "clients": clients,
        "summary": summary,
        # what the algorithm's server half adds (FedeRiCo: the collaboration matrix)
        **{k: v for k, v in main.extra.items() if k not in _RESULT_KEYS},
        "baselines": {
            name: {
                "summary": {
                    "mean_personal_acc": _mean([c.personal_acc for c in run.clients]),
                    "global_acc": run.rounds[-1].global_acc if run.rounds else None,
                    "best_global_acc": max(
                        (r.global_acc for r in run.rounds if r.global_acc is not None),
                        default=None,
                    ),
                    "wall_seconds": run.wall_seconds,
                },
                "clients": [
                    {
                        "id": c.id,
                        "arch": c.arch,
                        "personal_acc": c.personal_acc,
                        "global_acc": c.global_acc,
                    }
                    for c in run.clients
                ],
            }
            for name, run in runs.items()
            if name != cfg.algorithm
        },
    }


_BUDGET_FIELDS = ("local_epochs", "local_iterations", "batch_size", "lr", "ft_epochs")


def training_budget(cfg: RunConfig, algorithm: str) -> dict[str, Any]:
    """The local-training budget fields of one algorithm's config, in its own units."""
    section = cfg.algorithm_config(algorithm).model_dump()
    return {k: section[k] for k in _BUDGET_FIELDS if k in section}


def write_results(results: dict[str, Any], out: Path) -> Path:
    """results.json (atomically) plus report.md and its plots."""
    from coordinator.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".results-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=2, default=_json_default)
    os.replace(tmp, path)
    write_report(results, out)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None
