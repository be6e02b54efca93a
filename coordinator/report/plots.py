"""The report's figures, drawn from the typed results.

Every plot is drawn on a ``matplotlib.figure.Figure`` attached to the Agg canvas directly: no
pyplot, no global backend switch, safe to call from a process that already uses another backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from coordinator.results_model import Baseline, ClientEntry, Results, RoundEntry, Split
from model_zoo.data import PLOT_CLIENTS_MAX, class_bars
from model_zoo.files import atomic_open

__all__ = [
    "SERIES",
    "client_figure",
    "collaboration_figure",
    "collaboration_matrices",
    "round_figure",
    "save_png",
    "split_figure",
]

# Per-client accuracies the client plot compares: ClientEntry field -> legend label.
SERIES: Final[tuple[tuple[str, str], ...]] = (
    ("personal_acc", "personalized"),
    ("local_acc", "local only"),
    ("fedavg_acc", "FedAvg global model"),
    ("fedavg_ft_acc", "FedAvg+FT"),
    ("global_acc", "this run's global model"),
)
# Above this many clients the figures show the spread over clients (percentiles, sorted
# curves) instead of a line, a bar and a legend entry per client: a run of thousands of
# devices drew for minutes, and no one can read a legend of thousands.
MANY_CLIENTS: Final[int] = 40
_BASELINE_LINES: Final[tuple[tuple[str, str, str], ...]] = (
    ("local", "local only (final mean)", "tab:gray"),
    ("fedavg", "FedAvg (final mean)", "tab:red"),
    ("fedavg_ft", "FedAvg+FT (final mean)", "tab:purple"),
)


def _percent(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v * 100 for v in values], dtype=float)


def _empty(figure: Figure, text: str) -> Figure:
    axes = figure.axes[0]
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes)
    return figure


def round_figure(
    rounds: Sequence[RoundEntry], baselines: Mapping[str, Baseline] | None = None
) -> Figure:
    """Mean personalized and global-model accuracy per round; each client's own line when the
    rounds carry `client_acc` for a few clients, else the band between their 10th and 90th
    percentile (`acc_spread`); the baselines' final means as horizontal lines."""
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Accuracy per round")
    axes.set_xlabel("round")
    axes.set_ylabel("accuracy (%)")
    if not rounds:
        return _empty(figure, "no rounds recorded")
    x = [float(r.round) for r in rounds]
    per_client: dict[str, list[float]] = {}
    for i, r in enumerate(rounds):
        for cid, acc in r.client_acc.items():
            line = per_client.setdefault(cid, [np.nan] * len(rounds))
            line[i] = np.nan if acc is None else acc * 100
    spreads = [(r.round, r.acc_spread) for r in rounds if r.acc_spread is not None]
    if spreads and (len(per_client) > MANY_CLIENTS or not per_client):
        most = max(s.n for _, s in spreads)
        axes.fill_between(
            [float(x) for x, _ in spreads],
            [s.p10 * 100 for _, s in spreads],
            [s.p90 * 100 for _, s in spreads],
            alpha=0.25,
            label=f"{most} clients, 10th-90th percentile",
        )
    elif len(per_client) <= MANY_CLIENTS:
        for cid, values in per_client.items():
            axes.plot(x, values, linewidth=0.9, alpha=0.55, label=f"{cid}")
    for means, label, style in (
        ([r.mean_personal_acc for r in rounds], "mean personalized", "-"),
        ([r.global_acc for r in rounds], "mean global model", "--"),
    ):
        y = _percent(means)
        if np.isfinite(y).any():
            axes.plot(
                x, y, style, color="black", linewidth=2.2, marker="o", markersize=3, label=label
            )
    for name, label, color in _BASELINE_LINES:
        baseline = (baselines or {}).get(name)
        value = baseline.summary.mean_personal_acc if baseline else None
        if value is not None:
            axes.axhline(value * 100, color=color, linestyle=":", linewidth=1.5, label=label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        figure.legend(loc="outside right upper", fontsize=8)
    return figure


def client_figure(clients: Sequence[ClientEntry]) -> Figure:
    """Grouped bars per client: personalized, local-only, the baselines' and global accuracy;
    above `MANY_CLIENTS`, each of those as a curve over the clients sorted by it."""
    if len(clients) > MANY_CLIENTS:
        return _sorted_clients_figure(clients)
    width = min(max(7.0, 0.45 * len(clients) + 2.0), 40.0)
    figure = Figure(figsize=(width, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Accuracy per client (own test split)")
    axes.set_ylabel("accuracy (%)")
    if not clients:
        return _empty(figure, "no clients recorded")
    present = _series(clients)
    positions = np.arange(len(clients))
    bar_width = 0.8 / max(len(present), 1)
    for offset, (_, label, values) in enumerate(present):
        shift = (offset - (len(present) - 1) / 2) * bar_width
        axes.bar(positions + shift, np.nan_to_num(values), bar_width, label=label)
    labels = [f"{c.id}\n{c.arch}" if c.arch else c.id for c in clients]
    axes.set_xticks(positions, labels, rotation=90 if len(clients) > 12 else 0)
    axes.set_ylim(0, 100)
    axes.grid(axis="y", alpha=0.3)
    if present:
        figure.legend(loc="outside right upper")
    return figure


def _series(clients: Sequence[ClientEntry]) -> list[tuple[str, str, np.ndarray]]:
    """The accuracies the client figure compares, each (field, label, values) with a value."""
    present = [
        (key, label, values)
        for key, label in SERIES
        if np.isfinite(values := _percent([getattr(c, key) for c in clients])).any()
    ]
    if any(key == "fedavg_acc" for key, _, _ in present):  # the global model PersFL compares with
        present = [p for p in present if p[0] != "global_acc"]
    return present


def _sorted_clients_figure(clients: Sequence[ClientEntry]) -> Figure:
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(f"Accuracy per client (own test split), {len(clients)} clients")
    axes.set_xlabel("share of clients (each curve sorted by its own accuracy)")
    axes.set_ylabel("accuracy (%)")
    present = _series(clients)
    for _, label, values in present:
        y = np.sort(values[np.isfinite(values)])
        axes.plot(np.linspace(0, 100, len(y)), y, linewidth=1.5, label=label)
    axes.set_ylim(0, 100)
    axes.grid(alpha=0.3)
    if present:
        figure.legend(loc="outside right upper")
    return figure


def split_figure(split: Split, arch: Mapping[str, str]) -> Figure:
    """Stacked horizontal bars: each client's training samples per class; of a population, at
    most `PLOT_CLIENTS_MAX` clients, those with results (`arch`) first."""
    classes = split.classes
    first = sorted(range(len(split.clients)), key=lambda i: split.clients[i].id not in arch)
    shown = [split.clients[i] for i in sorted(first[:PLOT_CLIENTS_MAX])]  # in the split's order
    counts = np.array([c.counts for c in shown], dtype=np.int64).reshape(len(shown), -1)
    figure = Figure(figsize=(9, min(max(2.5, 0.35 * len(shown) + 1.5), 30.0)), layout="constrained")
    axes = figure.add_subplot()
    title = "Training samples per class, per client"
    if len(shown) < len(split.clients):
        title += f" ({len(shown)} of {len(split.clients):,}; split.txt has every one)"
    axes.set_title(title)
    names = [c.id for c in shown]
    class_bars(axes, counts, [f"{n} ({arch[n]})" if n in arch else n for n in names], classes)
    axes.set_xlabel("training samples")
    if 0 < counts.shape[1] <= 20:
        figure.legend(loc="outside right upper", fontsize=8, title="class")
    return figure


def collaboration_matrices(results: Results) -> list[tuple[str, np.ndarray]]:
    """(title, clients × clients matrix) panels: up to three rounds of `collaboration_history`
    and the final `collaboration` (validated square when the results were)."""
    panels = [
        (f"round {h.round}", np.array(h.matrix, dtype=float))
        for h in results.collaboration_history or []
    ]
    if len(panels) > 3:  # first, middle, last-but-final: the final matrix is shown on its own
        panels = [panels[0], panels[len(panels) // 2], panels[-1]]
    final = np.array(results.collaboration, dtype=float)
    if not panels or not np.array_equal(panels[-1][1], final):
        panels.append(("final", final))
    return panels


def collaboration_figure(panels: Sequence[tuple[str, np.ndarray]], ids: Sequence[str]) -> Figure:
    """Heatmaps of w_ij: how much client i (row) relies on client j's model (column)."""
    n = len(ids)
    size = min(max(3.2, 0.55 * n + 1.5), 12.0)
    figure = Figure(figsize=(size * len(panels) + 1.0, size), layout="constrained")
    top = max(float(m.max()) for _, m in panels) or 1.0
    image = None
    for k, (title, matrix) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), k + 1)
        image = axes.imshow(matrix, cmap="viridis", vmin=0.0, vmax=top)
        axes.set_title(title)
        axes.set_xticks(range(n), ids, rotation=90 if n > 8 else 0)
        axes.set_yticks(range(n), ids)
        for i in range(n):  # the diagonal: each client's weight on its own model
            axes.add_patch(
                Rectangle((i - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="white", linestyle=":")
            )
        axes.set_xlabel("model of client (dotted: its own)")
        if k == 0:
            axes.set_ylabel("client")
        if n <= 12:
            for i in range(n):
                for j in range(n):
                    value = matrix[i, j]
                    color = "black" if value > 0.6 * top else "white"
                    axes.text(
                        j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=color
                    )
    if image is not None:
        figure.colorbar(image, ax=figure.axes, shrink=0.8, label="weight")
    figure.suptitle("Who relies on whom: collaboration weights")
    return figure


def save_png(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    with atomic_open(path) as handle:
        figure.savefig(handle, format="png", dpi=110)
