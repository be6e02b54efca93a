"""What every benchmark here writes of the machine it ran on, and how most of them end: the load at
the end in that record, the JSON (printed, and written to `--json-out` when given), then the table
made from it."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_sdk.host import cpu_name


def machine(**extra: Any) -> dict[str, Any]:
    """The machine record of a benchmark's JSON: the software, the CPU, the cores this process may
    use and the load average when it starts (what else loads a shared machine weighs on absolute
    times), then `extra`. `emit` or `ended` adds the load at the end."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "platform": platform.platform(),
        "processor": cpu_name(),
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "loadavg_start": os.getloadavg(),
    }
    return info | extra


def ended(out: dict[str, Any]) -> None:
    """The load average at the end, beside the one at the start in `out`'s machine record."""
    out["machine"]["loadavg_end"] = os.getloadavg()


def save(out: dict[str, Any], json_out: Path | None) -> str:
    """`out` as the JSON these scripts write, written to `json_out` when given."""
    text = json.dumps(out, indent=1)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
    return text


def emit(
    out: dict[str, Any], json_out: Path | None, table: Callable[[dict[str, Any]], str]
) -> None:
    ended(out)
    print(save(out, json_out))
    print(table(out))


def labelled_folders(
    parser: argparse.ArgumentParser, flag: str, given: list[str]
) -> dict[str, Path]:
    """The LABEL=DIR values of a repeatable `flag` (the sides a start-up benchmark measures side
    by side), each DIR an existing folder, resolved; otherwise the parser's usage error."""
    folders = {}
    for value in given:
        label, _, folder = value.partition("=")
        if not (label and folder and Path(folder).is_dir()):
            parser.error(f"{flag} takes LABEL=DIR with DIR an existing folder, got {value!r}")
        folders[label] = Path(folder).resolve()
    return folders
