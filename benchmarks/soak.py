"""Soak: a long federation over mosquitto, watching memory and counting lost rounds.

`edgefl coordinator` and N `edgefl client` processes (default 20 clients, 50 rounds, FML with
tiny models on scikit-learn's digits) on a mosquitto started here, each process with its own
signing key. The peak RSS of the coordinator and of one client is sampled all along and read off
at round 10 and at the last round: a leak shows as growth between the two (goal: under 10%).
Rounds lost: rounds missing from rounds.jsonl or recorded as failed (goal: 0).

`--attacks` attacks the run while it goes, on the (open) broker, one thing after another:
- a flood, at a quarter of the rounds: 10,000 bad messages on c1's topic and 200 MiB of chunks
  that never complete, half from nobody the run knows, half on c0's topic;
- forged replies, from half-way on: every task of c0's is answered first by a forgery (unsigned,
  or with a made-up signature) claiming a perfect score, and c0's own earlier replies are replayed;
- an id takeover, at three quarters: a connection takes c1's MQTT session again and again, and a
  second `edgefl client` process registers as c1 with another architecture.
The run must end with exactly the per-client accuracies of an undisturbed one (the same
federation simulated in this process), and the peak RSS says what the attacks cost in memory.

    python benchmarks/soak.py                          # 20 clients, 50 rounds (a few minutes)
    python benchmarks/soak.py --clients 5 --rounds 20  # quicker
    python benchmarks/soak.py --clients 5 --rounds 20 --attacks
    python benchmarks/soak.py --json-out soak.json

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ended, machine, save

from coordinator.broker import MosquittoBroker
from edge_sdk import topics
from edge_sdk.auth import issue_keys
from edge_sdk.protocol import Reply, Task, decode, encode
from edge_sdk.transport.mqtt import MqttTransport

EDGEFL = str(Path(sys.executable).parent / "edgefl")
FAMILIES = ["mlr", "mlp"]
SETS = ["--set", 'data.options={"size": 8}', "--set", "device=cpu"]
TRAINING = {"local_epochs": 1, "batch_size": 32, "lr": 0.1}
RUN = "soak"
# A process that imports the CLI, waits for its trigger file, then runs it: joins at once when
# triggered instead of spending tens of seconds importing torch first.
LATER = (
    "import sys, time, pathlib, coordinator.cli as cli\n"
    "trigger = pathlib.Path(sys.argv[1])\n"
    "while not trigger.exists(): time.sleep(0.05)\n"
    "sys.argv = ['edgefl', *sys.argv[2:]]\n"
    "cli.main()\n"
)


def _rounds(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _reference(n: int, rounds: int) -> list[float | None]:
    """The same federation, undisturbed, simulated in this process (deployments equal it)."""
    from coordinator.config import load_config
    from coordinator.simulator import simulate

    flags = {
        "algorithm": "fml",
        "data.dataset": "digits",
        "data.options": {"size": 8},
        "data.partition": "iid",
        "models": FAMILIES,
        "global_model": "mlr",
        "clients": n,
        "rounds": rounds,
        "device": "cpu",
        "parallel": 2,
    }
    cfg = load_config(None, flags, training=TRAINING)
    return [c.personal_acc for c in simulate(cfg, progress=False).clients]


class Attacks:
    """The attacker: anyone on the open broker, with no key (see the module docstring)."""

    def __init__(self, url: str, n: int, keys: dict[str, Path], work: Path) -> None:
        self.url, self.keys, self.work = url, keys, work
        self.t = MqttTransport(url, "soak-mallory").connect(10)
        self.forging = False
        self.forged = self.takeovers = 0
        self.c0_frames: list[bytes] = []
        self.t.subscribe(topics.up(RUN, "c0"), self._on_c0)
        self.t.subscribe(topics.down(RUN, "c0"), self._on_task)
        # c1 again with another architecture (and c1's key), started now, joining when told.
        me = ["--id", "c1", "--model", "cnn1", "--index", "1", "--clients", str(n)]
        auth = ["--set", f"auth.key_file={keys['c1']}", "--set", f"auth.roster={keys['roster']}"]
        data = ["--dataset", "digits", "--partition", "iid", "--state-dir", str(work / "dup")]
        self.trigger = work / "take-over"
        late = [sys.executable, "-c", LATER, str(self.trigger), "client", "--broker", url]
        self.duplicate = subprocess.Popen(
            [*late, "--run-id", RUN, *me, *data, *SETS, *auth],
            stdout=subprocess.DEVNULL,
            stderr=open(work / "duplicate.log", "w"),  # noqa: SIM115
        )

    def _on_c0(self, topic: str, payload: bytes) -> None:
        if payload.startswith(b"EF1S"):
            self.c0_frames = [*self.c0_frames[-2:], payload]

    def _on_task(self, topic: str, payload: bytes) -> None:
        if not self.forging or not payload.startswith(b"EF1S"):
            return
        msg = decode(payload[68:])
        if not isinstance(msg, Task):
            return
        base = {"run": RUN, "sender": "c0", "task_id": msg.task_id, "round": msg.round}
        counts = {"personal_correct": 5.0, "personal_total": 5.0}
        body = encode(Reply(**base, phase=msg.phase, ok=True, metrics=counts, n_samples=1))
        up = topics.up(RUN, "c0")
        self.t.publish(up, b"EF1M" + body)
        self.t.publish(up, b"EF1S" + os.urandom(64) + body)
        for frame in self.c0_frames:
            self.t.publish(up, frame)
        self.forged += 1

    def flood(self) -> None:
        up = topics.up(RUN, "c1")
        for i in range(10_000):
            self.t.publish(up, b"EF1M{flood" + str(i).encode())
        for i in range(200):
            meta = {"blob": f"x{i}", "index": 0, "count": 200, "size": 200 << 20}
            header = json.dumps(meta).encode()
            chunk = b"EF1C" + len(header).to_bytes(4, "big") + header + os.urandom(1 << 20)
            where = topics.up(RUN, f"x{i}") if i % 2 else topics.up(RUN, "c0")
            self.t.publish(where, chunk).wait(60)

    def take_over(self) -> None:
        """c1's MQTT session, taken a few times; and a second process registering as c1."""
        for _ in range(5):
            intruder = MqttTransport(self.url, f"edgefl-{RUN}-c1").connect(10)
            time.sleep(0.5)
            intruder.close()
            self.takeovers += 1
        self.trigger.touch()

    def refused_duplicate(self) -> str | None:
        """The reason the duplicate c1 gave when it stopped (its log's last error)."""
        found = re.findall(r"registration refused: (.*)", (self.work / "duplicate.log").read_text())
        return found[-1] if found else None

    def close(self) -> None:
        self.t.close()
        self.trigger.touch()  # (if the run ended first, it finds it over)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.duplicate.wait(120)
        if self.duplicate.poll() is None:
            self.duplicate.kill()
            self.duplicate.wait()


def _rejections(log: Path) -> dict[str, float]:
    """The coordinator's `edgefl_rejected_messages_total`, from the port its log names."""
    found = re.search(r"Prometheus metrics on port (\d+)", log.read_text())
    if found is None:
        return {}
    try:
        url = f"http://127.0.0.1:{found.group(1)}/metrics"
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    pattern = r'edgefl_rejected_messages_total\{reason="(\w+)"\} (\S+)'
    return {k: float(v) for k, v in re.findall(pattern, text)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--checkpoint-round", type=int, default=10, help="the early RSS reading")
    p.add_argument("--attacks", action="store_true", help="flood, forge, take over (see above)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    start = machine()
    n, rounds, early = args.clients, args.rounds, min(args.checkpoint_round, args.rounds)
    work = Path(tempfile.mkdtemp(prefix="edgefl-soak-"))
    keys = issue_keys(work / "keys", [f"c{i}" for i in range(n)])

    def auth(pid: str) -> list[str]:
        return ["--set", f"auth.key_file={keys[pid]}", "--set", f"auth.roster={keys['roster']}"]

    data = ["--dataset", "digits", "--partition", "iid", "--clients", str(n)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    peaks: dict[str, float] = {}
    readings: dict[int, dict[str, float]] = {}
    rejected: dict[str, float] = {}
    attacks: Attacks | None = None
    steps = {
        max(1, rounds // 4): "flood",
        max(2, rounds // 2): "forge",
        max(3, 3 * rounds // 4): "take over",
    }
    t0 = time.perf_counter()
    with MosquittoBroker() as broker:
        common = ["--broker", broker.url, "--run-id", RUN]
        run = ["--algorithm", "fml", "--clients", str(n), "--rounds", str(rounds)]
        training = [f"--{k.replace('_', '-')}={v}" for k, v in TRAINING.items()]
        out = ["--out", str(work / "out"), "--global-model", "mlr", "--metrics-port", "0", "-v"]
        wait = ["--set", "round.register_timeout_s=600"]
        procs["coordinator"] = subprocess.Popen(
            [
                EDGEFL,
                "coordinator",
                *common,
                *run,
                *training,
                *out,
                *SETS,
                *wait,
                *auth("coordinator"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(work / "coordinator.log", "w"),  # noqa: SIM115
        )
        for i in range(n):
            me = ["--id", f"c{i}", "--model", FAMILIES[i % 2], "--index", str(i), "--seed", "0"]
            state = ["--threads", "1", "--state-dir", str(work / f"c{i}")]
            procs[f"c{i}"] = subprocess.Popen(
                [EDGEFL, "client", *common, *me, *data, *state, *SETS, *auth(f"c{i}")],
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"c{i}.log", "w"),  # noqa: SIM115
            )
        if args.attacks:
            attacks = Attacks(broker.url, n, keys, work)
        watched = {name: psutil.Process(procs[name].pid) for name in ("coordinator", "c0")}
        log = work / "out" / "rounds.jsonl"
        done_steps: list[str] = []
        while procs["coordinator"].poll() is None:
            for name, proc in watched.items():
                with contextlib.suppress(psutil.NoSuchProcess):
                    peaks[name] = max(peaks.get(name, 0.0), proc.memory_info().rss / 2**20)
            done = len(_rounds(log))
            for mark in (early, rounds):
                if done >= mark and mark not in readings:
                    readings[mark] = dict(peaks)
            for at, step in steps.items():
                if attacks is not None and done >= at and step not in done_steps:
                    done_steps.append(step)
                    if step == "flood":
                        threading.Thread(target=attacks.flood, daemon=True).start()
                    elif step == "forge":
                        attacks.forging = True
                    else:
                        threading.Thread(target=attacks.take_over, daemon=True).start()
            rejected = _rejections(work / "coordinator.log") or rejected
            time.sleep(0.2)
        for proc in procs.values():
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        if attacks is not None:
            attacks.close()
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
    report: dict[str, Any] = {
        "machine": start,
        "settings": {
            "clients": n,
            "rounds": rounds,
            "algorithm": "fml",
            "models": FAMILIES,
            "attacks": args.attacks,
        },
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
    same = True
    if attacks is not None:
        results = json.loads((work / "out" / "results.json").read_text())
        deployed = [c["personal_acc"] for c in results["clients"]]
        same = deployed == _reference(n, rounds)
        report["attacks"] = {
            "steps": {step: at for at, step in steps.items()},
            "tasks_answered_by_forgeries": attacks.forged,
            "session_takeovers": attacks.takeovers,
            "duplicate_exit_code": attacks.duplicate.returncode,
            "duplicate_refused": attacks.refused_duplicate(),
            "rejected_by_reason": rejected,
            "accuracies_equal_undisturbed_run": same,
        }
    ended(report)
    print(save(report, args.json_out))
    print()
    head = f"peak RSS @ round {early} (MB)"
    print(f"{'process':<12}{head:>28}{f'@ round {rounds}':>14}{'growth':>9}")
    for name in ("coordinator", "c0"):
        a, b = readings.get(early, {}).get(name), readings[rounds].get(name)
        if a and b:
            print(f"{name:<12}{a:>28.1f}{b:>14.1f}{100 * (b / a - 1):>8.1f}%")
    print(f"rounds lost: {lost} of {rounds}; wall {wall:.0f} s for {n} clients")
    if attacks is not None:
        print(
            f"attacks: {attacks.forged} tasks forged, {attacks.takeovers} session takeovers, "
            f"rejected {sum(rejected.values()):.0f} messages; accuracies "
            + ("equal the undisturbed run's" if same else "DIFFER from the undisturbed run's")
        )
    return 0 if lost == 0 and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
