"""The Markdown sections of report.md after the first ones (`comparison`), each a pure
function of (parts of) the typed results: how the run was carried out, the data, the ONNX
models, then the details (summary, metrics, baselines, rounds, per-client algorithm reports,
configuration).

Wording as in `comparison`: means are over clients, "global-model accuracy" names a global
model's accuracy, "final" the models after the last round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from coordinator.metrics import METRIC_DESCRIPTIONS, METRIC_KEYS
from coordinator.report.common import MISSING, metric_value, pct, plain, table
from coordinator.report.comparison import dataset_name, partition_name
from coordinator.results_model import (
    Baseline,
    ClientEntry,
    OnnxRow,
    Results,
    RoundEntry,
    Split,
    Summary,
)

__all__ = [
    "architecture_section",
    "baselines_section",
    "collaboration_section",
    "config_section",
    "details_section",
    "metrics_section",
    "onnx_section",
    "rounds_section",
    "setup_section",
    "split_section",
    "summary_section",
]

_FAIRNESS_SUBSETS: Final[dict[str, str]] = {
    "fairness_improved": "U+ (QoI of improved clients)",
    "fairness_worsened": "|U−| (absolute QoI of worsened clients)",
}
# A detail longer than this is shown in full below the details table, not in a cell.
_LONG_DETAIL: Final[int] = 40


# --- the run ---------------------------------------------------------------------------------


def setup_section(setup: Mapping[str, str] | None) -> list[str]:
    """How the run was carried out (the demo's broker, processes, data): label -> text."""
    if not setup:
        return []
    rows = [[k, v] for k, v in setup.items()]
    return ["## How this ran", "", *table(["What", "How"], rows), ""]


def split_section(split: Split | None, arch: Mapping[str, str], sampled: bool = False) -> list[str]:
    """Each client's share of the data: sizes and the classes it sees; `sampled`: only of the
    clients with results (`arch`), a sample of the population (split.txt has every one)."""
    if split is None or not split.clients:
        return []
    classes = split.classes
    rows = []
    for r in split.clients:
        if sampled and r.id not in arch:
            continue
        seen = [
            f"{classes[k] if k < len(classes) else k} ({n})" for k, n in enumerate(r.counts) if n
        ]
        rows.append(
            [
                r.id,
                arch.get(r.id, MISSING),
                f"{r.n_train} / {r.n_val} / {r.n_test}",
                str(len(seen)),
                ", ".join(seen),
            ]
        )
    lines = ["## Data per client", ""]
    if split.description:
        lines += [split.description, ""]
    if sampled:
        lines += [f"The {len(rows):,} clients evaluated; split.txt has all {len(split.clients):,}."]
        lines += [""]
    lines += [
        *table(["Client", "Arch", "train / val / test", "Classes", "Training samples"], rows),
        "",
    ]
    return lines


def onnx_section(rows_in: Sequence[OnnxRow] | None, note: str | None) -> list[str]:
    """Each client's exported personalized model, measured with onnxruntime."""
    if not rows_in:
        return []
    rows = []
    for r in rows_in:
        rows.append(
            [
                r.client,
                plain(r.arch),
                MISSING if r.size_bytes is None else f"{r.size_bytes / 1024:.1f} KiB",
                MISSING if r.latency_p50_ms is None else f"{r.latency_p50_ms:.3f} ms",
                MISSING if r.latency_p99_ms is None else f"{r.latency_p99_ms:.3f} ms",
                MISSING if r.throughput is None else f"{r.throughput:,.0f}/s",
                pct(r.accuracy),
                pct(r.personal_acc),
            ]
        )
    header = [
        "Client",
        "Arch",
        "File size",
        "Latency p50 (batch 1)",
        "p99",
        "Throughput (batch 64)",
        "ONNX accuracy",
        "Personalized (federation)",
    ]
    lines = ["## On-device models (ONNX)", ""]
    if note:
        lines += [note, ""]
    return [*lines, *table(header, rows), ""]


def collaboration_section(image: str, final: Sequence[Sequence[float]]) -> list[str]:
    n = len(final)
    zero = sum(final[i][i] < 0.005 for i in range(n))  # shown as 0.00
    return [
        "## Collaboration",
        "",
        "Row i shows the weight w_ij client i gives client j's model (FedeRiCo's E-step): a "
        "client relies on the peers whose models explain its own data.",
        "",
        "The diagonal, w_ii, is a client's weight on its own model. It falls to 0 as soon as a "
        "peer's model explains the client's training data better than its own: the weights "
        "come from summed losses, which makes them nearly one-hot, so the clients of one group "
        "tend to weigh one model, and only its owner keeps weight on its own. "
        f"Here the final diagonal is 0 for {zero} of {n} clients.",
        "",
        f"![Collaboration weights]({image})",
        "",
    ]


# --- details ---------------------------------------------------------------------------------


def config_section(results: Results) -> list[str]:
    config = results.config
    archs = list(dict.fromkeys(c.arch for c in results.clients if c.arch))  # as registered
    rows = [
        ["Dataset", plain(dataset_name(results))],
        ["Partition", plain(partition_name(results))],
        ["Models", ", ".join(archs) if archs else plain(config.get("models"))],
        ["Clients", plain(results.population or len(results.clients) or config.get("clients"))],
        ["Rounds", plain(config.get("rounds", len(results.rounds) or None))],
        ["Seed", plain(config.get("seed"))],
    ]
    # The run's own algorithm section (every hyperparameter it ran with).
    section = config.get(results.algorithm)
    if isinstance(section, Mapping):
        rows.append(
            [f"{results.algorithm} settings", ", ".join(f"{k}={v}" for k, v in section.items())]
        )
    return ["## Configuration", "", *table(["Setting", "Value"], rows), ""]


def rounds_section(rounds: Sequence[RoundEntry]) -> list[str]:
    lines = ["## Rounds", ""]
    if not rounds:
        return [*lines, "No rounds were recorded.", ""]
    spread = any(r.acc_spread is not None for r in rounds)
    rows = [
        [
            str(r.round),
            f"{r.seconds:.2f}",
            pct(r.mean_personal_acc),
            *([_spread_cell(r)] if spread else []),
            pct(r.global_acc),
        ]
        for r in rounds
    ]
    header = ["Round", "Seconds", "Mean personalized acc"]
    header += ["Personalized acc, 10th–90th percentile"] if spread else []
    header += ["Mean global-model acc"]
    lines += table(header, rows)
    if any(r.acc_spread is not None and not r.client_acc for r in rounds):
        lines += [
            "",
            "The rounds keep the spread of the clients' accuracies, not each client's: the "
            "fleet's clients × rounds exceed `round.client_history`. The coordinator's "
            "rounds.jsonl has every client's line.",
        ]
    return [*lines, ""]


def _spread_cell(r: RoundEntry) -> str:
    s = r.acc_spread
    return MISSING if s is None else f"{pct(s.p10)}–{pct(s.p90)} ({s.n} clients)"


def details_section(clients: Sequence[ClientEntry]) -> list[str]:
    """What the algorithm reported per client at the end (PersFL's teacher round, λ, T; FedMe's
    architectures; a guard's choice and its reason): short values as a table, long texts in
    full below it."""
    keys: list[str] = []
    for c in clients:
        keys += [k for k in c.details if k not in keys]
    if not keys:
        return []
    long = [
        k
        for k in keys
        if any(isinstance(v := c.details.get(k), str) and len(v) > _LONG_DETAIL for c in clients)
    ]
    short = [k for k in keys if k not in long]
    lines = [
        "## Client details",
        "",
        "What the algorithm reported about each client at the end.",
        "",
    ]
    if short:
        rows = [[c.id, *(plain(c.details.get(k)) for k in short)] for c in clients]
        lines += [*table(["Client", *short], rows), ""]
    for k in long:
        lines += [f"**{k}**", ""]
        lines += [f"- {c.id}: {plain(c.details.get(k))}" for c in clients]
        lines += [""]
    return lines


def architecture_section(rounds: Sequence[RoundEntry], clients: Sequence[ClientEntry]) -> list[str]:
    """How the clients' architectures changed over rounds (from each fit reply's `arch`)."""
    current = {c.id: str(c.details.get("arch_start", c.arch)) for c in clients}
    rows = []
    seen_arch = False
    for index, r in enumerate(rounds):
        switches = []
        for cid, details in r.clients.items():
            arch = details.get("arch")
            seen_arch |= arch is not None
            if arch is not None and current.get(cid) != str(arch):
                switches.append(f"{cid}: {current.get(cid, MISSING)} → {arch}")
                current[cid] = str(arch)
        if switches or index == 0:
            counts: dict[str, int] = {}
            for a in current.values():
                counts[a] = counts.get(a, 0) + 1
            mix = ", ".join(f"{a} ×{n}" for a, n in sorted(counts.items()))
            rows.append([str(r.round), mix, "; ".join(switches) or "—"])
    if not seen_arch:
        return []
    return [
        "## Architectures over rounds",
        "",
        "Rounds in which some client changed architecture (and the first round); the mix is "
        "after the round.",
        "",
        *table(["Round", "Architectures", "Changes"], rows),
        "",
    ]


def summary_section(summary: Summary, algorithm: str) -> list[str]:
    """The headline numbers, each named for what it is, with its results.json key."""
    s = summary
    rows = [
        ["Mean personalized accuracy, final", "mean_personal_acc", pct(s.mean_personal_acc)],
        [
            "Mean personalized accuracy, best round or final",
            "best_mean_personal_acc",
            pct(s.best_mean_personal_acc),
        ],
        [f"Mean {algorithm} global-model accuracy, final", "global_acc", pct(s.global_acc)],
        [
            f"Mean {algorithm} global-model accuracy, best round",
            "best_global_acc",
            pct(s.best_global_acc),
        ],
        ["Rounds that failed quorum", "failed_rounds", str(s.failed_rounds)],
        [
            "Wall time: the run and its baselines (the demo: every step before this report)",
            "wall_seconds",
            MISSING if s.wall_seconds is None else f"{s.wall_seconds:.2f} s",
        ],
        [
            "Payload bytes the coordinator sent",
            "coordinator_bytes_out",
            f"{s.coordinator_bytes_out:,}",
        ],
        [
            "Payload bytes the coordinator received",
            "coordinator_bytes_in",
            f"{s.coordinator_bytes_in:,}",
        ],
    ]
    if s.metrics_global_from:
        rows.append(
            ["Global model of the metrics' QoI", "metrics_global_from", s.metrics_global_from]
        )
    return [
        "## Summary",
        "",
        "Means over clients (each weighs the same) of each client's accuracy on its own test "
        "split; final: after the last round.",
        "",
        *table(["Quantity", "results.json key", "Value"], rows),
        "",
    ]


def metrics_section(summary: Summary) -> list[str]:
    """The PersFL metrics (when the local baseline ran), fairness split by the sign of QoI."""
    metrics = summary.metrics
    if not metrics:
        return []
    lines = [
        "## Personalization metrics",
        "",
        "PersFL thesis, section 5.2.3. PUI/PUD in percent of clients; MPI/API/MPD/APD in "
        "percentage points of QoI; AV/CS/Entropy/JI over the personalized accuracies (percent).",
        "",
    ]
    keys = [k for k in METRIC_KEYS if k in metrics]
    keys += [k for k in metrics if k not in METRIC_KEYS and k not in _FAIRNESS_SUBSETS]
    rows = [[k, metric_value(k, metrics[k]), METRIC_DESCRIPTIONS.get(k, "")] for k in keys]
    lines += [*table(["Metric", "Value", "Meaning"], rows), ""]
    subsets = {k: v for k, v in _FAIRNESS_SUBSETS.items() if k in metrics}
    if subsets:
        columns = [metrics[k] for k in subsets]
        rows = [
            [
                k,
                *(
                    metric_value(k, col.get(k) if isinstance(col, dict) else None)
                    for col in columns
                ),
            ]
            for k in ("AV", "CS", "Entropy", "JI")
        ]
        lines += [
            "### Fairness over QoI",
            "",
            "QoI can be negative, so the thesis applies fairness separately to the improved "
            "clients and to the absolute QoI of the worsened ones.",
            "",
            *table(["Metric", *subsets.values()], rows),
            "",
        ]
    return lines


def baselines_section(baselines: Mapping[str, Baseline]) -> list[str]:
    if not baselines:
        return []
    summary_rows = []
    per_client: dict[str, dict[str, str]] = {}
    for name, b in baselines.items():
        s = b.summary
        summary_rows.append(
            [
                name,
                pct(s.mean_personal_acc),
                pct(s.global_acc),
                MISSING if s.wall_seconds is None else f"{s.wall_seconds:.2f} s",
            ]
        )
        for c in b.clients:
            per_client.setdefault(c.id, {})[name] = pct(c.personal_acc)
    header = ["Baseline", "Mean personalized acc", "Mean global-model acc (final)", "Wall time"]
    lines = [
        "## Baselines",
        "",
        "Each on the same split and budget. A baseline's personalized model is the one each "
        "client ends with (FedAvg's: the global model; FedAvg+FT's: its fine-tuned copy).",
        "",
        *table(header, summary_rows),
        "",
    ]
    if per_client:
        names = list(baselines)
        rows = [[cid, *(accs.get(n, MISSING) for n in names)] for cid, accs in per_client.items()]
        lines += [
            "Per-client accuracy of each baseline:",
            "",
            *table(["Client", *names], rows),
            "",
        ]
    return lines
