"""A simulation over torch.distributed ranks against one process, on the same cores.

FedAvg, LeNet-5 on 28×28 digits (iid), every client trains every round; each configuration is
`edgefl simulate` in a child process, its wall time the coordinator's run (results.json's
`summary.wall_seconds`: after data loading and the ranks' start):

- `1 rank × 1 thread`: the per-core reference;
- `1 rank × 2 threads`: today's simulator on both cores;
- `2 ranks × 1 thread`: `--workers 2 --threads 1` (gloo between the ranks).

Each configuration runs `--repeat` times, interleaved; the median try is reported. Reports
client-steps per second (a client-step: one optimizer step of one client, counted from
the split: ceil(n_train / batch) × epochs per client per round), the efficiency against the
per-core reference (steps/s ÷ (cores × reference steps/s)), and the bytes the ranks moved per
round (tasks out, replies in) against the bytes of the models the clients trained in a round.

On a GPU (`--device cuda`), `--configs` picks how many ranks share it (each rank on its
machine's GPU LOCAL_RANK mod GPUs); the speedup column compares each row with the first.

Then a projection for 8 GPUs × N nodes: a model on paper from the measured compute per
client-step and bytes per client and round, with its assumptions printed beside it. From a CPU
run, a GPU's compute is an assumed multiple of one measured core; from a `--device cuda` run,
it is the first row's, measured.

    python benchmarks/ranks.py                       # ~1 min on 2 cores
    python benchmarks/ranks.py --wait-policy unset   # OpenMP's default (threads spin a while)
    python benchmarks/ranks.py --clients 16 --rounds 10 --json-out benchmarks/results/ranks.json
    python benchmarks/ranks.py --device cuda --configs 1x2 1x8 2x2 4x2 \
        --dataset fashion_mnist --clients 64 --repeat 2   # 1, 2 and 4 ranks sharing one GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _report import emit, machine

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["1x1", "1x2", "2x1"]  # ranks x threads per rank


def _run(args: argparse.Namespace, ranks: int, threads: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "coordinator", "simulate", "--algorithm", "fedavg"]
    cmd += ["--dataset", args.dataset, "--partition", "iid", "--models", args.model]
    cmd += ["--clients", str(args.clients), "--rounds", str(args.rounds), "--device", args.device]
    cmd += ["--data-root", str(args.data_root)] if args.data_root else []
    cmd += ["--batch-size", str(args.batch), "--local-epochs", str(args.epochs), "--lr", "0.05"]
    cmd += ["--threads", str(threads), "--workers", str(ranks), "--out", str(out), "-q"]
    # OMP_NUM_THREADS holds torch's intra-op pool to the threads asked (the simulator's --threads
    # shares threads among clients training at once but leaves one stacked job torch's pool).
    # OMP_WAIT_POLICY: left to OpenMP, its threads spin while they wait; on cores other jobs
    # share, that made a rank of 2 threads ~10x slower than one of 1 (results/ranks_omp_default).
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if args.wait_policy != "unset":
        env["OMP_WAIT_POLICY"] = args.wait_policy
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    res = json.loads((out / "results.json").read_text())
    split = res["split"]["clients"]
    steps = sum(math.ceil(c["n_train"] / args.batch) for c in split) * args.epochs * args.rounds
    params = sum(c["own_params"] for c in res["clients"])
    summary = res["summary"]
    wall = float(summary["wall_seconds"])
    moved = int(summary["coordinator_bytes_out"]) + int(summary["coordinator_bytes_in"])
    return {
        "ranks": ranks,
        "threads_per_rank": threads,
        "cores": ranks * threads,
        "wall_s": round(wall, 3),
        "client_steps": steps,
        "client_steps_per_s": round(steps / wall, 1),
        "bytes_between_ranks_per_round": moved // args.rounds,
        "model_bytes_trained_per_round": params * 4,  # fp32, every client trains every round
        "mean_personal_acc": summary["mean_personal_acc"],
        "device": res["device"]["used"],
    }


def _projection(rows: list[dict[str, Any]], clients: int, gpu: bool) -> dict[str, Any]:
    """Round time for 8 GPUs × N nodes on paper: compute split evenly over the ranks, every
    task and reply through rank 0's link, a fixed cost per rank and collective. `gpu`: the
    rows were measured on a GPU (the first row's compute is one GPU's)."""
    ref, two = rows[0], max(rows, key=lambda r: r["ranks"])
    step_s = 1 / ref["client_steps_per_s"]  # one rank: one core, or one GPU
    # Only clients on other ranks than 0 cross: half of them with two ranks.
    remote = clients * (two["ranks"] - 1) / two["ranks"]
    per_client = two["bytes_between_ranks_per_round"] / remote
    steps_per_client = ref["client_steps"] / clients / ref["rounds"]
    model = {
        "assumptions": {
            # from a GPU run, its first row is one GPU (as measured: its stack of `clients`;
            # a GPU given more clients a round stacks more of them, cheaper per client-step)
            "gpu_speedup_over_one_measured_core": 1.0 if gpu else 20.0,
            "clients_per_round": 10_000,
            "rank0_link_bytes_per_s": 1.25e9,  # 10 Gb/s: every task and reply crosses it
            "seconds_per_rank_per_collective": 1e-3,
            "collectives_per_round": 6,  # fit and evaluate: a scatter, a peer exchange, a gather
        },
        "measured": {
            "seconds_per_client_step_" + ("one_gpu" if gpu else "one_core"): step_s,
            "client_steps_per_client_round": steps_per_client,
            "bytes_between_ranks_per_remote_client_round": per_client,
        },
        "nodes": [],
    }
    a = model["assumptions"]
    k = a["clients_per_round"]

    def round_s(r: int) -> tuple[float, float]:
        compute = (
            math.ceil(k / r) * steps_per_client * step_s / a["gpu_speedup_over_one_measured_core"]
        )
        if r == 1:
            return compute, 0.0
        link = k * (r - 1) / r * per_client / a["rank0_link_bytes_per_s"]
        return compute, link + r * a["collectives_per_round"] * a["seconds_per_rank_per_collective"]

    one = sum(round_s(1))
    for n in (1, 2, 4, 8, 16):
        r = 8 * n
        compute, comm = round_s(r)
        model["nodes"].append(
            {
                "nodes": n,
                "gpus": r,
                "round_s": round(compute + comm, 3),
                "compute_s": round(compute, 3),
                "communication_s": round(comm, 3),
                "speedup_over_one_gpu": round(one / (compute + comm), 1),
                "efficiency": round(one / (compute + comm) / r, 2),
            }
        )
    return model


def _table(out: dict[str, Any]) -> str:
    rows = out["rows"]
    ref = rows[0]["client_steps_per_s"]
    lines = [
        "| ranks × threads | device | client-steps/s | speedup | efficiency per core | bytes "
        "between ranks per round | model bytes trained per round | mean personalized acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eff = r["client_steps_per_s"] * rows[0]["cores"] / (r["cores"] * ref)
        lines.append(
            f"| {r['ranks']} × {r['threads_per_rank']} | {r['device']} | "
            f"{r['client_steps_per_s']:.0f} | {r['client_steps_per_s'] / ref:.2f} | {eff:.2f} | "
            f"{r['bytes_between_ranks_per_round']:,} | "
            f"{r['model_bytes_trained_per_round']:,} | {r['mean_personal_acc']:.4f} |"
        )
    p = out["projection"]
    lines += [
        "",
        "Projection (a model on paper; compute per client-step: the first row's): "
        + json.dumps(p["assumptions"]),
        "| nodes × 8 GPUs | round (s) | compute (s) | communication (s) | speedup over 1 GPU | "
        "efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for n in p["nodes"]:
        lines.append(
            f"| {n['nodes']} × 8 | {n['round_s']} | {n['compute_s']} | {n['communication_s']} | "
            f"{n['speedup_over_one_gpu']} | {n['efficiency']} |"
        )
    return "\n".join(lines)


def _gpu() -> str | None:
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    ) if shutil.which("nvidia-smi") else None  # fmt: skip
    return proc.stdout.strip() or None if proc and proc.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--data-root", type=Path, help="where the dataset's files are")
    ap.add_argument("--device", default="cpu", help="cpu, cuda (ranks share the GPUs in turn)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help="ranks x threads per rank")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--wait-policy", choices=["active", "passive", "unset"], default="passive",
                    help="OMP_WAIT_POLICY of every run")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="tries of each configuration")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rows = []
    start = machine()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    tries: dict[tuple[int, ...], list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):  # interleaved: a burst of load elsewhere hits each alike
            for ranks, threads in configs:
                out = Path(tmp) / f"{ranks}x{threads}-{i}"
                tries[(ranks, threads)].append(_run(args, ranks, threads, out))
    for got in tries.values():  # the median try by speed, with every try's speed beside it
        got.sort(key=lambda r: r["client_steps_per_s"])
        row = got[len(got) // 2] | {"rounds": args.rounds}
        row["client_steps_per_s_tries"] = [r["client_steps_per_s"] for r in got]
        rows.append(row)
    out = {
        "benchmark": "ranks",
        "settings": vars(args)
        | {
            "json_out": str(args.json_out) if args.json_out else None,
            "data_root": str(args.data_root) if args.data_root else None,
        },
        "machine": start | {"gpu": _gpu()},
        "rows": rows,
        "projection": _projection(rows, args.clients, args.device != "cpu"),
    }
    emit(out, args.json_out, _table)


if __name__ == "__main__":
    main()
