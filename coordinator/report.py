"""Markdown and PNG report of a simulator run, built from its ``results.json``.

:func:`write_report` turns the results dict into ``report.md`` plus two plots next to it,
``personal_acc_per_round.png`` and ``client_accuracy.png``. Every file is written atomically
(a temporary file in the same folder, then ``os.replace``), so a reader never sees half a report.

Plots are drawn on a ``matplotlib.figure.Figure`` attached to the Agg canvas directly: no pyplot,
no global backend switch, safe to call from a process that already uses another backend.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from coordinator.metrics import METRIC_DESCRIPTIONS, METRIC_KEYS

__all__ = [
    "CLIENT_PLOT_NAME",
    "REPORT_NAME",
    "ROUND_PLOT_NAME",
    "ReportError",
    "write_report",
]

logger = logging.getLogger(__name__)

REPORT_NAME: Final[str] = "report.md"
ROUND_PLOT_NAME: Final[str] = "personal_acc_per_round.png"
CLIENT_PLOT_NAME: Final[str] = "client_accuracy.png"

MISSING: Final[str] = "—"

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
_MAX_CELL_CHARS: Final[int] = 120
_FILE_MODE: Final[int] = 0o644  # mkstemp creates 0o600; reports are meant to be shared

_UNITS: Final[dict[str, str]] = {
    "PUI": "%",
    "PUD": "%",
    "MPI": "pp",
    "API": "pp",
    "MPD": "pp",
    "APD": "pp",
    "AV": "pp²",
}
_FAIRNESS_SUBSETS: Final[dict[str, str]] = {
    "fairness_improved": "U+ (QoI of improved clients)",
    "fairness_worsened": "|U−| (absolute QoI of worsened clients)",
}
_SERIES: Final[tuple[tuple[str, str], ...]] = (
    ("personal_acc", "personalized"),
    ("local_acc", "local"),
    ("global_acc", "global"),
)


class ReportError(ValueError):
    """The results dict does not have the shape the simulator writes."""


# --- reading the results ---------------------------------------------------------------------


def _records(results: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    """``results[key]`` as a list of mappings ([] when absent), or raise ReportError."""
    value = results.get(key)
    if value is None:
        return []
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ReportError(f"results[{key!r}] must be a list of objects; got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ReportError(
                f"results[{key!r}][{index}] must be an object; got {type(item).__name__}"
            )
    return list(value)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReportError(f"{where} must be an object; got {type(value).__name__}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(record: Mapping[str, Any], key: str, where: str) -> float | None:
    """A numeric field as float, None when absent or null; ReportError when not a number."""
    value = record.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise ReportError(f"{where}[{key!r}] must be a number or null; got {value!r}")
    return float(value)


def _find_config_value(config: Mapping[str, Any], keys: Sequence[str], depth: int) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if depth <= 0:
        return None
    for value in config.values():
        if isinstance(value, Mapping):
            found = _find_config_value(value, keys, depth - 1)
            if found is not None:
                return found
    return None


# --- formatting ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Make ``text`` safe inside a Markdown table cell."""
    text = " ".join(text.split()).replace("|", "\\|")
    if len(text) > _MAX_CELL_CHARS:
        text = text[: _MAX_CELL_CHARS - 1] + "…"
    return text


def _pct(value: float | None) -> str:
    """An accuracy fraction as a percentage with 2 decimals."""
    return MISSING if value is None else f"{value * 100:.2f}%"


def _pp(value: float | None) -> str:
    """A difference of fractions as signed percentage points."""
    return MISSING if value is None else f"{value * 100:+.2f} pp"


def _plain(value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        rest = {k: v for k, v in value.items() if k != "name"}
        return value["name"] + (f" {json.dumps(rest, default=str)}" if rest else "")
    if isinstance(value, Sequence) and all(isinstance(v, str | int | float) for v in value):
        return ", ".join(str(v) for v in value)
    if isinstance(value, Sequence):
        return f"{len(value)} entries"
    return json.dumps(value, default=str)


def _metric_value(key: str, value: Any) -> str:
    if value is None:
        return MISSING
    if not _is_number(value):
        return _plain(value)
    unit = _UNITS.get(key)
    if unit == "%":
        return f"{value:.2f}%"
    if unit == "pp":
        return f"{value:+.2f} pp"
    if unit == "pp²":
        return f"{value:.2f} pp²"
    return f"{value:.4f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines.extend("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)
    return lines


# --- report sections -------------------------------------------------------------------------


def _config_section(
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
        value = _find_config_value(config, keys, _CONFIG_SEARCH_DEPTH)
        if value is None:
            value = fallback.get(label)
        rows.append([label, _plain(value)])
    # The run's own algorithm section (every hyperparameter it ran with).
    section = config.get(str(config.get("algorithm")))
    if isinstance(section, Mapping):
        rows.append(
            [f"{config['algorithm']} settings", ", ".join(f"{k}={v}" for k, v in section.items())]
        )
    return ["## Configuration", "", *_table(["Setting", "Value"], rows), ""]


def _rounds_section(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Rounds", ""]
    if not rounds:
        return [*lines, "No rounds were recorded.", ""]
    rows = []
    for index, record in enumerate(rounds):
        where = f"results['rounds'][{index}]"
        seconds = _number(record, "seconds", where)
        number = _number(record, "round", where)
        rows.append(
            [
                _plain(index + 1 if number is None else number),
                MISSING if seconds is None else f"{seconds:.2f}",
                _pct(_number(record, "mean_personal_acc", where)),
                _pct(_number(record, "global_acc", where)),
            ]
        )
    header = ["Round", "Seconds", "Mean personalized acc", "Global acc"]
    return [*lines, *_table(header, rows), ""]


def _client_qoi(personal: float | None, local: float | None, global_: float | None) -> str:
    if personal is None or local is None or global_ is None:
        return MISSING
    return _pp(personal - max(local, global_))


def _clients_section(clients: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Clients", ""]
    if not clients:
        return [*lines, "No clients were recorded.", ""]
    rows = []
    for index, record in enumerate(clients):
        where = f"results['clients'][{index}]"
        personal, local, global_ = (_number(record, key, where) for key, _ in _SERIES)
        fedavg = _number(record, "fedavg_acc", where)
        # PersFL's G_i is the global FedAvg model: use the fedavg baseline when it ran.
        reference = fedavg if fedavg is not None else global_
        rows.append(
            [
                _plain(record.get("id", index)),
                _plain(record.get("arch")),
                _plain(record.get("n_train")),
                _pct(personal),
                _pct(local),
                _pct(global_),
                _pct(fedavg),
                _client_qoi(personal, local, reference),
            ]
        )
    header = ["Client", "Arch", "n_train", "Personalized", "Local", "Global", "FedAvg", "QoI"]
    note = (
        "Global: this run's global model on the client's test split. QoI = personalized − "
        "max(local, FedAvg global) in percentage points (pp); this run's global model stands in "
        "when no fedavg baseline ran."
    )
    return [*lines, *_table(header, rows), "", note, ""]


# Fields every client entry has; anything else an algorithm reported (details).
_CLIENT_FIELDS: Final[frozenset[str]] = frozenset(
    {"id", "arch", "n_train", "personal_acc", "global_acc", "local_acc", "fedavg_acc", "error"}
)


def _details_section(clients: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the algorithm reported per client (PersFL's teacher round, λ, T; FedMe's archs)."""
    keys: list[str] = []
    for record in clients:
        keys += [k for k in record if k not in _CLIENT_FIELDS and k not in keys]
    if not keys:
        return []
    rows = [
        [_plain(record.get("id", i)), *(_plain(record.get(k)) for k in keys)]
        for i, record in enumerate(clients)
    ]
    return ["## Client details", "", *_table(["Client", *keys], rows), ""]


def _architecture_section(
    rounds: Sequence[Mapping[str, Any]], clients: Sequence[Mapping[str, Any]]
) -> list[str]:
    """How the clients' architectures changed over rounds (from each fit reply's `arch`)."""
    current = {
        str(c.get("id")): str(c.get("arch_start", c.get("arch"))) for c in clients if "id" in c
    }
    rows = []
    seen_arch = False
    for index, record in enumerate(rounds):
        reported = _mapping(record.get("clients"), f"results['rounds'][{index}]['clients']")
        switches = []
        for cid, details in reported.items():
            arch = _mapping(details, f"results['rounds'][{index}]['clients'][{cid!r}]").get("arch")
            seen_arch |= arch is not None
            if arch is not None and current.get(cid) != str(arch):
                switches.append(f"{cid}: {current.get(cid, MISSING)} → {arch}")
                current[cid] = str(arch)
        if switches or index == 0:
            counts: dict[str, int] = {}
            for arch in current.values():
                counts[arch] = counts.get(arch, 0) + 1
            mix = ", ".join(f"{a} ×{n}" for a, n in sorted(counts.items()))
            rows.append([_plain(record.get("round", index + 1)), mix, "; ".join(switches) or "—"])
    if not seen_arch:
        return []
    return [
        "## Architectures over rounds",
        "",
        "Rounds in which some client changed architecture (and the first round); the mix is "
        "after the round.",
        "",
        *_table(["Round", "Architectures", "Changes"], rows),
        "",
    ]


def _summary_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for key, value in summary.items():
        if key == "metrics":
            continue
        if key.endswith("_acc") and _is_number(value):
            text = _pct(float(value))
        elif key.endswith("_seconds") and _is_number(value):
            text = f"{value:.2f} s"
        else:
            text = _plain(value)
        rows.append([key, text])
    return rows


def _summary_section(summary: Mapping[str, Any]) -> list[str]:
    lines = ["## Summary", ""]
    rows = _summary_rows(summary)
    lines += [*_table(["Quantity", "Value"], rows), ""] if rows else ["No summary recorded.", ""]
    metrics = _mapping(summary.get("metrics"), "results['summary']['metrics']")
    if not metrics:
        return lines
    lines += [
        "## Personalization metrics",
        "",
        "PersFL thesis, section 5.2.3. PUI/PUD in percent of clients; MPI/API/MPD/APD in "
        "percentage points of QoI; AV/CS/Entropy/JI over the personalized accuracies (percent).",
        "",
    ]
    keys = [k for k in METRIC_KEYS if k in metrics]
    keys += [k for k in metrics if k not in METRIC_KEYS and k not in _FAIRNESS_SUBSETS]
    rows = [[k, _metric_value(k, metrics[k]), METRIC_DESCRIPTIONS.get(k, "")] for k in keys]
    lines += [*_table(["Metric", "Value", "Meaning"], rows), ""]
    subsets = {k: v for k, v in _FAIRNESS_SUBSETS.items() if k in metrics}
    if subsets:
        header = ["Metric", *subsets.values()]
        columns = [_mapping(metrics[k], f"results['summary']['metrics'][{k!r}]") for k in subsets]
        rows = [
            [k, *(_metric_value(k, col.get(k)) for col in columns)]
            for k in ("AV", "CS", "Entropy", "JI")
        ]
        lines += [
            "### Fairness over QoI",
            "",
            "QoI can be negative, so the thesis applies fairness separately to the improved "
            "clients and to the absolute QoI of the worsened ones.",
            "",
            *_table(header, rows),
            "",
        ]
    return lines


def _baselines_section(baselines: Mapping[str, Any]) -> list[str]:
    if not baselines:
        return []
    summary_rows = []
    per_client: dict[str, dict[str, str]] = {}
    for name, baseline in baselines.items():
        where = f"results['baselines'][{name!r}]"
        block = _mapping(baseline, where)
        summary = _mapping(block.get("summary"), f"{where}['summary']")
        wall = _number(summary, "wall_seconds", f"{where}['summary']")
        summary_rows.append(
            [
                str(name),
                _pct(_number(summary, "mean_personal_acc", f"{where}['summary']")),
                _pct(_number(summary, "global_acc", f"{where}['summary']")),
                MISSING if wall is None else f"{wall:.2f} s",
            ]
        )
        for index, record in enumerate(_records(block, "clients")):
            client_id = _plain(record.get("id", index))
            acc = _number(record, "personal_acc", f"{where}['clients'][{index}]")
            per_client.setdefault(client_id, {})[str(name)] = _pct(acc)
    lines = [
        "## Baselines",
        "",
        *_table(["Baseline", "Mean client acc", "Global acc", "Wall time"], summary_rows),
        "",
    ]
    if per_client:
        names = [str(name) for name in baselines]
        rows = [[cid, *(accs.get(n, MISSING) for n in names)] for cid, accs in per_client.items()]
        lines += [
            "Per-client accuracy of each baseline:",
            "",
            *_table(["Client", *names], rows),
            "",
        ]
    return lines


# --- plots -----------------------------------------------------------------------------------


def _series(records: Sequence[Mapping[str, Any]], key: str, where: str) -> np.ndarray:
    values = [_number(record, key, f"{where}[{i}]") for i, record in enumerate(records)]
    return np.array([np.nan if v is None else v * 100 for v in values], dtype=float)


def _round_figure(rounds: Sequence[Mapping[str, Any]]) -> Figure:
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Accuracy per round")
    axes.set_xlabel("round")
    axes.set_ylabel("accuracy (%)")
    if not rounds:
        axes.text(
            0.5, 0.5, "no rounds recorded", ha="center", va="center", transform=axes.transAxes
        )
        return figure
    numbers = [
        _number(record, "round", f"results['rounds'][{i}]") for i, record in enumerate(rounds)
    ]
    x = [float(i + 1) if n is None else n for i, n in enumerate(numbers)]
    for key, label in (("mean_personal_acc", "mean personalized"), ("global_acc", "global")):
        y = _series(rounds, key, "results['rounds']")
        if np.isfinite(y).any():
            axes.plot(x, y, marker="o", markersize=3, label=label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    return figure


def _client_figure(clients: Sequence[Mapping[str, Any]]) -> Figure:
    width = min(max(7.0, 0.45 * len(clients) + 2.0), 40.0)
    figure = Figure(figsize=(width, 4.5), layout="constrained")
    axes = figure.add_subplot()
    axes.set_title("Accuracy per client")
    axes.set_ylabel("accuracy (%)")
    if not clients:
        axes.text(
            0.5, 0.5, "no clients recorded", ha="center", va="center", transform=axes.transAxes
        )
        return figure
    present = [
        (label, values)
        for key, label in _SERIES
        if np.isfinite(values := _series(clients, key, "results['clients']")).any()
    ]
    positions = np.arange(len(clients))
    bar_width = 0.8 / max(len(present), 1)
    for offset, (label, values) in enumerate(present):
        shift = (offset - (len(present) - 1) / 2) * bar_width
        axes.bar(positions + shift, np.nan_to_num(values), bar_width, label=label)
    labels = [_plain(record.get("id", i)) for i, record in enumerate(clients)]
    axes.set_xticks(positions, labels, rotation=90 if len(clients) > 12 else 0)
    axes.set_ylim(0, 100)
    axes.grid(axis="y", alpha=0.3)
    if present:
        figure.legend(loc="outside right upper")
    return figure


# --- atomic writes ---------------------------------------------------------------------------


def _write_atomic(path: Path, write: Callable[[Any], None], *, text: bool) -> None:
    """Write ``path`` through a temporary sibling file and ``os.replace``."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        mode = "w" if text else "wb"
        with os.fdopen(fd, mode, encoding="utf-8" if text else None) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, _FILE_MODE)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _save_png(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    _write_atomic(path, lambda handle: figure.savefig(handle, format="png", dpi=120), text=False)


# --- entry point -----------------------------------------------------------------------------


def write_report(results: Mapping[str, Any], out_dir: Path) -> Path:
    """Write ``out_dir/report.md`` and its two PNG plots from a simulator results dict.

    Args:
        results: the content of ``results.json``: ``config``, ``algorithm``, ``rounds``,
            ``clients``, ``summary`` (with optional ``metrics``) and optional ``baselines``.
            Missing sections are reported as absent; null accuracies render as "—".
        out_dir: folder for the report; created when missing.

    Returns:
        The path of ``report.md``.

    Raises:
        ReportError: when a section has the wrong type (e.g. ``rounds`` not a list, an accuracy
            that is a string).
        OSError: when ``out_dir`` cannot be written.
    """
    if not isinstance(results, Mapping):
        raise ReportError(f"results must be a dict (results.json); got {type(results).__name__}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = _mapping(results.get("config"), "results['config']")
    rounds = _records(results, "rounds")
    clients = _records(results, "clients")
    summary = _mapping(results.get("summary"), "results['summary']")
    baselines = _mapping(results.get("baselines"), "results['baselines']")
    algorithm = _plain(results.get("algorithm") or "unknown algorithm")

    lines = [f"# Results report: {algorithm}", ""]
    lines += _config_section(config, rounds, clients)
    lines += _summary_section(summary)
    lines += _baselines_section(baselines)
    lines += _rounds_section(rounds)
    lines += _clients_section(clients)
    lines += _details_section(clients)
    lines += _architecture_section(rounds, clients)
    lines += [
        "## Plots",
        "",
        f"![Mean personalized accuracy per round]({ROUND_PLOT_NAME})",
        "",
        f"![Accuracy per client]({CLIENT_PLOT_NAME})",
        "",
    ]
    markdown = "\n".join(lines)

    _save_png(_round_figure(rounds), out_dir / ROUND_PLOT_NAME)
    _save_png(_client_figure(clients), out_dir / CLIENT_PLOT_NAME)
    report_path = out_dir / REPORT_NAME
    _write_atomic(report_path, lambda handle: handle.write(markdown), text=True)
    logger.info("wrote %s with %d rounds and %d clients", report_path, len(rounds), len(clients))
    return report_path
