"""How long `export_onnx` takes with each torch exporter: a device's one export after its run,
and the exports after the first in one process (`simulate --export-onnx`, `edgefl export`).

For each exporter and architecture, a fresh process builds the model, then times its first
export (the exporter's own imports and warm-up included, torch's import not) and `--repeat`
more. Every export is verified against PyTorch with onnxruntime, as every export edgefl writes
is. The processes alternate between the exporters, so that a machine's load weighs on each
alike.

    python benchmarks/onnx_export.py                       # mlr, mlp, cnn1, lenet5, lstm
    python benchmarks/onnx_export.py --families lenet5 --rounds 5 --json-out export.json

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, machine

EXPORTERS = ("dynamo", "legacy")
FAMILIES = ("mlr", "mlp", "cnn1", "lenet5", "lstm")
ROOT = Path(__file__).resolve().parents[1]

# One process: its first export, then `repeat` more; prints their seconds as JSON.
_CHILD = """
import json, sys, tempfile, time
from model_zoo import ArchSpec, build
from edge_sdk.export import export_onnx

family, exporter, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3])
spec = ArchSpec(family=family, num_classes=10, input_shape=(1, 28, 28))
model = build(spec, seed=0)
seconds = []
with tempfile.TemporaryDirectory() as tmp:
    for i in range(1 + repeat):
        start = time.perf_counter()
        path = export_onnx(model, spec, f"{tmp}/{i}.onnx", exporter=exporter)
        seconds.append(time.perf_counter() - start)
    size = path.stat().st_size
print(json.dumps({"seconds": seconds, "bytes": size}))
"""


def one_process(family: str, exporter: str, repeat: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", _CHILD, family, exporter, str(repeat)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{family} / {exporter} failed:\n{run.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def measure(families: list[str], rounds: int, repeat: int) -> dict[str, Any]:
    start = machine()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        e: {f: [] for f in families} for e in EXPORTERS
    }
    for _ in range(rounds):
        for family in families:
            for exporter in EXPORTERS:  # alternating: the load weighs on each alike
                runs[exporter][family].append(one_process(family, exporter, repeat))
    results = {
        exporter: {
            family: {
                "first_s": statistics.median(r["seconds"][0] for r in rs),
                "next_s": statistics.median(s for r in rs for s in r["seconds"][1:]),
                "bytes": rs[-1]["bytes"],
            }
            for family, rs in per.items()
        }
        for exporter, per in runs.items()
    }
    return {
        "machine": start,
        "rounds": rounds,
        "repeat": repeat,
        "threads": 1,
        "results": results,
    }


def table(out: dict[str, Any]) -> str:
    dyn, leg = out["results"]["dynamo"], out["results"]["legacy"]
    rows = [
        f"{'model':<8}{'dynamo first s':>16}{'legacy first s':>16}{'dynamo next s':>15}"
        f"{'legacy next s':>15}{'next ratio':>12}"
    ]
    for family in dyn:
        d, g = dyn[family], leg[family]
        rows.append(
            f"{family:<8}{d['first_s']:>16.3f}{g['first_s']:>16.3f}{d['next_s']:>15.3f}"
            f"{g['next_s']:>15.3f}{d['next_s'] / g['next_s']:>11.0f}x"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="processes per exporter and model")
    parser.add_argument("--repeat", type=int, default=3, help="exports after the first, each")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    emit(measure(args.families.split(","), args.rounds, args.repeat), args.json_out, table)


if __name__ == "__main__":
    main()
