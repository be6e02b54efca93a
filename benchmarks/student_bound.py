"""The guard's students on devices with many images: bounded by `guard_distill_samples`, or not.

The guard's students (a model of the device's own architecture distilled from one outside its
budget) train `guard_distill_epochs` = 40 epochs of 4 views: measured on devices of 24 to 147
training images, where they are 4,000-24,000 samples. On a device of 2,000 images they are
320,000, two students a device, and the finalize after the last round takes many times the
rounds. `guard_distill_samples` bounds each student's samples (0, the default: no bound): a
device of more images trains fewer epochs. This runs the same federations without the bound and
with 64,000, the same seeds on both sides, and reports each side's
mean accuracy of the deployed models (every one of the device's own architecture), its worst
client against the other side, the samples each client processed and the seconds the rounds and
the finalize took.

    .venv/bin/python benchmarks/student_bound.py --algorithms fml,pfml --seeds 0,1 \\
        --json-out benchmarks/results/student_bound.json

The split: Fashion-MNIST, Dirichlet 0.5 over 6 devices of lenet5, mlp and cnn1 (the global
architecture mlp), `--samples` images shared among them (30% training, 20% validation,
50% test), 5 rounds of 2 local epochs, batches of 16, as the quick size of
benchmarks/personalization.py but with many more images. The runs are made one after the other
in this process: their times compare within one run of this script.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _report import emit, machine  # noqa: E402
from personalization import SIZES, _budget  # noqa: E402

from coordinator.config import load_config  # noqa: E402
from coordinator.simulator import simulate  # noqa: E402

SIDES = {"unbounded (default)": {}, "bounded, 64,000": {"guard_distill_samples": 64_000}}


def flags(algorithm: str, seed: int, samples: int) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "seed": seed,
        "clients": 6,
        "rounds": SIZES["quick"].rounds,
        **_budget(SIZES["quick"], algorithm),  # 2 local epochs of batches of 16
        "models": ["lenet5", "mlp", "cnn1"],
        "global_model": "mlp",
        "baselines": [],
        "device": "cpu",
        "data.dataset": "fashion_mnist",
        "data.partition": "dirichlet",
        "data.partition_params": {"alpha": 0.5, "min_size": 20},
        "data.max_samples": samples,
        "data.split": [0.3, 0.2, 0.5],
        "round.eval_every": 10_000,
        "round.deadline_s": 7200,
    }


def run(algorithm: str, seed: int, samples: int, side: dict[str, Any]) -> dict[str, Any]:
    overrides = {f"{algorithm}.{k}": v for k, v in side.items()}
    cfg = load_config(None, flags(algorithm, seed, samples) | overrides, environ=False)
    t0 = time.perf_counter()
    res = simulate(cfg, progress=False)
    wall = time.perf_counter() - t0
    rounds_s = sum(r.seconds for r in res.rounds)
    clients = res.clients
    print(f"{algorithm} seed {seed} {side}: {wall:.0f} s", file=sys.stderr, flush=True)
    return {
        "mean_acc": round(100 * statistics.mean(c.personal_acc or 0.0 for c in clients), 2),
        "per_client": [round(100 * (c.personal_acc or 0.0), 2) for c in clients],
        "n_train": [c.n_train for c in clients],
        "deployed_arch": [c.details.get("deployed_arch") for c in clients],
        "own_arch": [c.arch for c in clients],
        "samples_processed": [c.details.get("samples_processed") for c in clients],
        "rounds_s": round(rounds_s, 1),
        "finalize_s": round(wall - rounds_s, 1),
    }


def table(out: dict[str, Any]) -> str:
    lines = [
        "| algorithm | side | mean accuracy | worst client vs the other side | passes a client "
        "| rounds s | finalize s |",
        "|---|---|---|---|---|---|---|",
    ]
    for algorithm, by_side in out["runs"].items():
        sides = list(by_side)
        for name in sides:
            runs = by_side[name]
            other = by_side[sides[1 - sides.index(name)]]
            diffs = [
                a - b
                for r, o in zip(runs, other, strict=True)
                for a, b in zip(r["per_client"], o["per_client"], strict=True)
            ]
            passes = [
                s / n
                for r in runs
                for s, n in zip(r["samples_processed"], r["n_train"], strict=True)
            ]
            lines.append(
                f"| {algorithm} | {name} | {statistics.mean(r['mean_acc'] for r in runs):.2f} | "
                f"{min(diffs):+.1f} | {statistics.mean(passes):.0f} | "
                f"{statistics.mean(r['rounds_s'] for r in runs):.0f} | "
                f"{statistics.mean(r['finalize_s'] for r in runs):.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithms", default="fml,pfml", help="comma-separated")
    ap.add_argument("--seeds", default="0,1", help="comma-separated")
    ap.add_argument("--samples", type=int, default=20_000, help="images shared by the 6 devices")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    out: dict[str, Any] = {
        "machine": machine(),
        "settings": flags("ALGORITHM", -1, args.samples) | {"seeds": seeds},
        "runs": {},
    }
    for algorithm in args.algorithms.split(","):
        out["runs"][algorithm] = {
            name: [run(algorithm, seed, args.samples, side) for seed in seeds]
            for name, side in SIDES.items()
        }
    emit(out, args.json_out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
