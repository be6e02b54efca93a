"""The report's first sections: what ran and where, and each client's personalized model
against its baselines.

Every accuracy is measured on each client's own test split, and every mean is over clients,
each weighing the same; "global-model accuracy" always names the accuracy of a global model
(this run's, or FedAvg's) measured that way, "final" the models after the last round. A client's
verdict compares its personalized model with the best of the baselines that ran for it (local,
FedAvg's global model, FedAvg+FT), not with FedAvg's global model alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from coordinator.report.common import MISSING, pct, plain, pp, table
from coordinator.results_model import ClientEntry, Results

__all__ = [
    "BASELINE_NOTE",
    "clients_section",
    "dataset_name",
    "overview_section",
    "partition_name",
    "verdict",
]

BASELINE_NOTE: Final[str] = (
    "Local: the same architecture trained on the client's data alone. FedAvg: the FedAvg "
    "baseline's global model. FedAvg+FT: that FedAvg model fine-tuned on the client's own data "
    "(for `fedavg_ft.ft_epochs` after the last round). Every baseline trains with the run's "
    "local-training settings."
)


# --- what ran ---------------------------------------------------------------------------------


def dataset_name(results: Results) -> str | None:
    """The data set the clients reported (a deployment) or the run's config named."""
    named = sorted({c.dataset for c in results.clients if c.dataset})
    if named:
        return ", ".join(named)
    data = results.config.get("data")
    return plain(data["dataset"]) if isinstance(data, Mapping) and data.get("dataset") else None


def partition_name(results: Results) -> str | None:
    if results.split is not None and results.split.scheme:
        return results.split.scheme
    data = results.config.get("data")
    return plain(data["partition"]) if isinstance(data, Mapping) and data.get("partition") else None


def _device_words(results: Results) -> list[str]:
    if results.device is None:
        return []
    line = f"Device: `{results.device.used}` ({results.device.reason})"
    if results.device.precision:
        line += f", {results.device.precision}"
    return [line + ".", ""]


# --- the per-client comparison ---------------------------------------------------------------


def verdict(c: ClientEntry) -> str:
    """The personalized model against the best baseline for this client, in words."""
    if c.personal_acc is None:
        return "no personalized accuracy"
    best = c.best_baseline()
    if best is None:
        return "no baseline ran"
    name, acc = best
    diff = c.personal_acc - acc
    if diff > 0:
        return f"better than the best baseline ({name}, {pp(diff)})"
    if diff < 0:
        return f"**worse than the best baseline** ({name}, {pp(diff)})"
    return f"same as the best baseline ({name})"


def _qoi(c: ClientEntry) -> float | None:
    """PersFL's QoI: personalized − max(local, G), G the FedAvg model (else this run's)."""
    g = c.fedavg_acc if c.fedavg_acc is not None else c.global_acc
    if c.personal_acc is None or c.local_acc is None or g is None:
        return None
    return c.personal_acc - max(c.local_acc, g)


def overview_section(results: Results) -> list[str]:
    """What ran and where, the mean accuracies side by side, and who gained or lost."""
    clients = results.clients
    lines = ["## At a glance", ""]
    what = (
        f"**{results.algorithm}** trained {results.population or len(clients)} clients for "
        f"{len(results.rounds)} rounds"
    )
    name, part = dataset_name(results), partition_name(results)
    if name:
        what += f" on {name}" + (f" ({part} split)" if part else "")
    sample = results.sample_line()
    lines += [what + ".", "", *([sample[0].upper() + sample[1:] + ".", ""] if sample else [])]
    lines += _device_words(results)
    algorithm = results.algorithm
    means = [
        (f"personalized models ({algorithm}, final)", results.client_mean("personal_acc")),
        ("local-only training (baseline)", results.client_mean("local_acc")),
        ("FedAvg global model (baseline)", results.client_mean("fedavg_acc")),
        (
            "FedAvg+FT: FedAvg fine-tuned on each client (baseline)",
            results.client_mean("fedavg_ft_acc"),
        ),
        (f"{algorithm} global model (final)", results.client_mean("global_acc")),
    ]
    rows = [[label, pct(value)] for label, value in means if value is not None]
    if rows:
        lines += [
            "Mean over clients (each weighs the same) of each client's accuracy on its own test "
            "split:",
            "",
            *table(["Model", "Mean accuracy"], rows),
            "",
        ]
    lines += _wins_and_losses(clients)
    return lines


def _wins_and_losses(clients: Sequence[ClientEntry]) -> list[str]:
    lines = []
    against_local = [
        (c.id, c.personal_acc - c.local_acc, "")
        for c in clients
        if c.personal_acc is not None and c.local_acc is not None
    ]
    if against_local:
        lines += [_tally("Personalization beat training alone", against_local), ""]
    against_best = [
        (c.id, c.personal_acc - best[1], f" vs {best[0]}")
        for c in clients
        if c.personal_acc is not None
        and (best := c.best_baseline()) is not None
        and len(c.baselines()) > 1  # with local alone, the sentence above says it all
    ]
    if against_best:
        what = (
            "Against each client's best baseline (the best of local, FedAvg and FedAvg+FT that "
            "ran for it), personalization won"
        )
        lines += [_tally(what, against_best), ""]
    return lines


def _tally(what: str, diffs: Sequence[tuple[str, float, str]]) -> str:
    won = [who for who, d, _ in diffs if d > 0]
    lost = [(who, d, against) for who, d, against in diffs if d < 0]
    tied = len(diffs) - len(won) - len(lost)
    sentence = f"{what} on **{len(won)} of {len(diffs)}** clients"
    if lost:
        worst = ", ".join(f"{who} {pp(d)}{vs}" for who, d, vs in sorted(lost, key=lambda x: x[1]))
        sentence += f" and **lost on {len(lost)}** ({worst})"
    if tied:
        sentence += f"; {tied} tied"
    return sentence + "."


def deployed(c: ClientEntry) -> str:
    """What a client deployed, as its row says it: architecture and size ("lenet5, 241 KiB")."""
    arch, kib = c.details.get("deployed_arch"), c.details.get("deployed_kib")
    if arch is None:
        return MISSING
    return f"{arch}, {kib:.0f} KiB" if isinstance(kib, int | float) else str(arch)


def clients_section(results: Results) -> list[str]:
    lines = ["## Clients", ""]
    clients = results.clients
    if not clients:
        return [*lines, "No clients were recorded.", ""]
    columns: list[tuple[str, Any]] = [
        ("Personalized", lambda c: pct(c.personal_acc)),
        ("Local", lambda c: pct(c.local_acc)),
        ("FedAvg", lambda c: pct(c.fedavg_acc)),
        ("FedAvg+FT", lambda c: pct(c.fedavg_ft_acc)),
        (f"{results.algorithm} global", lambda c: pct(c.global_acc)),
    ]
    # Accuracies no client has (a baseline that did not run) get no column.
    shown = [(h, f) for h, f in columns if any(f(c) != MISSING for c in clients)]
    devices = {c.device for c in clients}
    told = any("deployed_arch" in c.details for c in clients)  # (results from before: none)
    header = ["Client", "Arch", "n_train", *(h for h, _ in shown), "Verdict", "QoI"]
    if told:
        header.insert(2, "Deployed")
    if len(devices) > 1:  # a deployment whose devices differ: say which is which
        header.insert(2, "Device")
    rows = []
    for c in clients:
        row = [c.id, plain(c.arch), plain(c.n_train), *(f(c) for _, f in shown)]
        row += [verdict(c), pp(_qoi(c))]
        if told:
            row.insert(2, deployed(c))
        if len(devices) > 1:
            row.insert(2, plain(c.device) + (f" ({c.precision})" if c.precision else ""))
        rows.append(row)
    note = (
        "Deployed: the model the device deployed (the Personalized column's), its architecture "
        "and the size of its weights; the client details below say why. Accuracy of each model "
        "on the client's own test split. "
        + BASELINE_NOTE
        + f" {results.algorithm} global: this run's own global model, where it has one. The "
        "verdict compares the personalized model with the best of the baselines that ran, for "
        "that client. QoI (PersFL's) = personalized − max(local, FedAvg) in percentage points "
        "(pp); this run's global model stands in when no fedavg baseline ran."
    )
    return [*lines, *table(header, rows), "", note, ""]
