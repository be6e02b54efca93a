"""What a fresh process pays to import the modules an edgefl process needs, one by one.

Each module is imported in a process of its own (its wall time from `import` to done, what it
imports first included), several times; the table gives the medians. Give packages to put
ahead of the environment's, to measure another release side by side with it: the runs
alternate between them, so that a machine's load weighs on each alike.

    python benchmarks/import_cost.py                                  # this environment
    pip install --no-deps --target /tmp/ml_dtypes-0.7.0 ml_dtypes==0.7.0
    python benchmarks/import_cost.py --ahead 'ml_dtypes 0.7.0=/tmp/ml_dtypes-0.7.0' --repeat 5

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, labelled_folders, machine

ROOT = Path(__file__).resolve().parents[1]
# numpy's number types, onnx (which imports ml_dtypes), torch, what a client that exports
# imports, and the CLI.
MODULES = ("numpy", "ml_dtypes", "onnx", "torch", "edge_sdk.export", "coordinator.cli")
TIMED = "import time, importlib, sys; t = time.perf_counter(); m = importlib.import_module({!r}); "
TIMED += (
    "print(time.perf_counter() - t, getattr(sys.modules[{!r}.split('.')[0]], '__version__', ''))"
)


def import_once(module: str, ahead: str | None) -> tuple[float, str]:
    """Seconds to import `module` in a fresh process, with `ahead` first on its path; and the
    version of its top package."""
    path = [p for p in (ahead, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    out = subprocess.run(
        [sys.executable, "-c", TIMED.format(module, module)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), out[1] if len(out) > 1 else ""


def measure(aheads: dict[str, str | None], repeat: int) -> dict[str, Any]:
    start = machine()
    seconds: dict[str, dict[str, list[float]]] = {a: {m: [] for m in MODULES} for a in aheads}
    versions: dict[str, dict[str, str]] = {a: {} for a in aheads}
    for _ in range(repeat):
        for module in MODULES:
            for label, ahead in aheads.items():  # alternating: the load weighs on each alike
                s, version = import_once(module, ahead)
                seconds[label][module].append(s)
                versions[label][module.split(".")[0]] = version
    return {
        "machine": start,
        "repeat": repeat,
        "ahead": aheads,
        "versions": versions,
        "results": {
            label: {m: {"median_s": statistics.median(v), "min_s": min(v)} for m, v in per.items()}
            for label, per in seconds.items()
        },
    }


def table(out: dict[str, Any]) -> str:
    labels = list(out["results"])
    rows = [f"{'import':<18}" + "".join(f"{label + ' s':>22}" for label in labels)]
    for module in MODULES:
        rows.append(
            f"{module:<18}"
            + "".join(f"{out['results'][label][module]['median_s']:>22.3f}" for label in labels)
        )
    load = out["machine"]
    rows.append(f"load average {load['loadavg_start'][0]:.1f} -> {load['loadavg_end'][0]:.1f}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ahead",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="packages to import before the environment's (repeatable); measured beside it",
    )
    parser.add_argument("--repeat", type=int, default=3, help="imports of each module per side")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    aheads: dict[str, str | None] = {"this environment": None}
    aheads |= {k: str(v) for k, v in labelled_folders(parser, "--ahead", args.ahead).items()}
    emit(measure(aheads, args.repeat), args.json_out, table)


if __name__ == "__main__":
    main()
