"""Whether the demo's figures that the docs quote are the ones `edgefl demo` gives today.

    make check-demo-figures          # runs the demo, then this on its output
    .venv/bin/python tools/check_demo_figures.py [runs/demo] [DOC ...]

The README, docs/index.md and docs/tutorials/first-simulation.md quote the demo's table: each
client's architecture, its accuracies (personalized, local, FedAvg, FedAvg+FT), the model it
deployed and that model's size, and the means over clients. A change to a default moves them
without any test failing (it happened once: the README said 84.3% a week after the demo gave
86.0%). This reads the demo's `results.json` and prints every quoted figure that differs from
it, naming the file and line; it exits 1 when one does, or when a document quotes none (its
table's layout changed, and this no longer reads it), and 0 when all agree.

A client's row is a line that starts (after `|`, `*` or spaces) with its id and architecture
(`| c0 | mlr | 75.3% | ...`, or the console's `c0      mlr    75.3% ...`); its accuracies are
the first four percentages on it, the deployed model the `ARCH, N KiB` (or `ARCH (its own),
N KiB`) on it. A means line is a table's row `mean`, or the console's `mean over clients:`,
with four percentages.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.results_model import Results  # noqa: E402

DOCS = ("README.md", "docs/index.md", "docs/tutorials/first-simulation.md")
FIELDS = ("personal_acc", "local_acc", "fedavg_acc", "fedavg_ft_acc")
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)%")
_MODEL = re.compile(r"([a-z0-9_+]+)(?:, its own| \(its own\))?, (\d+) KiB")
_ROW = re.compile(r"^[\s|*]*(c\d+)[\s|*]+([a-z0-9_]+)\b")
# The means: a table's row (`| **mean** | | 86.0% ...`), or the demo's console line (a
# simulation's, `mean over clients (final): ...`, is not the demo's)
_MEANS = re.compile(r"^\|[\s*]*mean[\s*]*\||^mean over clients: ")


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def expected(results: Results) -> tuple[dict[str, tuple[str, list[str], str, int]], list[str]]:
    """Per client: (architecture, its four accuracies as the docs print them, the deployed
    model's architecture, its size in KiB); and the four means."""
    onnx = {r.client: r for r in results.onnx or []}
    rows = {}
    for c in results.clients:
        o = onnx.get(c.id)
        model = (o.arch, round((o.size_bytes or 0) / 1024)) if o else ("—", 0)
        rows[c.id] = (c.arch or "—", [_pct(getattr(c, f)) for f in FIELDS], *model)
    return rows, [_pct(results.client_mean(f)) for f in FIELDS]


def check(doc: Path, results: Results) -> tuple[int, list[str]]:
    """The figures `doc` quotes (a count) and those that differ from `results` (messages)."""
    rows, means = expected(results)
    found, wrong = 0, []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        where = f"{doc}:{n}"
        percents = _PERCENT.findall(line)[:4]
        row = _ROW.match(line)
        if row and row.group(1) in rows and len(percents) == 4:
            cid, arch = row.groups()
            want_arch, accs, model, kib = rows[cid]
            found += 1
            if arch != want_arch:
                wrong.append(f"{where}: {cid} is a {want_arch}, not a {arch}")
            for field, got, want in zip(FIELDS, percents, accs, strict=True):
                if want == "—" or float(got) != float(want):
                    wrong.append(f"{where}: {cid} {field} {got}%, the demo gives {want}%")
            deployed = _MODEL.search(line)
            if deployed is None:
                wrong.append(f"{where}: {cid}'s row names no deployed model (ARCH, N KiB)")
            elif (deployed.group(1), int(deployed.group(2))) != (model, kib):
                wrong.append(
                    f"{where}: {cid} deployed {deployed.group(1)}, {deployed.group(2)} KiB; "
                    f"the demo's: {model}, {kib} KiB"
                )
        elif _MEANS.match(line) and len(percents) == 4:
            found += 1
            for field, got, want in zip(FIELDS, percents, means, strict=True):
                if want == "—" or float(got) != float(want):
                    wrong.append(f"{where}: mean {field} {got}%, the demo gives {want}%")
    return found, wrong


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "runs" / "demo"
    docs = [Path(d) for d in argv[1:]] or [ROOT / d for d in DOCS]
    path = out / "results.json"
    if not path.is_file():
        print(f"{path} does not exist: run `edgefl demo` (make demo) first", file=sys.stderr)
        return 2
    results = Results.read(path)
    problems = []
    for doc in docs:
        found, wrong = check(doc, results)
        if found == 0:
            wrong = [f"{doc}: quotes none of the demo's figures (has its table's layout changed?)"]
        problems += wrong
        print(f"{doc}: {found} lines of figures, {len(wrong)} differ")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
