"""How `gpu_round.py` and `simulate_scale.py` end: the load at the end in the machine record, the
JSON (printed, and written to `--json-out` when given), then the table made from it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def save(out: dict[str, Any], json_out: Path | None) -> str:
    """`out` as the JSON these scripts write, written to `json_out` when given."""
    text = json.dumps(out, indent=1)
    if json_out:
        json_out.write_text(text + "\n")
    return text


def emit(
    out: dict[str, Any], json_out: Path | None, table: Callable[[dict[str, Any]], str]
) -> None:
    out["machine"]["loadavg_end"] = os.getloadavg()
    print(save(out, json_out))
    print(table(out))
