"""The report's figures, drawn from the results dict.

Every plot is drawn on a ``matplotlib.figure.Figure`` attached to the Agg canvas directly: no
pyplot, no global backend switch, safe to call from a process that already uses another backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from coordinator.report.common import ReportError, mapping, number, plain, write_atomic

__all__ = [
    "SERIES",
    "client_figure",
    "collaboration_figure",
    "collaboration_matrices",
    "round_figure",
    "save_png",
    "split_figure",
]

# Per-client accuracies the client plot compares: results key -> legend label. The FedAvg
# baseline's model when it ran, else this run's global model.
SERIES: Final[tuple[tuple[str, str], ...]] = (
    ("personal_acc", "personalized"),
    ("local_acc", "local only"),
    ("fedavg_acc", "FedAvg global"),
    ("global_acc", "this run's global"),
)
_BASELINE_LINES: Final[tuple[tuple[str, str], ...]] = (
    ("local", "local only (final mean)"),
    ("fedavg", "FedAvg (final mean)"),
)


def _series(records: Sequence[Mapping[str, Any]], key: str, where: str) -> np.ndarray:
    values = [number(record, key, f"{where}[{i}]") for i, record in enumerate(records)]
    return np.array([np.nan if v is None else v * 100 for v in values], dtype=float)


def _empty(figure: Figure, text: str) -> Figure:
    axes = figure.axes[0]
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes)
    return figure


def round_figure(
    rounds: Sequence[Mapping[str, Any]], baselines: Mapping[str, Any] | None = None
) -> Figure:
    """Mean personalized and global accuracy per round; each client's own line when the rounds
    carry `client_acc`; the baselines' final means as horizontal lines."""
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Accuracy per round")
    axes.set_xlabel("round")
    axes.set_ylabel("accuracy (%)")
    if not rounds:
        return _empty(figure, "no rounds recorded")
    numbers = [
        number(record, "round", f"results['rounds'][{i}]") for i, record in enumerate(rounds)
    ]
    x = [float(i + 1) if n is None else n for i, n in enumerate(numbers)]
    per_client: dict[str, list[float]] = {}
    for i, record in enumerate(rounds):
        where = f"results['rounds'][{i}]['client_acc']"
        accs = mapping(record.get("client_acc"), where)
        for cid in accs:
            acc = number(accs, cid, where)
            line = per_client.setdefault(str(cid), [np.nan] * len(rounds))
            line[i] = np.nan if acc is None else acc * 100
    for cid, values in per_client.items():
        axes.plot(x, values, linewidth=0.9, alpha=0.55, label=f"{cid}")
    for key, label, style in (
        ("mean_personal_acc", "mean personalized", "-"),
        ("global_acc", "global model", "--"),
    ):
        y = _series(rounds, key, "results['rounds']")
        if np.isfinite(y).any():
            axes.plot(
                x, y, style, color="black", linewidth=2.2, marker="o", markersize=3, label=label
            )
    for (name, label), color in zip(_BASELINE_LINES, ("tab:gray", "tab:red"), strict=True):
        block = mapping((baselines or {}).get(name), f"results['baselines'][{name!r}]")
        summary = mapping(block.get("summary"), f"results['baselines'][{name!r}]['summary']")
        value = number(summary, "mean_personal_acc", f"results['baselines'][{name!r}]")
        if value is not None:
            axes.axhline(value * 100, color=color, linestyle=":", linewidth=1.5, label=label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        figure.legend(loc="outside right upper", fontsize=8)
    return figure


def client_figure(clients: Sequence[Mapping[str, Any]]) -> Figure:
    """Grouped bars per client: personalized, local-only and global accuracy."""
    width = min(max(7.0, 0.45 * len(clients) + 2.0), 40.0)
    figure = Figure(figsize=(width, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Accuracy per client (own test split)")
    axes.set_ylabel("accuracy (%)")
    if not clients:
        return _empty(figure, "no clients recorded")
    present = [
        (label, values)
        for key, label in SERIES
        if np.isfinite(values := _series(clients, key, "results['clients']")).any()
    ]
    if any(label == "FedAvg global" for label, _ in present):  # the comparison PersFL makes
        present = [(label, v) for label, v in present if label != "this run's global"]
    positions = np.arange(len(clients))
    bar_width = 0.8 / max(len(present), 1)
    for offset, (label, values) in enumerate(present):
        shift = (offset - (len(present) - 1) / 2) * bar_width
        axes.bar(positions + shift, np.nan_to_num(values), bar_width, label=label)
    labels = [
        f"{plain(record.get('id', i))}\n{plain(record.get('arch'))}"
        if record.get("arch")
        else plain(record.get("id", i))
        for i, record in enumerate(clients)
    ]
    axes.set_xticks(positions, labels, rotation=90 if len(clients) > 12 else 0)
    axes.set_ylim(0, 100)
    axes.grid(axis="y", alpha=0.3)
    if present:
        figure.legend(loc="outside right upper")
    return figure


def split_figure(split: Mapping[str, Any], arch: Mapping[str, str]) -> Figure:
    """Stacked horizontal bars: each client's training samples per class."""
    classes = [str(c) for c in split.get("classes") or []]
    rows = split.get("clients") or []
    counts = np.array([list(mapping(r, "results['split']['clients']")["counts"]) for r in rows])
    if counts.ndim != 2 or (classes and counts.shape[1] != len(classes)):
        raise ReportError(
            "results['split']['clients'][*]['counts'] must each hold one count per class "
            f"({len(classes)} classes)"
        )
    figure = Figure(figsize=(9, min(max(2.5, 0.35 * len(rows) + 1.5), 30.0)), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Training samples per class, per client")
    palette = colormaps["tab20" if counts.shape[1] > 10 else "tab10"]
    left = np.zeros(len(rows))
    positions = np.arange(len(rows))
    for k in range(counts.shape[1]):
        if counts[:, k].any():
            name = classes[k] if classes else str(k)
            axes.barh(positions, counts[:, k], left=left, color=palette(k % palette.N), label=name)
        left += counts[:, k]
    names = [str(r.get("id", i)) for i, r in enumerate(rows)]
    axes.set_yticks(positions, [f"{n} ({arch[n]})" if n in arch else n for n in names])
    axes.invert_yaxis()
    axes.set_xlabel("training samples")
    if 0 < counts.shape[1] <= 20:
        figure.legend(loc="outside right upper", fontsize=8, title="class")
    return figure


def collaboration_matrices(
    results: Mapping[str, Any], n_clients: int
) -> list[tuple[str, np.ndarray]]:
    """(title, clients × clients matrix) panels: up to three rounds of `collaboration_history`
    (a list with one matrix per round, or of {"round", "matrix"}) and the final `collaboration`."""

    def as_matrix(value: Any, where: str) -> np.ndarray:
        try:
            m = np.array(value, dtype=float)
        except (TypeError, ValueError) as exc:
            raise ReportError(f"{where} must be a list of lists of numbers: {exc}") from exc
        if m.shape != (n_clients, n_clients):
            raise ReportError(
                f"{where} must be {n_clients}×{n_clients} (clients × clients); got {m.shape}"
            )
        return m

    panels: list[tuple[str, np.ndarray]] = []
    history = results.get("collaboration_history") or []
    picked: list[tuple[int, Any]] = []
    for i, entry in enumerate(history):
        if isinstance(entry, Mapping):
            picked.append((int(entry.get("round", i + 1)), entry.get("matrix")))
        else:
            picked.append((i + 1, entry))
    if len(picked) > 3:  # first, middle, last-but-final: the final matrix is shown on its own
        picked = [picked[0], picked[len(picked) // 2], picked[-1]]
    for r, value in picked:
        panels.append((f"round {r}", as_matrix(value, f"results['collaboration_history'] ({r})")))
    final = as_matrix(results["collaboration"], "results['collaboration']")
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
        axes.set_xlabel("model of client")
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
    write_atomic(path, lambda handle: figure.savefig(handle, format="png", dpi=110), text=False)
