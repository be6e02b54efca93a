"""What every part of the report shares: reading the results dict, formatting cells, atomic writes.

Reading is strict: a section of the wrong type raises `ReportError` naming where it is (e.g.
``results['clients'][0]['personal_acc'] must be a number or null``), so a malformed results.json
never turns into a report that silently shows something else.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "MISSING",
    "ReportError",
    "cell",
    "find_config_value",
    "is_number",
    "mapping",
    "metric_value",
    "number",
    "pct",
    "plain",
    "pp",
    "records",
    "table",
    "write_atomic",
]

MISSING: Final[str] = "—"
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


class ReportError(ValueError):
    """The results dict does not have the shape the simulator writes."""


# --- reading the results ---------------------------------------------------------------------


def records(results: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
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


def mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReportError(f"{where} must be an object; got {type(value).__name__}")
    return value


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def number(record: Mapping[str, Any], key: str, where: str) -> float | None:
    """A numeric field as float, None when absent or null; ReportError when not a number."""
    value = record.get(key)
    if value is None:
        return None
    if not is_number(value):
        raise ReportError(f"{where}[{key!r}] must be a number or null; got {value!r}")
    return float(value)


def find_config_value(config: Mapping[str, Any], keys: Sequence[str], depth: int) -> Any:
    """The first of `keys` found in `config`, searching nested sections `depth` levels deep."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if depth <= 0:
        return None
    for value in config.values():
        if isinstance(value, Mapping):
            found = find_config_value(value, keys, depth - 1)
            if found is not None:
                return found
    return None


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
    if not is_number(value):
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


# --- atomic writes ---------------------------------------------------------------------------


def write_atomic(path: Path, write: Callable[[Any], None], *, text: bool) -> None:
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
