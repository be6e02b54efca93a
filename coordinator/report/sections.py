"""The Markdown sections of report.md, each a pure function of (parts of) the results dict.

The first sections answer what a reader wants to know first: what ran, and whether personalizing
paid off for each client — said plainly, including for the clients where it did not. Details
(configuration, rounds, baselines, per-client algorithm reports) follow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from coordinator.metrics import METRIC_DESCRIPTIONS, METRIC_KEYS
from coordinator.report.common import (
    MISSING,
    find_config_value,
    is_number,
    mapping,
    metric_value,
    number,
    pct,
    plain,
    pp,
    records,
    table,
)

__all__ = [
    "architecture_section",
    "baselines_section",
    "clients_section",
    "collaboration_section",
    "config_section",
    "details_section",
    "metrics_section",
    "onnx_section",
    "overview_section",
    "rounds_section",
    "setup_section",
    "split_section",
    "summary_section",
]

# Config summary rows: label -> keys tried, in order, anywhere in the (possibly nested) config.
_CONFIG_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "Dataset": ("dataset", "dataset_name"),
    "Partition": ("partition", "partitioner", "split"),
    "Models": ("models", "archs", "architectures", "arch", "model"),
    "Clients": ("num_clients", "n_clients", "clients"),
    "Rounds": ("rounds", "num_rounds", "n_rounds"),
    "Seed": ("seed",),
}
_CONFIG_SEARCH_DEPTH: Final[int] = 3
_FAIRNESS_SUBSETS: Final[dict[str, str]] = {
    "fairness_improved": "U+ (QoI of improved clients)",
    "fairness_worsened": "|U−| (absolute QoI of worsened clients)",
}
# Fields every client entry has; anything else an algorithm reported (details).
_CLIENT_FIELDS: Final[frozenset[str]] = frozenset(
    {"id", "arch", "n_train", "personal_acc", "global_acc", "local_acc", "fedavg_acc", "error"}
)


# --- the per-client comparison ---------------------------------------------------------------


def _accs(record: Mapping[str, Any], where: str) -> dict[str, float | None]:
    return {
        k: number(record, k, where)
        for k in ("personal_acc", "local_acc", "global_acc", "fedavg_acc")
    }


def _reference(a: Mapping[str, float | None]) -> float | None:
    """PersFL's G_i: the FedAvg global model when that baseline ran, else this run's global."""
    return a["fedavg_acc"] if a["fedavg_acc"] is not None else a["global_acc"]


def _against(personal: float, other: float, name: str) -> str:
    diff = personal - other
    if diff > 0:
        return f"better than {name} ({pp(diff)})"
    if diff < 0:
        return f"**worse than {name}** ({pp(diff)})"
    return f"same as {name}"


def verdict(a: Mapping[str, float | None]) -> str:
    """Personalized against local-only training and against the FedAvg model, in words."""
    p = a["personal_acc"]
    if p is None:
        return "no personalized accuracy"
    parts = []
    if a["local_acc"] is not None:
        parts.append(_against(p, a["local_acc"], "local"))
    if a["fedavg_acc"] is not None:
        parts.append(_against(p, a["fedavg_acc"], "FedAvg"))
    return "; ".join(parts) or MISSING


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _dataset_words(config: Mapping[str, Any]) -> str:
    data = mapping(config.get("data"), "results['config']['data']")
    name = plain(data.get("dataset")) if data.get("dataset") else None
    part = plain(data.get("partition")) if data.get("partition") else None
    if name and part:
        return f" on {name} ({part} split)"
    return f" on {name}" if name else ""


def overview_section(results: Mapping[str, Any], clients: Sequence[Mapping[str, Any]]) -> list[str]:
    """What ran, the mean accuracies side by side, and who gained or lost by personalizing."""
    config = mapping(results.get("config"), "results['config']")
    algorithm = plain(results.get("algorithm") or "unknown algorithm")
    rounds = records(results, "rounds")
    lines = ["## At a glance", ""]
    what = f"**{algorithm}** trained {len(clients)} clients for {len(rounds)} rounds"
    lines += [what + _dataset_words(config) + ".", ""]
    accs = [_accs(c, f"results['clients'][{i}]") for i, c in enumerate(clients)]
    means = [
        ("personalized models (this run)", _mean([a["personal_acc"] for a in accs])),
        ("local-only training", _mean([a["local_acc"] for a in accs])),
        ("FedAvg global model", _mean([a["fedavg_acc"] for a in accs])),
        (f"{algorithm} global model", _mean([a["global_acc"] for a in accs])),
    ]
    rows = [[name, pct(value)] for name, value in means if value is not None]
    if rows:
        lines += [
            "Mean over clients of each client's accuracy on its own test split:",
            "",
            *table(["Model", "Mean accuracy"], rows),
            "",
        ]
    against_local = [
        (plain(c.get("id", i)), a["personal_acc"] - a["local_acc"])
        for i, (c, a) in enumerate(zip(clients, accs, strict=True))
        if a["personal_acc"] is not None and a["local_acc"] is not None
    ]
    if against_local:
        won = [cid for cid, d in against_local if d > 0]
        lost = [(cid, d) for cid, d in against_local if d < 0]
        tied = len(against_local) - len(won) - len(lost)
        sentence = (
            f"Personalization beat training alone on **{len(won)} of {len(against_local)}** clients"
        )
        if lost:
            worst = ", ".join(f"{cid} {pp(d)}" for cid, d in sorted(lost, key=lambda x: x[1]))
            sentence += f" and **lost on {len(lost)}** ({worst})"
        if tied:
            sentence += f"; {tied} tied"
        lines += [sentence + ".", ""]
    return lines


def clients_section(clients: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Clients", ""]
    if not clients:
        return [*lines, "No clients were recorded.", ""]
    rows = []
    for index, record in enumerate(clients):
        a = _accs(record, f"results['clients'][{index}]")
        ref = _reference(a)
        qoi = (
            MISSING
            if a["personal_acc"] is None or a["local_acc"] is None or ref is None
            else pp(a["personal_acc"] - max(a["local_acc"], ref))
        )
        rows.append(
            [
                plain(record.get("id", index)),
                plain(record.get("arch")),
                plain(record.get("n_train")),
                pct(a["personal_acc"]),
                pct(a["local_acc"]),
                pct(a["global_acc"]),
                pct(a["fedavg_acc"]),
                qoi,
                verdict(a),
            ]
        )
    header = [
        "Client",
        "Arch",
        "n_train",
        "Personalized",
        "Local",
        "Global",
        "FedAvg",
        "QoI",
        "Verdict",
    ]
    note = (
        "Accuracy of each model on the client's own test split. Local: the same architecture "
        "trained on the client's data alone, same budget. Global: this run's global model. "
        "FedAvg: the FedAvg baseline's global model. QoI = personalized − max(local, FedAvg) in "
        "percentage points (pp); this run's global model stands in when no fedavg baseline ran."
    )
    return [*lines, *table(header, rows), "", note, ""]


# --- the run ---------------------------------------------------------------------------------


def setup_section(setup: Mapping[str, Any]) -> list[str]:
    """How the run was carried out (the demo's broker, processes, data): label -> text."""
    if not setup:
        return []
    rows = [[str(k), plain(v)] for k, v in setup.items()]
    return ["## How this ran", "", *table(["What", "How"], rows), ""]


def split_section(split: Mapping[str, Any], arch: Mapping[str, str]) -> list[str]:
    """Each client's share of the data: sizes and the classes it sees."""
    if not split:
        return []
    classes = [str(c) for c in split.get("classes") or []]
    rows = []
    for i, r in enumerate(records(split, "clients")):
        where = f"results['split']['clients'][{i}]"
        counts = r.get("counts") or []
        seen = [f"{classes[k] if k < len(classes) else k} ({n})" for k, n in enumerate(counts) if n]
        cid = plain(r.get("id", i))
        rows.append(
            [
                cid,
                arch.get(cid, MISSING),
                " / ".join(plain(number(r, k, where)) for k in ("n_train", "n_val", "n_test")),
                str(len(seen)),
                ", ".join(seen),
            ]
        )
    intro = plain(split.get("description")) if split.get("description") else ""
    lines = ["## Data per client", ""]
    if intro:
        lines += [intro, ""]
    lines += [
        *table(["Client", "Arch", "train / val / test", "Classes", "Training samples"], rows),
        "",
    ]
    return lines


def onnx_section(rows_in: Sequence[Mapping[str, Any]], note: str | None) -> list[str]:
    """Each client's exported personalized model, measured with onnxruntime."""
    if not rows_in:
        return []
    rows = []
    for i, r in enumerate(rows_in):
        where = f"results['onnx'][{i}]"
        size = number(r, "size_bytes", where)
        p50, p99 = number(r, "latency_p50_ms", where), number(r, "latency_p99_ms", where)
        tput = number(r, "throughput", where)
        rows.append(
            [
                plain(r.get("client")),
                plain(r.get("arch")),
                MISSING if size is None else f"{size / 1024:.1f} KiB",
                MISSING if p50 is None else f"{p50:.3f} ms",
                MISSING if p99 is None else f"{p99:.3f} ms",
                MISSING if tput is None else f"{tput:,.0f}/s",
                pct(number(r, "accuracy", where)),
                pct(number(r, "personal_acc", where)),
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


def collaboration_section(image: str) -> list[str]:
    return [
        "## Collaboration",
        "",
        "Row i shows the weight w_ij client i gives client j's model (FedeRiCo's E-step): a "
        "client relies on the peers whose models explain its own data.",
        "",
        f"![Collaboration weights]({image})",
        "",
    ]


# --- details ---------------------------------------------------------------------------------


def config_section(
    config: Mapping[str, Any],
    rounds: Sequence[Mapping[str, Any]],
    clients: Sequence[Mapping[str, Any]],
) -> list[str]:
    fallback: dict[str, Any] = {
        "Models": sorted({str(c["arch"]) for c in clients if c.get("arch") is not None}) or None,
        "Clients": len(clients) or None,
        "Rounds": len(rounds) or None,
    }
    rows = []
    for label, keys in _CONFIG_FIELDS.items():
        value = find_config_value(config, keys, _CONFIG_SEARCH_DEPTH)
        if value is None:
            value = fallback.get(label)
        rows.append([label, plain(value)])
    # The run's own algorithm section (every hyperparameter it ran with).
    section = config.get(str(config.get("algorithm")))
    if isinstance(section, Mapping):
        rows.append(
            [f"{config['algorithm']} settings", ", ".join(f"{k}={v}" for k, v in section.items())]
        )
    return ["## Configuration", "", *table(["Setting", "Value"], rows), ""]


def rounds_section(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Rounds", ""]
    if not rounds:
        return [*lines, "No rounds were recorded.", ""]
    rows = []
    for index, record in enumerate(rounds):
        where = f"results['rounds'][{index}]"
        seconds = number(record, "seconds", where)
        n = number(record, "round", where)
        rows.append(
            [
                plain(index + 1 if n is None else n),
                MISSING if seconds is None else f"{seconds:.2f}",
                pct(number(record, "mean_personal_acc", where)),
                pct(number(record, "global_acc", where)),
            ]
        )
    header = ["Round", "Seconds", "Mean personalized acc", "Global acc"]
    return [*lines, *table(header, rows), ""]


def details_section(clients: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the algorithm reported per client (PersFL's teacher round, λ, T; FedMe's archs)."""
    keys: list[str] = []
    for record in clients:
        keys += [k for k in record if k not in _CLIENT_FIELDS and k not in keys]
    if not keys:
        return []
    rows = [
        [plain(record.get("id", i)), *(plain(record.get(k)) for k in keys)]
        for i, record in enumerate(clients)
    ]
    return ["## Client details", "", *table(["Client", *keys], rows), ""]


def architecture_section(
    rounds: Sequence[Mapping[str, Any]], clients: Sequence[Mapping[str, Any]]
) -> list[str]:
    """How the clients' architectures changed over rounds (from each fit reply's `arch`)."""
    current = {
        str(c.get("id")): str(c.get("arch_start", c.get("arch"))) for c in clients if "id" in c
    }
    rows = []
    seen_arch = False
    for index, record in enumerate(rounds):
        reported = mapping(record.get("clients"), f"results['rounds'][{index}]['clients']")
        switches = []
        for cid, details in reported.items():
            arch = mapping(details, f"results['rounds'][{index}]['clients'][{cid!r}]").get("arch")
            seen_arch |= arch is not None
            if arch is not None and current.get(cid) != str(arch):
                switches.append(f"{cid}: {current.get(cid, MISSING)} → {arch}")
                current[cid] = str(arch)
        if switches or index == 0:
            counts: dict[str, int] = {}
            for arch in current.values():
                counts[arch] = counts.get(arch, 0) + 1
            mix = ", ".join(f"{a} ×{n}" for a, n in sorted(counts.items()))
            rows.append([plain(record.get("round", index + 1)), mix, "; ".join(switches) or "—"])
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


def _summary_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for key, value in summary.items():
        if key == "metrics":
            continue
        if key.endswith("_acc") and is_number(value):
            text = pct(float(value))
        elif key.endswith("_seconds") and is_number(value):
            text = f"{value:.2f} s"
        else:
            text = plain(value)
        rows.append([key, text])
    return rows


def summary_section(summary: Mapping[str, Any]) -> list[str]:
    lines = ["## Summary", ""]
    rows = _summary_rows(summary)
    lines += [*table(["Quantity", "Value"], rows), ""] if rows else ["No summary recorded.", ""]
    return lines


def metrics_section(summary: Mapping[str, Any]) -> list[str]:
    """The PersFL metrics (when the local baseline ran), fairness split by the sign of QoI."""
    metrics = mapping(summary.get("metrics"), "results['summary']['metrics']")
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
        header = ["Metric", *subsets.values()]
        columns = [mapping(metrics[k], f"results['summary']['metrics'][{k!r}]") for k in subsets]
        rows = [
            [k, *(metric_value(k, col.get(k)) for col in columns)]
            for k in ("AV", "CS", "Entropy", "JI")
        ]
        lines += [
            "### Fairness over QoI",
            "",
            "QoI can be negative, so the thesis applies fairness separately to the improved "
            "clients and to the absolute QoI of the worsened ones.",
            "",
            *table(header, rows),
            "",
        ]
    return lines


def baselines_section(baselines: Mapping[str, Any]) -> list[str]:
    if not baselines:
        return []
    summary_rows = []
    per_client: dict[str, dict[str, str]] = {}
    for name, baseline in baselines.items():
        where = f"results['baselines'][{name!r}]"
        block = mapping(baseline, where)
        summary = mapping(block.get("summary"), f"{where}['summary']")
        wall = number(summary, "wall_seconds", f"{where}['summary']")
        summary_rows.append(
            [
                str(name),
                pct(number(summary, "mean_personal_acc", f"{where}['summary']")),
                pct(number(summary, "global_acc", f"{where}['summary']")),
                MISSING if wall is None else f"{wall:.2f} s",
            ]
        )
        for index, record in enumerate(records(block, "clients")):
            client_id = plain(record.get("id", index))
            acc = number(record, "personal_acc", f"{where}['clients'][{index}]")
            per_client.setdefault(client_id, {})[str(name)] = pct(acc)
    lines = [
        "## Baselines",
        "",
        *table(["Baseline", "Mean client acc", "Global acc", "Wall time"], summary_rows),
        "",
    ]
    if per_client:
        names = [str(name) for name in baselines]
        rows = [[cid, *(accs.get(n, MISSING) for n in names)] for cid, accs in per_client.items()]
        lines += [
            "Per-client accuracy of each baseline:",
            "",
            *table(["Client", *names], rows),
            "",
        ]
    return lines
