"""tools/check_demo_figures.py: the demo's figures quoted in the docs against a demo's
results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests_helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent
checker = load_tool("check_demo_figures")

# Two clients: (id, arch, personalized, local, FedAvg, FedAvg+FT, deployed arch, ONNX bytes)
CLIENTS = [
    ("c0", "mlr", 0.753, 0.687, 0.446, 0.48, "mlr", 32 * 1024 + 100),
    ("c1", "lstm", 0.885, 0.753, 0.0, 0.656, "lstm", 99 * 1024),
]
# The three layouts the docs quote them in (README, docs/index.md, the console's)
DOC = """\
| client | architecture | personalized | local only | FedAvg | FedAvg+FT | deployed model (ONNX) |
|---|---|---|---|---|---|---|
| c0 | mlr | 75.3% | 68.7% | 44.6% | 48.0% | mlr, its own, 32 KiB |
| c1 | lstm | 88.5% | 75.3% | 0.0% | 65.6% | lstm (its own), 99 KiB |
| **mean** | | **81.9%** | 72.0% | 22.3% | 56.8% | |

c1      lstm            88.5%   75.3%     0.0%       65.6%   lstm, 99 KiB, 0.070 ms (+13.3 vs local)
mean over clients: personalized 81.9%, local 72.0%, FedAvg global model 22.3%, FedAvg+FT 56.8%
"""


def _demo_out(tmp_path: Path, clients=CLIENTS) -> Path:
    doc = {
        "algorithm": "fml",
        "clients": [
            {
                "id": c,
                "arch": a,
                "personal_acc": p,
                "local_acc": lo,
                "fedavg_acc": f,
                "fedavg_ft_acc": ft,
            }
            for c, a, p, lo, f, ft, _, _ in clients
        ],
        "onnx": [{"client": c, "arch": d, "size_bytes": b} for c, *_, d, b in clients],
    }
    out = tmp_path / "demo"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(doc))
    return out


def test_figures_that_agree_with_the_demo_pass(tmp_path, capsys):
    # Prepare: a demo's results and a document quoting them in every layout
    out = _demo_out(tmp_path)
    (tmp_path / "doc.md").write_text(DOC)

    # Execute
    code = checker.main([str(out), str(tmp_path / "doc.md")])

    # Assert: every client row and means line read (5), none differs
    assert code == 0
    assert "5 lines of figures, 0 differ" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        (
            ("c0", "mlr", 0.753, 0.701, 0.446, 0.48, "mlr", 33 * 1024),
            [
                "c0 local_acc 68.7%, the demo gives 70.1%",
                "mean local_acc 72.0%, the demo gives 72.7%",
                "c0 deployed mlr, 32 KiB; the demo's: mlr, 33 KiB",
            ],
        ),
        (
            ("c0", "mlp", 0.753, 0.687, 0.446, 0.48, "mlr+lenet5", 32 * 1024),
            ["c0 is a mlp, not a mlr", "c0 deployed mlr, 32 KiB; the demo's: mlr+lenet5, 32 KiB"],
        ),
    ],
    ids=["figures", "architectures"],
)
def test_a_figure_the_demo_no_longer_gives_is_named_with_its_line(tmp_path, capsys, changed, said):
    # Prepare: the demo now gives other figures for c0
    out = _demo_out(tmp_path, [changed, CLIENTS[1]])
    (tmp_path / "doc.md").write_text(DOC)

    # Execute
    code = checker.main([str(out), str(tmp_path / "doc.md")])

    # Assert: it fails, naming each figure (and the line of its table)
    printed = capsys.readouterr().out
    assert code == 1
    for text in said:
        assert text in printed
    assert f"{tmp_path / 'doc.md'}:3: c0" in printed


def test_a_document_that_quotes_no_figure_fails(tmp_path, capsys):
    out = _demo_out(tmp_path)
    (tmp_path / "doc.md").write_text("the demo's table moved elsewhere\n")

    assert checker.main([str(out), str(tmp_path / "doc.md")]) == 1
    assert "quotes none of the demo's figures" in capsys.readouterr().out


def test_the_docs_quote_every_client_of_the_demo(tmp_path, capsys):
    # The layouts of the real docs are read: the README and the front page quote all six
    # clients and the means, the tutorial some rows and the means (figures not compared here:
    # `make check-demo-figures` runs the demo for that)
    found = {}
    for doc in checker.DOCS:
        rows = [line for line in (ROOT / doc).read_text().splitlines() if checker._ROW.match(line)]
        ids = {
            checker._ROW.match(line).group(1)
            for line in rows
            if len(checker._PERCENT.findall(line)) >= 4
        }
        found[doc] = ids
    assert found["README.md"] == found["docs/index.md"] == {f"c{i}" for i in range(6)}
    assert found["docs/tutorials/first-simulation.md"] <= found["README.md"]
    assert found["docs/tutorials/first-simulation.md"]
