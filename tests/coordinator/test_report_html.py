"""report.html (one self-contained page) and the report's sections for a person: the verdict per
client, the label distribution, the ONNX table and the collaboration heatmap."""

from __future__ import annotations

import copy
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chromium import chromium_path, load_page

from coordinator.metrics import personalization_metrics
from coordinator.report import (
    CLIENT_PLOT_NAME,
    COLLABORATION_PLOT_NAME,
    HTML_NAME,
    REPORT_NAME,
    ROUND_PLOT_NAME,
    SPLIT_PLOT_NAME,
    write_report,
)
from coordinator.report.plots import collaboration_figure, collaboration_matrices
from coordinator.results_model import Results, ResultsError

# Client c1 loses to local training: the report must say so.
P, L, G = [0.90, 0.70, 0.85], [0.80, 0.75, 0.85], [0.40, 0.50, 0.30]
WEIGHTS = [[0.7, 0.3, 0.0], [0.2, 0.8, 0.0], [0.05, 0.05, 0.9]]


def _results() -> dict[str, Any]:
    ids = ["c0", "c1", "c2"]
    return {
        "algorithm": "federico",
        "config": {"algorithm": "federico", "data": {"dataset": "fashion_mnist"}},
        "rounds": [
            {
                "round": r,
                "seconds": 1.0,
                "mean_personal_acc": 0.5 + 0.1 * r,
                "global_acc": None,
                "client_acc": {cid: 0.4 + 0.1 * r + 0.01 * i for i, cid in enumerate(ids)},
            }
            for r in (1, 2, 3)
        ],
        "clients": [
            {
                "id": cid,
                "arch": arch,
                "n_train": 100,
                "personal_acc": P[i],
                "global_acc": None,
                "local_acc": L[i],
                "fedavg_acc": G[i],
            }
            for i, (cid, arch) in enumerate(zip(ids, ["mlr", "lenet5", "lstm"], strict=True))
        ],
        "summary": {"mean_personal_acc": sum(P) / 3, "metrics": personalization_metrics(P, G, L)},
        "baselines": {
            "local": {"summary": {"mean_personal_acc": sum(L) / 3}},
            "fedavg": {"summary": {"mean_personal_acc": sum(G) / 3}},
        },
        "split": {
            "classes": ["T-shirt", "Trouser", "Bag"],
            "description": "label_groups: 2 groups",
            "clients": [
                {"id": "c0", "n_train": 100, "n_val": 25, "n_test": 125, "counts": [60, 40, 0]},
                {"id": "c1", "n_train": 100, "n_val": 25, "n_test": 125, "counts": [50, 50, 0]},
                {"id": "c2", "n_train": 100, "n_val": 25, "n_test": 125, "counts": [0, 0, 100]},
            ],
        },
        "onnx": [
            {
                "client": cid,
                "arch": "mlr",
                "size_bytes": 32768,
                "latency_p50_ms": 0.0125,
                "latency_p99_ms": 0.05,
                "throughput": 120000.0,
                "accuracy": P[i],
                "personal_acc": P[i],
            }
            for i, cid in enumerate(ids)
        ],
        "setup": {"Broker": "mqtt://127.0.0.1:1883 (mosquitto)"},
        "collaboration": WEIGHTS,
        "collaboration_clients": ids,
        "collaboration_history": [
            {"round": r, "matrix": m}
            for r, m in enumerate([np.eye(3).tolist(), [[0.5, 0.5, 0.0]] * 3, WEIGHTS], start=1)
        ],
    }


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.srcs.append(a.get("src") or "")
        for key in ("href", "src"):
            if tag != "img" and a.get(key):
                self.links.append(a[key] or "")


def test_report_html_is_one_page_with_every_plot_embedded(tmp_path: Path) -> None:
    write_report(Results.parse(_results()), tmp_path)

    page = (tmp_path / HTML_NAME).read_text()
    parser = _Images()
    parser.feed(page)
    plots = [CLIENT_PLOT_NAME, ROUND_PLOT_NAME, SPLIT_PLOT_NAME, COLLABORATION_PLOT_NAME]
    assert len(parser.srcs) == len(plots)
    assert all(src.startswith("data:image/png;base64,") for src in parser.srcs)
    assert all(link.startswith("data:") for link in parser.links)  # nothing to fetch
    markdown = (tmp_path / REPORT_NAME).read_text()
    assert [f"]({name})" in markdown for name in plots] == [True] * 4
    assert "<script" not in page


def test_report_html_escapes_markup_from_the_results(tmp_path: Path) -> None:
    results = _results()
    results["clients"][0]["id"] = "<img src=x onerror=alert(1)>"
    write_report(Results.parse(results), tmp_path)
    assert "<img src=x" not in (tmp_path / HTML_NAME).read_text()


@pytest.mark.skipif(
    chromium_path() is None,
    reason="chromium is not installed (make test installs it as root: apt-get install chromium)",
)
def test_report_html_loads_in_headless_chromium_and_shows_its_images(tmp_path: Path) -> None:
    write_report(Results.parse(_results()), tmp_path)

    page = load_page(tmp_path / HTML_NAME)

    assert page["console_errors"] == [] and page["exceptions"] == []
    assert page["failed_requests"] == []
    assert page["title"] == "edgefl report: federico"
    assert len(page["images"]) == 4
    assert all(img["complete"] and img["w"] > 0 and img["h"] > 0 for img in page["images"])


def test_report_says_for_which_client_personalization_lost(tmp_path: Path) -> None:
    text = write_report(Results.parse(_results()), tmp_path).read_text()

    assert (
        "beat training alone on **1 of 3** clients and **lost on 1** (c1 -5.00 pp); 1 tied" in text
    )
    assert (
        "| c1 | lenet5 | 100 | 70.00% | 75.00% | 50.00% | "
        "**worse than the best baseline** (local, -5.00 pp) |" in text
    )
    assert (
        "| c0 | mlr | 100 | 90.00% | 80.00% | 40.00% | "
        "better than the best baseline (local, +10.00 pp) |" in text
    )
    assert (
        "| c2 | lstm | 100 | 85.00% | 85.00% | 30.00% | same as the best baseline (local) |" in text
    )
    assert (
        "Against each client's best baseline (the best of local, FedAvg and FedAvg+FT that ran "
        "for it), personalization won on **1 of 3** clients and **lost on 1** "
        "(c1 -5.00 pp vs local); 1 tied." in text
    )
    assert "| local-only training (baseline) | 80.00% |" in text


def test_report_lists_each_clients_classes_and_onnx_model(tmp_path: Path) -> None:
    text = write_report(Results.parse(_results()), tmp_path).read_text()

    assert "| c0 | mlr | 100 / 25 / 125 | 2 | T-shirt (60), Trouser (40) |" in text
    assert "| c2 | lstm | 100 / 25 / 125 | 1 | Bag (100) |" in text
    assert "| c1 | mlr | 32.0 KiB | 0.013 ms | 0.050 ms | 120,000/s | 70.00% | 70.00% |" in text
    assert "| Broker | mqtt://127.0.0.1:1883 (mosquitto) |" in text


def test_collaboration_heatmap_shows_row_i_as_client_is_weights() -> None:
    results = Results.parse(_results())

    panels = collaboration_matrices(results)
    figure = collaboration_figure(panels, ["c0", "c1", "c2"])

    # The history's rounds then nothing more: its last matrix is the final one.
    assert [title for title, _ in panels] == ["round 1", "round 2", "round 3"]
    drawn = figure.axes[2].images[0].get_array()
    np.testing.assert_array_equal(np.asarray(drawn), np.array(WEIGHTS))
    assert [t.get_text() for t in figure.axes[2].get_yticklabels()] == ["c0", "c1", "c2"]
    cell = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
        for t in figure.axes[2].texts
    }
    assert cell[(1, 0)] == "0.20"  # c1 gives c0's model 0.2


def test_collaboration_without_history_is_one_heatmap_and_absent_without_a_matrix(
    tmp_path: Path,
) -> None:
    results = _results()
    del results["collaboration_history"]
    assert [t for t, _ in collaboration_matrices(Results.parse(results))] == ["final"]

    del results["collaboration"]
    text = write_report(Results.parse(results), tmp_path).read_text()
    assert "## Collaboration" not in text and not (tmp_path / COLLABORATION_PLOT_NAME).exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"collaboration": [[1.0, 0.0], [0.0, 1.0]]}, r"must be 3×3 \(clients × clients\)"),
        ({"collaboration": [["a", "b", "c"]] * 3}, "Input should be a valid number"),
        ({"collaboration_history": [{"round": 1, "matrix": [[1.0]]}]}, r"\(round 1\) must be 3×3"),
        ({"collaboration_clients": ["c0", "c1"]}, "must be 2×2"),
        ({"collaboration_clients": "c0"}, "Input should be a valid list"),
    ],
)
def test_a_malformed_collaboration_matrix_is_refused_before_writing(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    results = copy.deepcopy(_results()) | change
    with pytest.raises(ResultsError, match=message):
        write_report(Results.parse(results), tmp_path)
    assert not (tmp_path / REPORT_NAME).exists()


def test_round_plot_draws_one_line_per_client_and_the_baselines() -> None:
    from coordinator.report.plots import round_figure

    results = Results.parse(_results())
    figure = round_figure(results.rounds, results.baselines)
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    assert labels[:3] == ["c0", "c1", "c2"]
    assert {"mean personalized", "local only (final mean)", "FedAvg (final mean)"} <= set(labels)
    c1 = figure.axes[0].get_lines()[1].get_ydata()
    np.testing.assert_allclose(c1, [51.0, 61.0, 71.0])
    assert re.match(r"^Accuracy per round$", figure.axes[0].get_title())


def test_collaboration_says_what_its_diagonal_is_and_why_it_is_often_zero(tmp_path: Path) -> None:
    # Before, a FedeRiCo heatmap whose diagonal was all zeros came with no word on why.
    results = _results()
    results["collaboration"] = [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    del results["collaboration_history"]

    text = write_report(Results.parse(results), tmp_path).read_text()

    section = text.split("## Collaboration")[1].split("\n## ")[0]
    assert "The diagonal, w_ii, is a client's weight on its own model" in section
    assert "Here the final diagonal is 0 for 1 of 3 clients." in section
    figure = collaboration_figure(
        collaboration_matrices(Results.parse(results)), ["c0", "c1", "c2"]
    )
    assert len(figure.axes[0].patches) == 3  # the diagonal's cells are outlined


def test_plots_of_many_clients_show_their_spread_not_a_line_and_a_legend_entry_each() -> None:
    # 100 clients (in round r, client i scores i % 50 + 20 r percent; finally 99 - i): the
    # round plot shades the 10th-90th percentile of each round; the client plot draws one
    # curve per series over the clients sorted by it. Before: 100 lines, 100 legend entries.
    from coordinator.report.plots import client_figure, round_figure

    results = _results()
    ids = [f"d{i}" for i in range(100)]
    for r, entry in enumerate(results["rounds"]):
        entry["client_acc"] = {cid: (i % 50 + 20 * r) / 100 for i, cid in enumerate(ids)}
    results["clients"] = [
        {**results["clients"][0], "id": cid, "personal_acc": (99 - i) / 100}
        for i, cid in enumerate(ids)
    ]
    parsed = Results.parse(results)

    axes = round_figure(parsed.rounds, parsed.baselines).axes[0]
    labels = [line.get_label() for line in axes.get_lines()]
    assert not set(labels) & set(ids)
    (band,) = axes.collections
    assert band.get_label() == "100 clients, 10th-90th percentile"
    spread = [i % 50 for i in range(100)]
    low, high = np.percentile(spread, 10), np.percentile(spread, 90)
    ys = band.get_paths()[0].vertices[:, 1]
    assert np.isclose(ys.min(), low) and np.isclose(
        ys.max(), high + 20 * (len(results["rounds"]) - 1)
    )

    axes = client_figure(parsed.clients).axes[0]
    curves = {line.get_label(): line.get_ydata() for line in axes.get_lines()}
    np.testing.assert_allclose(curves["personalized"], np.arange(100))
    assert not axes.patches  # no bars
