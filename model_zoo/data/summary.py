"""Human-readable views of a partition: a per-client table and a label-distribution plot."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import atomic_open
from .partition import Partition

__all__ = [
    "PLOT_CLIENTS_MAX",
    "class_bars",
    "format_split_table",
    "plot_label_distribution",
    "split_summary",
]

logger = logging.getLogger(__name__)

# A plot of clients draws at most this many, one bar each: a population's 10,000 bars took
# minutes to draw and could not be read. The table (split.txt) keeps every client.
PLOT_CLIENTS_MAX = 100

_COLUMNS = ("client", "n_train", "n_val", "n_test", "n_total", "n_classes", "top_classes")


def _labels(labels: np.ndarray | torch.Tensor | Sequence[int]) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    return np.asarray(labels).astype(np.int64)


def split_summary(
    partition: Partition,
    labels: np.ndarray | torch.Tensor | Sequence[int],
    *,
    top: int = 3,
    class_names: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per client: client, n_train, n_val, n_test, n_total, n_classes and top_classes
    (the `top` most frequent classes as (class, count) pairs, by name when `class_names`)."""
    y = _labels(labels)
    rows = []
    for i, c in enumerate(partition.clients):
        classes, counts = np.unique(y[c.indices], return_counts=True)
        order = np.lexsort((classes, -counts))[:top]
        top_classes = [
            (class_names[int(classes[j])] if class_names else int(classes[j]), int(counts[j]))
            for j in order
        ]
        rows.append(
            {
                "client": i,
                "n_train": len(c.train),
                "n_val": len(c.val),
                "n_test": len(c.test),
                "n_total": len(c),
                "n_classes": len(classes),
                "top_classes": top_classes,
            }
        )
    return rows


def format_split_table(rows: Sequence[dict[str, Any]]) -> str:
    """`split_summary` rows as a plain-text table: numbers right-aligned, a header rule."""
    cells = [list(_COLUMNS)]
    for row in rows:
        top = ", ".join(f"{c}:{n}" for c, n in row.get("top_classes", []))
        cells.append([str(row[k]) for k in _COLUMNS[:-1]] + [top])
    widths = [max(len(r[j]) for r in cells) for j in range(len(_COLUMNS))]

    def line(r: list[str]) -> str:
        numbers = [v.rjust(w) for v, w in zip(r[:-1], widths[:-1], strict=True)]
        return "  ".join([*numbers, r[-1]]).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def class_bars(
    axes: Any, counts: np.ndarray, rows: Sequence[str], class_names: Sequence[str] | None = None
) -> None:
    """Stacked horizontal bars on matplotlib `axes`, top to bottom: a bar per row of `counts`
    (clients × classes) labelled by `rows`, a colour per class, named by `class_names` (else
    its index) in the legend's handles."""
    from matplotlib import colormaps

    palette = colormaps["tab20" if counts.shape[1] > 10 else "tab10"]
    left = np.zeros(len(counts))
    positions = np.arange(len(counts))
    for k in range(counts.shape[1]):
        if counts[:, k].any():
            name = class_names[k] if class_names and k < len(class_names) else str(k)
            axes.barh(positions, counts[:, k], left=left, color=palette(k % palette.N), label=name)
        left += counts[:, k]
    axes.set_yticks(positions, list(rows))
    axes.invert_yaxis()


def plot_label_distribution(
    partition: Partition,
    labels: np.ndarray | torch.Tensor | Sequence[int],
    path: str | Path,
    class_names: Sequence[str] | None = None,
) -> Path:
    """Stacked horizontal bars, one per client (the first `PLOT_CLIENTS_MAX`), one colour per
    class (all of the client's samples). Written atomically (`model_zoo.files`), so a reader
    never sees a half-written PNG. Returns the path."""
    # The object-oriented API with the Agg canvas: no pyplot state, no GUI backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    y = _labels(labels)
    num_classes = int(y.max()) + 1 if len(y) else 0
    shown = partition.clients[:PLOT_CLIENTS_MAX]
    counts = np.zeros((len(shown), num_classes), dtype=np.int64)
    for i, c in enumerate(shown):
        counts[i] = np.bincount(y[c.indices], minlength=num_classes)
    height = min(max(2.5, 0.28 * len(shown) + 1.5), 40.0)
    fig = Figure(figsize=(9, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    class_bars(ax, counts, [str(i) for i in range(len(shown))], class_names)
    ax.tick_params(axis="y", labelsize=7 if len(shown) > 30 else 9)
    ax.set_xlabel("samples")
    ax.set_ylabel("client")
    title = f"label distribution per client ({partition.scheme})"
    if len(shown) < len(partition):
        title += f": the first {len(shown)} of {len(partition):,}"
    ax.set_title(title)
    if 0 < num_classes <= 20:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, title="class")
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=100)
    logger.info("wrote label distribution plot %s", path)
    return path
