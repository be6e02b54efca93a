"""Soak: a long federation over mosquitto, watching memory and counting lost rounds.

`edgefl coordinator` and N `edgefl client` processes (default 20 clients, 50 rounds, FML with
tiny models on scikit-learn's digits) on a mosquitto started here. The peak RSS of the
coordinator and of one client is sampled all along and read off at round 10 and at the last
round: a leak shows as growth between the two (goal: under 10%). Rounds lost: rounds missing
from rounds.jsonl or recorded as failed (goal: 0).

    python benchmarks/soak.py                          # 20 clients, 50 rounds (a few minutes)
    python benchmarks/soak.py --clients 5 --rounds 20  # quicker
    python benchmarks/soak.py --json-out soak.json

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from coordinator.broker import MosquittoBroker

EDGEFL = str(Path(sys.executable).parent / "edgefl")
FAMILIES = ["mlr", "mlp"]
SETS = ["--set", 'data.options={"size": 8}', "--set", "device=cpu"]


def _rounds(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--checkpoint-round", type=int, default=10, help="the early RSS reading")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    n, rounds, early = args.clients, args.rounds, min(args.checkpoint_round, args.rounds)
    work = Path(tempfile.mkdtemp(prefix="edgefl-soak-"))
    data = ["--dataset", "digits", "--partition", "iid", "--clients", str(n)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    peaks: dict[str, float] = {}
    readings: dict[int, dict[str, float]] = {}
    t0 = time.perf_counter()
    with MosquittoBroker() as broker:
        common = ["--broker", broker.url, "--run-id", "soak"]
        run = ["--algorithm", "fml", "--clients", str(n), "--rounds", str(rounds)]
        training = ["--local-epochs", "1", "--batch-size", "32", "--lr", "0.1"]
        out = ["--out", str(work / "out"), "--global-model", "mlr"]
        wait = ["--set", "round.register_timeout_s=600"]
        procs["coordinator"] = subprocess.Popen(
            [EDGEFL, "coordinator", *common, *run, *training, *out, *SETS, *wait],
            stdout=subprocess.DEVNULL,
            stderr=open(work / "coordinator.log", "w"),  # noqa: SIM115
        )
        for i in range(n):
            me = ["--id", f"c{i}", "--model", FAMILIES[i % 2], "--index", str(i), "--seed", "0"]
            state = ["--threads", "1", "--state-dir", str(work / f"c{i}")]
            procs[f"c{i}"] = subprocess.Popen(
                [EDGEFL, "client", *common, *me, *data, *state, *SETS],
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"c{i}.log", "w"),  # noqa: SIM115
            )
        watched = {name: psutil.Process(procs[name].pid) for name in ("coordinator", "c0")}
        log = work / "out" / "rounds.jsonl"
        while procs["coordinator"].poll() is None:
            for name, proc in watched.items():
                with contextlib.suppress(psutil.NoSuchProcess):
                    peaks[name] = max(peaks.get(name, 0.0), proc.memory_info().rss / 2**20)
            done = len(_rounds(log))
            for mark in (early, rounds):
                if done >= mark and mark not in readings:
                    readings[mark] = dict(peaks)
            time.sleep(0.2)
        for proc in procs.values():
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    wall = time.perf_counter() - t0
    recorded = _rounds(work / "out" / "rounds.jsonl")
    numbers = [r["round"] for r in recorded]
    lost = len(set(range(1, rounds + 1)) - set(numbers)) + sum(r["failed"] for r in recorded)
    readings.setdefault(rounds, dict(peaks))
    growth = {
        name: readings[rounds][name] / readings[early][name] - 1
        for name in ("coordinator", "c0")
        if early in readings and name in readings[early]
    }
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": sys.version.split()[0],
        },
        "settings": {"clients": n, "rounds": rounds, "algorithm": "fml", "models": FAMILIES},
        "peak_rss_mb": {str(k): v for k, v in sorted(readings.items())},
        "rss_growth": growth,
        "rounds_recorded": len(recorded),
        "rounds_lost": lost,
        "exit_codes": {k: p.returncode for k, p in procs.items() if p.returncode != 0},
        "wall_s": wall,
        "round_seconds_median": sorted(r["seconds"] for r in recorded)[len(recorded) // 2]
        if recorded
        else None,
        "logs": str(work),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print()
    head = f"peak RSS @ round {early} (MB)"
    print(f"{'process':<12}{head:>28}{f'@ round {rounds}':>14}{'growth':>9}")
    for name in ("coordinator", "c0"):
        a, b = readings.get(early, {}).get(name), readings[rounds].get(name)
        if a and b:
            print(f"{name:<12}{a:>28.1f}{b:>14.1f}{100 * (b / a - 1):>8.1f}%")
    print(f"rounds lost: {lost} of {rounds}; wall {wall:.0f} s for {n} clients")
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
