"""The report of a run, built from its ``results.json``: report.md, its PNG plots, report.html.

:func:`write_report` turns the results dict into ``report.md``, the plots next to it and
``report.html``, the same report as one self-contained page (images embedded) that a person can
read without the terminal. Every file is written atomically (a temporary file in the same folder,
then ``os.replace``), so a reader never sees half a report.

Besides what every run records (config, rounds, clients, summary, baselines), optional keys add
sections: ``split`` (each client's samples per class: a label-distribution plot), ``onnx`` (each
client's exported model measured with onnxruntime), ``setup`` (how the run was carried out:
label -> text) and ``collaboration`` (clients × clients weights, e.g. FedeRiCo's w_ij, rows and
columns in the order of ``collaboration_clients`` when given, else of ``clients``; with optional
``collaboration_history``, ``[{"round": r, "matrix": [[...]]}]``: heatmaps of a few rounds).

Modules: `common` (reading and formatting), `sections` (Markdown), `plots` (figures), `html`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from coordinator.report import plots, sections
from coordinator.report.common import ReportError, mapping, plain, records, write_atomic
from coordinator.report.html import render_html

__all__ = [
    "CLIENT_PLOT_NAME",
    "COLLABORATION_PLOT_NAME",
    "HTML_NAME",
    "REPORT_NAME",
    "ROUND_PLOT_NAME",
    "SPLIT_PLOT_NAME",
    "ReportError",
    "write_report",
]

logger = logging.getLogger(__name__)

REPORT_NAME: Final[str] = "report.md"
HTML_NAME: Final[str] = "report.html"
ROUND_PLOT_NAME: Final[str] = "personal_acc_per_round.png"
CLIENT_PLOT_NAME: Final[str] = "client_accuracy.png"
SPLIT_PLOT_NAME: Final[str] = "client_classes.png"
COLLABORATION_PLOT_NAME: Final[str] = "collaboration.png"


def write_report(results: Mapping[str, Any], out_dir: Path) -> Path:
    """Write ``out_dir/report.md``, its PNG plots and ``report.html`` from a results dict.

    Args:
        results: the content of ``results.json``: ``config``, ``algorithm``, ``rounds``,
            ``clients``, ``summary`` (with optional ``metrics``), optional ``baselines``, and the
            optional sections named in the module docs. Missing sections are reported as
            absent; null accuracies render as "—".
        out_dir: folder for the report; created when missing.

    Returns:
        The path of ``report.md``.

    Raises:
        ReportError: when a section has the wrong type (e.g. ``rounds`` not a list, an accuracy
            that is a string, a collaboration matrix of the wrong shape).
        OSError: when ``out_dir`` cannot be written.
    """
    if not isinstance(results, Mapping):
        raise ReportError(f"results must be a dict (results.json); got {type(results).__name__}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = mapping(results.get("config"), "results['config']")
    rounds = records(results, "rounds")
    clients = records(results, "clients")
    summary = mapping(results.get("summary"), "results['summary']")
    baselines = mapping(results.get("baselines"), "results['baselines']")
    split = mapping(results.get("split"), "results['split']")
    setup = mapping(results.get("setup"), "results['setup']")
    onnx = records(results, "onnx")
    algorithm = plain(results.get("algorithm") or "unknown algorithm")
    arch = {plain(c.get("id")): plain(c.get("arch")) for c in clients if c.get("id") is not None}

    # Figures first: a malformed section fails before any file is written.
    figures = {
        CLIENT_PLOT_NAME: plots.client_figure(clients),
        ROUND_PLOT_NAME: plots.round_figure(rounds, baselines),
    }
    if split:
        figures[SPLIT_PLOT_NAME] = plots.split_figure(split, arch)
    if results.get("collaboration") is not None:
        # The matrix's own row/column order when given, else the clients' order.
        named = results.get("collaboration_clients")
        if named is not None and not isinstance(named, list):
            raise ReportError("results['collaboration_clients'] must be a list of client ids")
        ids = (
            [plain(x) for x in named]
            if named is not None
            else [plain(c.get("id", i)) for i, c in enumerate(clients)]
        )
        panels = plots.collaboration_matrices(results, len(ids))
        figures[COLLABORATION_PLOT_NAME] = plots.collaboration_figure(panels, ids)

    lines = [f"# Results report: {algorithm}", ""]
    lines += sections.overview_section(results, clients)
    lines += sections.setup_section(setup)
    lines += sections.clients_section(clients)
    lines += [f"![Accuracy per client]({CLIENT_PLOT_NAME})", ""]
    lines += sections.metrics_section(summary)
    lines += ["## Accuracy per round", "", f"![Accuracy per round]({ROUND_PLOT_NAME})", ""]
    if split:
        lines += sections.split_section(split, arch)
        lines += [f"![Training samples per class, per client]({SPLIT_PLOT_NAME})", ""]
    lines += sections.onnx_section(
        onnx, plain(results["onnx_note"]) if "onnx_note" in results else None
    )
    if COLLABORATION_PLOT_NAME in figures:
        lines += sections.collaboration_section(COLLABORATION_PLOT_NAME)
    lines += sections.summary_section(summary)
    lines += sections.baselines_section(baselines)
    lines += sections.rounds_section(rounds)
    lines += sections.details_section(clients)
    lines += sections.architecture_section(rounds, clients)
    lines += sections.config_section(config, rounds, clients)
    markdown = "\n".join(lines)

    for name, figure in figures.items():
        plots.save_png(figure, out_dir / name)
    report_path = out_dir / REPORT_NAME
    write_atomic(report_path, lambda handle: handle.write(markdown), text=True)
    page = render_html(markdown, out_dir, f"edgefl report: {algorithm}")
    write_atomic(out_dir / HTML_NAME, lambda handle: handle.write(page), text=True)
    logger.info("wrote %s with %d rounds and %d clients", report_path, len(rounds), len(clients))
    return report_path
