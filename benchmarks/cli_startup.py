"""How long `edgefl --help` and every command's `--help` take, and what they import.

Each help runs as a fresh process (`python -m coordinator ... --help`, as the `edgefl` script
does), several times; the table gives the median wall time, the peak RSS and whether torch or
paho were imported (`-X importtime`). Give several sources to measure them side by side: the
runs alternate between them, so that a machine's load weighs on each alike.

    python benchmarks/cli_startup.py                             # this checkout
    git archive COMMIT | tar -x -C /tmp/before                    # another commit's source
    python benchmarks/cli_startup.py --source before=/tmp/before --source after=. --repeat 5

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, labelled_folders, machine

HEAVY = ("torch", "paho")


def run_help(source: Path, args: list[str]) -> dict[str, Any]:
    """One `--help` in a fresh process: wall seconds and peak RSS (MiB)."""
    env = dict(os.environ, PYTHONPATH=str(source))
    cmd = [sys.executable, "-m", "coordinator", *args, "--help"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=source, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {os.waitstatus_to_exitcode(status)}")
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024}


def heavy_imports(source: Path, args: list[str]) -> list[str]:
    """Which of torch and paho the `--help` imports (`-X importtime`, a run apart: the
    timing lines would weigh on the wall time)."""
    env = dict(os.environ, PYTHONPATH=str(source))
    cmd = [sys.executable, "-X", "importtime", "-m", "coordinator", *args, "--help"]
    err = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True).stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if "|" in line}
    return sorted(m for m in HEAVY if m in imported)


def measure(sources: dict[str, Path], repeat: int) -> dict[str, Any]:
    from coordinator.cli import command_paths  # this checkout's commands (loads no torch)

    start = machine()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in sources}
    for _ in range(repeat):
        for args in command_paths():
            for label, path in sources.items():  # alternating: the load weighs on each alike
                runs[label].setdefault(" ".join(["edgefl", *args, "--help"]), []).append(
                    run_help(path, args)
                )
    results = {
        label: {
            name: {
                "median_s": statistics.median(r["seconds"] for r in rs),
                "min_s": min(r["seconds"] for r in rs),
                "max_s": max(r["seconds"] for r in rs),
                "rss_mib": statistics.median(r["rss_mib"] for r in rs),
                "imports": heavy_imports(sources[label], name.split()[1:-1]),
            }
            for name, rs in per.items()
        }
        for label, per in runs.items()
    }
    return {
        "machine": start,
        "repeat": repeat,
        "sources": {label: str(path) for label, path in sources.items()},
        "results": results,
    }


def table(out: dict[str, Any]) -> str:
    labels = list(out["results"])
    rows = [
        f"{'help':<28}"
        + "".join(
            f"{label + ' s':>14}{label + ' MiB':>14}  {label + ' imports':<18}" for label in labels
        )
    ]
    for name in out["results"][labels[0]]:
        cells = ""
        for label in labels:
            r = out["results"][label][name]
            cells += (
                f"{r['median_s']:>14.2f}{r['rss_mib']:>14.0f}  {','.join(r['imports']) or '-':<18}"
            )
        rows.append(f"{name:<28}{cells}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a source tree to measure (repeatable; default: this checkout)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each help per source")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    sources = labelled_folders(parser, "--source", args.source)
    emit(
        measure(sources or {"this": Path(__file__).resolve().parents[1]}, args.repeat),
        args.json_out,
        table,
    )


if __name__ == "__main__":
    main()
