"""Stacked training against client by client, on a quiet machine and beside a competing load.

A simulation on the CPU trains the clients of one group as one stacked model (`cohort = true`)
or one by one (`cohort = false`). Issue 48 measured stacking losing 3-4x under a competing load.
Each workload here runs as `edgefl simulate` in a child process, in both modes, quiet and with
`--burn` processes spinning on every core meanwhile (a second program on the machine), from
this checkout and, with `--baseline DIR`, from another checkout side by side (the same commands
run with DIR as the working directory, so that its packages are imported).

A try's time is its rounds after the first (results.json's per-round `seconds`: the first holds
one-off costs). Each configuration runs `--repeat` times, interleaved; the median is reported,
with the spread. The machine's load before and after is in the JSON.

    python benchmarks/stacking_contention.py                          # ~6 min on 2 cores
    python benchmarks/stacking_contention.py --baseline /tmp/old --repeat 3 \
        --json-out benchmarks/results/stacking_contention.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import emit

ROOT = Path(__file__).resolve().parents[1]
FMNIST = "/usr/share/datasets/fashion-mnist"
# name: flags of `edgefl simulate`
WORKLOADS = {
    # the case issue 48 measured: unequal clients of one architecture
    "fedavg-lenet5-dir10": "--algorithm fedavg --models lenet5 --clients 10 --partition dirichlet "
    "--max-samples 3000 --local-epochs 2",
    # examples/fml_fashion_mnist.toml's kind: three architectures, mutual learning
    "fml-mixed-12": "--algorithm fml --models mlr,mlp,lenet5 --global-model lenet5 --clients 12 "
    "--partition dirichlet --max-samples 3000 --local-epochs 1",
}
MODES = {"stacked": "true", "client_by_client": "false"}


def _spin() -> None:
    x = 0
    while True:
        x += 1


def _run(tree: Path, flags: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="edgefl-contend-") as out:
        cmd = [sys.executable, "-m", "coordinator", "simulate", *flags.split()]
        cmd += ["--dataset", "fashion_mnist", "--data-root", args.data_root]
        cmd += ["--rounds", str(args.rounds), "--baselines", "", "--seed", "1"]
        cmd += ["--out", out, "--set", f"cohort={MODES[mode]}", "-q"]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, timeout=1800)
        results = json.loads((Path(out) / "results.json").read_text())
    rounds = [r["seconds"] for r in results["rounds"]]
    return {
        "seconds": round(sum(rounds[1:]), 3),
        "rounds": rounds,
        "mean_personal_acc": results["summary"]["mean_personal_acc"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, help="another checkout, measured side by side")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--loads", nargs="+", default=["quiet", "contended"])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--burn", type=int, default=os.cpu_count() or 2, help="spinning processes")
    p.add_argument("--data-root", default=FMNIST)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    out: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
        "rounds": args.rounds,
        "burn": args.burn,
        "trees": {k: str(v) for k, v in trees.items()},
        "runs": [],
    }
    for load in args.loads:
        burners = []
        if load == "contended":
            burners = [mp.Process(target=_spin, daemon=True) for _ in range(args.burn)]
            for b in burners:
                b.start()
            time.sleep(1)
        try:
            for name in args.workloads:
                tries: dict[tuple[str, str], list[dict[str, Any]]] = {}
                for _ in range(args.repeat):  # interleaved: drifts in the load hit all alike
                    for tree_name, tree in trees.items():
                        for mode in MODES:
                            got = _run(tree, WORKLOADS[name], mode, args)
                            tries.setdefault((tree_name, mode), []).append(got)
                for (tree_name, mode), runs in tries.items():
                    seconds = [r["seconds"] for r in runs]
                    out["runs"].append(
                        {
                            "workload": name,
                            "load": load,
                            "tree": tree_name,
                            "mode": mode,
                            "median_s": statistics.median(seconds),
                            "tries_s": seconds,
                            "mean_personal_acc": runs[0]["mean_personal_acc"],
                        }
                    )
        finally:
            for b in burners:
                b.terminate()
    emit(out, args.json_out, table)


def table(out: dict[str, Any]) -> str:
    rows = [
        f"rounds 2-{out['rounds']} (s), median of tries; contended: {out['burn']} spinning "
        "processes beside it",
        "",
        "| workload | load | code | stacked (s) | client by client (s) | stacked / one by one |",
        "|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in out["runs"]:
        cells.setdefault((r["workload"], r["load"], r["tree"]), {})[r["mode"]] = r["median_s"]
    for (workload, load, tree), m in cells.items():
        s, c = m["stacked"], m["client_by_client"]
        rows.append(f"| {workload} | {load} | {tree} | {s:.2f} | {c:.2f} | {s / c:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
