"""The report of a run, built from its typed results: report.md, its PNG plots, report.html.

:func:`write_report` turns a `Results` (what `build_results` makes, or `Results.read` of a
results.json) into ``report.md``, the plots next to it and ``report.html``, the same report as
one self-contained page (images embedded) that a person can read without the terminal. Every
file is written atomically (`model_zoo.files`), so a reader never sees half a report.

Besides what every run records (config, rounds, clients, summary, baselines), optional parts add
sections: ``device`` (where it trained and why), ``split`` (each client's samples per class: a
label-distribution plot), ``onnx`` (each client's exported model measured with onnxruntime),
``setup`` (how the run was carried out: label -> text) and ``collaboration`` (clients × clients
weights, e.g. FedeRiCo's w_ij, rows and columns in the order of ``collaboration_clients`` when
given, else of ``clients``; with ``collaboration_history``: heatmaps of a few rounds).

Modules: `common` (formatting), `comparison` and `sections` (Markdown), `plots` (figures),
`html`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from coordinator.report import comparison, plots, sections
from coordinator.report.common import ReportError
from coordinator.report.html import render_html
from coordinator.results_model import Results
from model_zoo.files import write_atomic

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


def write_report(results: Results, out_dir: Path) -> Path:
    """Write ``out_dir/report.md``, its PNG plots and ``report.html`` from the results.

    Args:
        results: the run's typed results (`coordinator.results_model.Results`; a results.json
            file becomes one with `Results.read`). Absent parts are reported as absent; null
            accuracies render as "—".
        out_dir: folder for the report; created when missing.

    Returns:
        The path of ``report.md``.

    Raises:
        TypeError: when `results` is not a `Results` (validate a dict with `Results.parse`).
        OSError: when ``out_dir`` cannot be written.
    """
    if not isinstance(results, Results):
        raise TypeError(
            f"write_report takes a Results (Results.parse(dict), Results.read(path)); got "
            f"{type(results).__name__}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = {c.id: c.arch for c in results.clients if c.arch}

    figures = {
        CLIENT_PLOT_NAME: plots.client_figure(results.clients),
        ROUND_PLOT_NAME: plots.round_figure(results.rounds, results.baselines),
    }
    if results.split is not None and results.split.clients:
        figures[SPLIT_PLOT_NAME] = plots.split_figure(results.split, arch)
    if results.collaboration is not None:
        # The matrix's own row/column order when given, else the clients' order.
        ids = results.collaboration_clients or [c.id for c in results.clients]
        panels = plots.collaboration_matrices(results)
        figures[COLLABORATION_PLOT_NAME] = plots.collaboration_figure(panels, ids)

    lines = [f"# Results report: {results.algorithm}", ""]
    lines += comparison.overview_section(results)
    lines += sections.setup_section(results.setup)
    lines += comparison.clients_section(results)
    lines += [f"![Accuracy per client]({CLIENT_PLOT_NAME})", ""]
    lines += sections.metrics_section(results.summary)
    lines += ["## Accuracy per round", "", f"![Accuracy per round]({ROUND_PLOT_NAME})", ""]
    if SPLIT_PLOT_NAME in figures:
        lines += sections.split_section(results.split, arch, results.population is not None)
        lines += [f"![Training samples per class, per client]({SPLIT_PLOT_NAME})", ""]
    lines += sections.onnx_section(results.onnx, results.onnx_note)
    if COLLABORATION_PLOT_NAME in figures:
        assert results.collaboration is not None
        lines += sections.collaboration_section(COLLABORATION_PLOT_NAME, results.collaboration)
    lines += sections.summary_section(results.summary, results.algorithm)
    lines += sections.baselines_section(results.baselines)
    lines += sections.rounds_section(results.rounds)
    lines += sections.details_section(results.clients)
    lines += sections.architecture_section(results.rounds, results.clients)
    lines += sections.config_section(results)
    markdown = "\n".join(lines)

    for name, figure in figures.items():
        plots.save_png(figure, out_dir / name)
    report_path = write_atomic(out_dir / REPORT_NAME, markdown)
    page = render_html(markdown, out_dir, f"edgefl report: {results.algorithm}")
    write_atomic(out_dir / HTML_NAME, page)
    logger.info(
        "wrote %s with %d rounds and %d clients",
        report_path,
        len(results.rounds),
        len(results.clients),
    )
    return report_path
