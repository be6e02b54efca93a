"""What every part of the report shares: formatting cells, numbers and tables.

The report reads a typed `Results` (validated when it was built or read from results.json), so
nothing here checks types; `ReportError` is for what only the report can find wrong (an image
that is not where the Markdown says).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from coordinator.results_model import ResultsError

__all__ = [
    "MISSING",
    "ReportError",
    "cell",
    "metric_value",
    "pct",
    "plain",
    "pp",
    "table",
]

MISSING: Final[str] = "—"
_MAX_CELL_CHARS: Final[int] = 120

_UNITS: Final[dict[str, str]] = {
    "PUI": "%",
    "PUD": "%",
    "MPI": "pp",
    "API": "pp",
    "MPD": "pp",
    "APD": "pp",
    "AV": "pp²",
}


class ReportError(ResultsError):
    """The results cannot be turned into a report (a malformed part the report needs)."""


# --- formatting ------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Make ``text`` safe inside a Markdown table cell."""
    text = " ".join(text.split()).replace("|", "\\|")
    if len(text) > _MAX_CELL_CHARS:
        text = text[: _MAX_CELL_CHARS - 1] + "…"
    return text


def pct(value: float | None) -> str:
    """An accuracy fraction as a percentage with 2 decimals."""
    return MISSING if value is None else f"{value * 100:.2f}%"


def pp(value: float | None) -> str:
    """A difference of fractions as signed percentage points."""
    return MISSING if value is None else f"{value * 100:+.2f} pp"


def plain(value: Any) -> str:
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


def metric_value(key: str, value: Any) -> str:
    """A PersFL metric in its unit: % of clients, pp of QoI, pp², or a plain ratio."""
    if value is None:
        return MISSING
    if isinstance(value, bool) or not isinstance(value, int | float):
        return plain(value)
    unit = _UNITS.get(key)
    if unit == "%":
        return f"{value:.2f}%"
    if unit == "pp":
        return f"{value:+.2f} pp"
    if unit == "pp²":
        return f"{value:.2f} pp²"
    return f"{value:.4f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)
    return lines
