"""Stacked training against client by client, on a quiet machine and beside a competing load.

A simulation on the CPU trains the clients of one group as one stacked model
(`cohort = "always"`), one by one (`"never"`), or stacked where the measured rule says it pays
(`"auto"`, the default; `coordinator.stacking.pays`). Issue 48 measured stacking losing 3-4x
under a competing load.
Each workload here runs as `edgefl simulate` in a child process, in each mode, quiet and with
`--burn` processes spinning on every core meanwhile (a second program on the machine), from
this checkout and, with `--baseline DIR`, from another checkout side by side (the same commands
run with DIR as the working directory, so that its packages are imported).

A try's time is its rounds after the first (results.json's per-round `seconds`: the first holds
one-off costs). Each configuration runs `--repeat` times, interleaved; the median is reported,
with the spread. The machine's load before and after is in the JSON.

    python benchmarks/stacking_contention.py                          # ~10 min on 2 cores
    python benchmarks/stacking_contention.py --baseline /tmp/old --repeat 3 \
        --json-out benchmarks/results/stacking_contention.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import emit, machine

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
# One architecture, equal clients of 150 samples, one epoch: the smallest rounds, where the
# stacking's cost per round weighs most (`--workloads grid`).
GRID = {
    f"fml-{family}-{n}": f"--algorithm fml --models {family} --global-model {family} "
    f"--clients {n} --partition iid --max-samples {150 * n} --local-epochs 1"
    for family in ("mlr", "mlp", "lenet5", "cnn1")
    for n in (4, 8, 16, 20, 24, 32)
}
# mode: its `cohort` value here, and in a checkout from before "auto" (a switch then; None:
# the mode did not exist)
MODES = {
    "stacked": ("always", "true"),
    "client_by_client": ("never", "false"),
    "auto": ("auto", None),
}


def _spin() -> None:
    x = 0
    while True:
        x += 1


def _run(tree: Path, flags: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="edgefl-contend-") as out:
        cmd = [sys.executable, "-m", "coordinator", "simulate", *flags.split(), *args.flags]
        cmd += ["--dataset", "fashion_mnist", "--data-root", args.data_root]
        cmd += ["--rounds", str(args.rounds), "--baselines", "", "--seed", "1"]
        cohort = MODES[mode][0 if tree == ROOT else 1]
        cmd += ["--out", out, "--set", f"cohort={cohort}", "-q"]
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
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(WORKLOADS),
        choices=[*WORKLOADS, *GRID, "grid"],
        help="grid: every fml-FAMILY-N of GRID",
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--loads", nargs="+", default=["quiet", "contended"])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--burn", type=int, default=os.cpu_count() or 2, help="spinning processes")
    p.add_argument("--data-root", default=FMNIST)
    p.add_argument(
        "--flags", nargs="*", default=[], help="more flags for every run, e.g. --flags=--parallel=1"
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    if "grid" in args.workloads:
        args.workloads = [w for w in args.workloads if w != "grid"] + list(GRID)

    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    out: dict[str, Any] = {
        "machine": machine(),
        "rounds": args.rounds,
        "flags": args.flags,
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
                        for mode in args.modes:
                            if tree != ROOT and MODES[mode][1] is None:
                                continue
                            got = _run(tree, (WORKLOADS | GRID)[name], mode, args)
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
        "processes beside it" + (f"; flags {' '.join(out['flags'])}" if out.get("flags") else ""),
        "",
        "| workload | load | code | stacked (s) | client by client (s) | auto (s) "
        "| stacked / one by one | auto / one by one |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in out["runs"]:
        cells.setdefault((r["workload"], r["load"], r["tree"]), {})[r["mode"]] = r["median_s"]

    def cell(m: dict[str, float], mode: str, by: str | None = None) -> str:
        if mode not in m or (by is not None and by not in m):
            return ""
        return f"{m[mode] / m[by]:.2f}" if by is not None else f"{m[mode]:.2f}"

    for (workload, load, tree), m in cells.items():
        c = "client_by_client"
        rows.append(
            f"| {workload} | {load} | {tree} | {cell(m, 'stacked')} | {cell(m, c)} "
            f"| {cell(m, 'auto')} | {cell(m, 'stacked', c)} | {cell(m, 'auto', c)} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
