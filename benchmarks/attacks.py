"""Clients with valid keys attacking the federation, and what the coordinator's defences leave of
the honest clients' accuracy; and a flood of tiny chunks, and the memory it leaves behind.

**Attacks** (`--part attacks`). Ten clients on scikit-learn's digits (8×8, Dirichlet α = 1),
every one an `EdgeClient` over the in-memory transport with its own signing key (the network
fleet: the code path of a deployment). One of them (c0), or three (c0-c2), attack in every fit
reply, from round 1 on:
- `scaled`: its update (the model it sends minus the one it was sent) ×1000;
- `flipped`: its update reversed and ×10;
- `huge`: every weight 3.0e38 (finite, so no NaN check catches it);
- `inflated`: it registers 10⁹ training samples, claims them in every reply, and sends its model
  negated (under a sample-weighted mean it would be the aggregate);
- `reversed` (not run unless named in `--attacks`): its update reversed and ×3, an attacker who
  knows the norm bound (`robust.clip` = 3 × the median) and stays at it: what no bound catches.
For FedAvg, FML, PFML, PersFL and FedMe, each under the coordinator's defences (`robust.*`: the
`mean` aggregator with update clipping, capped sample weights, the value range and rollback, the
defaults) and under the `median` and `trimmed_mean` aggregators, the benchmark runs the federation
without attackers and with each attack, and reports each honest client's final personalized
accuracy against the same client in the run without attackers: the mean gap and the worst one.
`--defences off` runs the same without them (no clipping, no cap, no rollback, any value): what
the attacks do to an undefended run. Goals (issue 47): 1 attacker of 10, every honest client
within 2 points, for every algorithm; 3 of 10 under median or trimmed_mean, within 5 points.

**Flood** (`--part flood`). `edgefl coordinator` and two `edgefl client` processes on mosquitto
(signed); once both registered (the coordinator waits for a third), an attacker with no key
publishes 300,000 one-byte chunks at QoS 1 on c0's up topic (the coordinator's reassembly) and
as many on c0's down topic (c0's). The resident memory (RSS) of the coordinator and of c0 is
read before the flood, at its peak, and once the chunks have expired (the reassembly timeout,
120 s, and a janitor period): goal, back within 10% of where it started.

    python benchmarks/attacks.py                           # everything, about an hour on 2 cores
    python benchmarks/attacks.py --part attacks --algorithms fedavg --attackers 1
    python benchmarks/attacks.py --part attacks --defences off
    python benchmarks/attacks.py --part flood
    python benchmarks/attacks.py --json-out attacks.json

Prints one JSON object, then the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _report import ended, machine, save  # noqa: E402

from coordinator.config import RunConfig, load_config, parse_overrides  # noqa: E402
from coordinator.federation import prepare_federation  # noqa: E402
from coordinator.simulator import run_federation  # noqa: E402
from edge_sdk.algorithms import FitResult  # noqa: E402
from edge_sdk.client import EdgeClient  # noqa: E402
from edge_sdk.codec import Buffer, WireModel  # noqa: E402
from edge_sdk.model_blobs import unpack_models  # noqa: E402
from edge_sdk.node import ClientNode  # noqa: E402
from edge_sdk.protocol import Task  # noqa: E402

ALGORITHMS = ("fedavg", "fml", "pfml", "persfl", "fedme")
ATTACKS = ("scaled", "flipped", "huge", "inflated")
AGGREGATORS = ("mean", "median", "trimmed_mean")
INFLATED = 10**9
RESEED = 1000  # the noise floor's seeds: the same data, training's randomness from seed + 1000
# The defences off: no clipping, no cap, no rollback, any finite value.
UNDEFENDED = {
    "robust.clip": 0,
    "robust.center_clip": 0,
    "robust.weight_cap": 0,
    "robust.rollback": False,
    "robust.max_abs": 1e300,
}


# -- the attacker ---------------------------------------------------------------------------------
def attacked(kind: str, start: WireModel, sent: WireModel) -> WireModel:
    """The model an attacker of `kind` sends instead of `sent`, which it trained from `start`."""
    out = {}
    for key, w in sent.weights.items():
        if not w.is_floating_point():
            out[key] = w
        elif kind == "huge":
            out[key] = torch.full_like(w, 3.0e38)
        elif kind == "inflated":
            out[key] = -w
        else:
            base = start.weights[key] if key in start.weights else torch.zeros_like(w)
            factor = {"scaled": 1000.0, "flipped": -10.0, "reversed": -3.0}[kind]
            out[key] = base + factor * (w - base)
    return WireModel(sent.spec, out)


def attacker(kind: str) -> type[EdgeClient]:
    """An EdgeClient that attacks every fit reply it sends (see the module docstring), or, as
    `absent`, fails every fit task: the run without the attacker, what a perfect defence
    would leave (its evaluations still count)."""

    class Attacker(EdgeClient):
        def __init__(self, node: ClientNode, transport: Any, **kw: Any) -> None:
            if kind == "inflated":  # it registers 10⁹ training samples
                honest = node.capabilities
                node.capabilities = lambda: honest().model_copy(  # type: ignore[method-assign]
                    update={"n_train": INFLATED}
                )
            super().__init__(node, transport, **kw)

        def run_task(self, task: Task, blobs: Mapping[str, Buffer]) -> FitResult:
            if kind == "absent" and task.phase == "fit":
                raise RuntimeError("absent: this client sends nothing to aggregate")
            received = unpack_models(
                task.models, blobs, max_bytes=self.max_blob_bytes, partial=frozenset(task.models)
            )
            result = super().run_task(task, blobs)
            if task.phase != "fit":
                return result
            models = {
                name: attacked(kind, received.get(name) or received["global"], m)
                if (name in received or "global" in received)
                else m
                for name, m in result.models.items()
            }
            n = INFLATED if kind == "inflated" else result.n_samples
            return FitResult(models, dict(result.metrics), n, dict(result.details))

    Attacker.__name__ = f"Attacker_{kind}"
    return Attacker


# -- the federation -------------------------------------------------------------------------------
def config(algorithm: str, rounds: int, sets: Mapping[str, Any]) -> RunConfig:
    """Ten clients on digits (8×8, Dirichlet 1), mlr and mlp (FedAvg: mlr), over the network."""
    flags: dict[str, Any] = {
        "algorithm": algorithm,
        "data.dataset": "digits",
        "data.options": {"size": 8},
        "data.partition": "dirichlet",
        "data.partition_params": {"alpha": 1.0, "min_size": 40},
        "data.split": [0.5, 0.1, 0.4],
        "models": ["mlr"] if algorithm == "fedavg" else ["mlr", "mlp"],
        "global_model": "mlr",
        "clients": 10,
        "rounds": rounds,
        "device": "cpu",
        "fleet": "network",
        "run_id": "attacks",
        "round.deadline_s": 600,
    }
    if algorithm == "fedme":
        flags["fedme.unlabeled_size"] = 200
    training = {"local_epochs": 2, "batch_size": 16}
    if algorithm != "pfml":
        training["lr"] = 0.05
    return load_config(None, flags, dict(sets), training=training, environ=False)


def run(
    algorithm: str, attack: str | None, n_attackers: int, rounds: int, sets: Mapping[str, Any]
) -> dict[str, Any]:
    """One federation; each client's final personalized accuracy, the rounds flagged or rolled
    back, and the wall time."""
    cfg = config(algorithm, rounds, sets)
    ids = [f"c{i}" for i in range(cfg.clients)]
    bad = ids[:n_attackers]
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "algorithm": algorithm,
        "attack": attack or "none",  # (the `attackers` were honest)
        "attackers": bad,
    }
    try:
        fed = prepare_federation(cfg)
        assert fed.client_ids == ids, fed.client_ids
        result = run_federation(
            cfg, fed, algorithm, client_cls={c: attacker(attack) for c in bad} if attack else None
        )
    except Exception as exc:  # an undefended coordinator may crash: every client lost it all
        logging.error("%s %s: the run crashed: %s: %s", algorithm, attack, type(exc).__name__, exc)
        return out | {
            "acc": dict.fromkeys(ids),
            "crashed": f"{type(exc).__name__}: {exc}"[:300],
            **dict.fromkeys(("rounds_failed", "rounds_rolled_back"), 0),
            **{"flagged": [], "suspects": [], "wall_s": round(time.perf_counter() - t0, 1)},
        }
    return out | {
        "acc": {c.id: c.personal_acc for c in result.clients},
        "crashed": None,
        "rounds_failed": sum(r.failed for r in result.rounds),
        "rounds_rolled_back": sum(r.rolled_back for r in result.rounds),
        "flagged": sorted({c for r in result.rounds for c in r.flagged}),
        "suspects": sorted({c for r in result.rounds for c in r.suspects}),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def gaps(
    clean: Mapping[str, float | None], hit: Mapping[str, float | None], honest: list[str]
) -> tuple[float | None, float | None]:
    """Points lost by the honest clients: the mean and the worst (a client with no result in
    the attacked run lost everything)."""
    lost = [100 * ((clean[c] or 0.0) - (hit[c] or 0.0)) for c in honest]
    return (sum(lost) / len(lost), max(lost)) if lost else (None, None)


def seeded(sets: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """`sets` with training's randomness from `seed`, on the same data (that of seed 0)."""
    return {**sets, "seed": seed, "data.seed": 0}


def arm(
    algorithm: str,
    attack: str | None,
    n_attackers: int,
    rounds: int,
    sets: Mapping[str, Any],
    seeds: list[int],
) -> dict[str, Any]:
    """`run` once per training seed, as one: each client's mean accuracy (a client with no
    result counts 0), each seed's accuracies, and what happened in any of the runs."""
    runs = [run(algorithm, attack, n_attackers, rounds, seeded(sets, s)) for s in seeds]
    ids = list(runs[0]["acc"])
    return {
        "attackers": runs[0]["attackers"],
        "acc": {c: sum(r["acc"][c] or 0.0 for r in runs) / len(runs) for c in ids},
        "acc_per_seed": [r["acc"] for r in runs],
        "crashed": next((r["crashed"] for r in runs if r["crashed"]), None),
        "rounds_failed": sum(r["rounds_failed"] for r in runs),
        "rounds_rolled_back": sum(r["rounds_rolled_back"] for r in runs),
        "flagged": sorted({c for r in runs for c in r["flagged"]}),
        "suspects": sorted({c for r in runs for c in r["suspects"]}),
        "wall_s": round(sum(r["wall_s"] for r in runs), 1),
    }


def attacks_part(args: argparse.Namespace) -> dict[str, Any]:
    """Every arm runs once per training seed (`--seeds`, on the same data) and each honest
    client's accuracy is its mean over them; the attacked arm and the arm without the attackers
    share their seeds, so a gap is the attack's effect on the client's expected accuracy, not one
    run's luck. The noise floor compares the arm without them with itself from seeds 1000
    higher."""
    sets = dict(UNDEFENDED) if args.defences == "off" else {}
    sets |= parse_overrides(args.set)
    seeds = [int(x) for x in args.seeds.split(",")]
    rows = []
    for algorithm in args.algorithms.split(","):
        for aggregator in args.aggregators.split(","):
            for n in (int(x) for x in args.attackers.split(",")):
                if n > 1 and aggregator == "mean" and args.defences == "on":
                    continue  # the goal for three attackers is under median or trimmed_mean
                extra = {**sets, "robust.aggregator": aggregator, "robust.trim": args.trim}
                clean, without, again = (
                    arm(algorithm, attack, n, args.rounds, extra, [s + shift for s in seeds])
                    for attack, shift in ((None, 0), ("absent", 0), ("absent", RESEED))
                )
                honest = [c for c in clean["acc"] if c not in without["attackers"]]
                # The noise floor: the run without them again, training from other seeds
                floor = gaps(without["acc"], again["acc"], honest)
                for attack in args.attacks.split(","):
                    hit = arm(algorithm, attack, n, args.rounds, extra, seeds)
                    mean_gap, worst_gap = gaps(without["acc"], hit["acc"], honest)
                    rows.append(
                        {
                            "algorithm": algorithm,
                            "aggregator": aggregator,
                            "defences": args.defences,
                            "attackers": n,
                            "attack": attack,
                            "seeds": seeds,
                            "honest_clean": {c: clean["acc"][c] for c in honest},
                            "honest_without": {c: without["acc"][c] for c in honest},
                            "honest_attacked": {c: hit["acc"][c] for c in honest},
                            "attacked_per_seed": hit["acc_per_seed"],
                            "without_per_seed": without["acc_per_seed"],
                            "mean_gap_points": mean_gap,
                            "worst_gap_points": worst_gap,
                            "worst_gap_vs_clean_points": gaps(clean["acc"], hit["acc"], honest)[1],
                            "goal_points": 2.0 if n == 1 else 5.0,
                            "noise_floor_points": floor[1],  # the reseeded arm's worst gap
                            "clean_flagged": clean["flagged"],
                            **{k: hit[k] for k in HIT_KEYS},
                        }
                    )
                    logging.info(
                        "%s %s %d×%s: worst honest gap %.1f points (%.0f s)",
                        algorithm,
                        aggregator,
                        n,
                        attack,
                        worst_gap or 0.0,
                        hit["wall_s"],
                    )
    return {"rows": rows}


HIT_KEYS = ("crashed", "rounds_failed", "rounds_rolled_back", "flagged", "suspects", "wall_s")


def _mean(accs: Mapping[str, float | None]) -> float:
    return 100 * sum(a or 0.0 for a in accs.values()) / len(accs)


def _what(r: Mapping[str, Any]) -> str:
    """What happened in the attacked run, in words."""
    if r["crashed"]:
        return f"run crashed ({r['crashed'].split(':')[0]})"
    said = [f"{r['rounds_failed']} rounds failed"] if r["rounds_failed"] else []
    said += [f"{r['rounds_rolled_back']} rolled back"] if r["rounds_rolled_back"] else []
    said += [f"flagged {','.join(r['flagged'])}"] if r["flagged"] else []
    return "; ".join(said) or "-"


def attack_table(rows: list[dict[str, Any]]) -> str:
    """Honest clients' mean final accuracy (%) with everyone honest, the attackers absent and
    attacked (each client's mean over the seeds); the gaps (points) are to the arm without them.
    "goal met": the worst honest gap within the goal, or else within the noise floor (the arm
    without them from other seeds)."""
    lines = [
        "| algorithm | aggregator | defences | attackers | attack | seeds | all honest | without | "
        "attacked | mean gap | worst gap | noise floor | goal met | what happened |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        worst = r["worst_gap_points"] or 0.0
        if worst <= r["goal_points"]:
            met = f"yes (≤ {r['goal_points']:.0f})"
        elif worst <= (r["noise_floor_points"] or 0.0):
            met = "within the noise floor"
        else:
            met = f"**no** (> {r['goal_points']:.0f})"
        lines.append(
            f"| {r['algorithm']} | {r['aggregator']} | {r['defences']} | {r['attackers']} | "
            f"{r['attack']} | {len(r.get('seeds', [0]))} | {_mean(r['honest_clean']):.1f} | "
            f"{_mean(r['honest_without']):.1f} | {_mean(r['honest_attacked']):.1f} | "
            f"{r['mean_gap_points']:.1f} | {worst:.1f} | "
            f"{r['noise_floor_points']:.1f} | {met} | {_what(r)} |"
        )
    return "\n".join(lines)


# -- the flood ------------------------------------------------------------------------------------
EDGEFL = str(Path(sys.executable).parent / "edgefl")
RUN = "flood"
SETS = ["--set", 'data.options={"size": 8}', "--set", "device=cpu"]


def _chunk(blob: str, index: int, count: int, size: int) -> bytes:
    header = json.dumps({"blob": blob, "index": index, "count": count, "size": size}).encode()
    return b"EF1C" + len(header).to_bytes(4, "big") + header + b"x"


def flood_frames(n: int) -> list[bytes]:
    """`n` one-byte chunks that never complete: half of them each a blob of its own (a 2-byte
    blob's first chunk), half the out-of-order chunks of a few 1,000-chunk blobs (index 0 never
    comes, so every one waits)."""
    own = [_chunk(f"a{i}", 0, 2, 2) for i in range(n // 2)]
    wait = [_chunk(f"b{i // 999}", 1 + i % 999, 1000, 1000) for i in range(n - n // 2)]
    return [f for pair in zip(own, wait, strict=False) for f in pair] + own[len(wait) :]


def _publish_all(url: str, topic: str, frames: list[bytes]) -> float:
    """Publish every frame at QoS 1 from one paho client; seconds until the broker acked all."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    host, port = url.removeprefix("mqtt://").split(":")
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{os.getpid()}-{topic[-6:]}")
    c.max_inflight_messages_set(1000)
    c.connect(host, int(port))
    c.loop_start()
    t0 = time.perf_counter()
    for start in range(0, len(frames), 20_000):  # message ids are 16-bit: a window at a time
        infos = [c.publish(topic, f, qos=1) for f in frames[start : start + 20_000]]
        for info in infos:
            info.wait_for_publish(120)
    seconds = time.perf_counter() - t0
    c.loop_stop()
    c.disconnect()
    return seconds


def _rss(procs: Mapping[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            out[name] = p.memory_info().rss / 2**20
    return out


def flood_part(args: argparse.Namespace) -> dict[str, Any]:
    from coordinator.broker import MosquittoBroker
    from edge_sdk import topics
    from edge_sdk.auth import issue_keys

    work = Path(tempfile.mkdtemp(prefix="edgefl-flood-"))
    keys = issue_keys(work / "keys", ["c0", "c1", "c2"])

    def auth(pid: str) -> list[str]:
        return ["--set", f"auth.key_file={keys[pid]}", "--set", f"auth.roster={keys['roster']}"]

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: work / f"{name}.log" for name in ("coordinator", "c0", "c1")}
    out: dict[str, Any] = {"chunks": args.chunks, "logs": str(work)}
    with MosquittoBroker() as broker:
        common = ["--broker", broker.url, "--run-id", RUN]
        try:
            procs["coordinator"] = subprocess.Popen(
                [
                    EDGEFL,
                    "coordinator",
                    *common,
                    "--algorithm",
                    "fedavg",
                    "--clients",
                    "3",
                    "--rounds",
                    "2",
                    "--global-model",
                    "mlr",
                    "--out",
                    str(work / "out"),
                    "-v",
                    *SETS,
                    "--set",
                    "round.register_timeout_s=900",
                    *auth("coordinator"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=logs["coordinator"].open("w"),
            )
            for i in (0, 1):
                me = ["--id", f"c{i}", "--model", "mlr", "--index", str(i), "--clients", "3"]
                data = ["--dataset", "digits", "--partition", "iid", "--threads", "1"]
                procs[f"c{i}"] = subprocess.Popen(
                    [
                        EDGEFL,
                        "client",
                        *common,
                        *me,
                        *data,
                        "--state-dir",
                        str(work / f"c{i}"),
                        *SETS,
                        *auth(f"c{i}"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=logs[f"c{i}"].open("w"),
                )
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                text = logs["coordinator"].read_text()
                if "registered c0 (" in text and "registered c1 (" in text:
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"c0 and c1 did not register: see {work}")
            watched = {n: psutil.Process(procs[n].pid) for n in ("coordinator", "c0")}
            time.sleep(args.settle)
            out["rss_before_mb"] = _rss(watched)
            frames = flood_frames(args.chunks)
            peak = dict(out["rss_before_mb"])
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    for name, mb in _rss(watched).items():
                        peak[name] = max(peak[name], mb)
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            senders = {
                "coordinator": topics.up(RUN, "c0"),  # what the coordinator reassembles of c0
                "c0": topics.down(RUN, "c0"),  # what c0 reassembles of its coordinator
            }
            seconds = {}
            threads = []
            for name, topic in senders.items():

                def send(name: str = name, topic: str = topic) -> None:
                    seconds[name] = _publish_all(broker.url, topic, frames)

                threads.append(threading.Thread(target=send))
                threads[-1].start()
            for t in threads:
                t.join()
            out["publish_s"] = seconds
            time.sleep(5)  # what the broker still had queued
            out["rss_after_flood_mb"] = _rss(watched)
            time.sleep(args.expiry_wait)
            stop.set()
            sampler.join()
            out["rss_peak_mb"] = peak
            out["rss_after_expiry_mb"] = _rss(watched)
            out["expiry_wait_s"] = args.expiry_wait
            out["back_within"] = {
                n: out["rss_after_expiry_mb"][n] / out["rss_before_mb"][n] - 1 for n in watched
            }
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return out


def flood_table(f: dict[str, Any]) -> str:
    lines = [
        f"{f['chunks']:,} one-byte chunks at QoS 1 to each; RSS in MiB",
        "| process | before | peak | after the flood | after expiry | vs before |",
        "|---|---|---|---|---|---|",
    ]
    for n in f["rss_before_mb"]:
        lines.append(
            f"| {n} | {f['rss_before_mb'][n]:.0f} | {f['rss_peak_mb'][n]:.0f} | "
            f"{f['rss_after_flood_mb'][n]:.0f} | {f['rss_after_expiry_mb'][n]:.0f} | "
            f"{100 * f['back_within'][n]:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["attacks", "flood", "all"], default="all")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument(
        "--attacks", default=",".join(ATTACKS), help="comma-separated; also: reversed (×3)"
    )
    p.add_argument("--aggregators", default=",".join(AGGREGATORS))
    p.add_argument("--attackers", default="1,3", help="attackers of 10, comma-separated")
    p.add_argument("--trim", type=float, default=0.3, help="trimmed_mean's β")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--seeds", default="0", help="training seeds, comma-separated: accuracies are their mean"
    )
    p.add_argument("--defences", choices=["on", "off"], default="on")
    p.add_argument("--set", action="append", default=[], help="a run setting, e.g. robust.clip=2")
    p.add_argument("--chunks", type=int, default=300_000)
    p.add_argument("--settle", type=float, default=10.0, help="s before the first reading")
    p.add_argument("--expiry-wait", type=float, default=150.0, help="s after the flood")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--render", type=Path, help="print the tables of a JSON this wrote, run nothing")
    args = p.parse_args(argv)
    if args.render:
        kept = json.loads(args.render.read_text())
        if "attacks" in kept:
            print(attack_table(kept["attacks"]["rows"]))
        if "flood" in kept:
            print(flood_table(kept["flood"]))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("coordinator", "edge_sdk", "model_zoo"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    doc: dict[str, Any] = {
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
    }
    if args.part in ("attacks", "all"):
        doc["attacks"] = attacks_part(args)
    if args.part in ("flood", "all"):
        doc["flood"] = flood_part(args)
    ended(doc)
    print(save(doc, args.json_out))
    if "attacks" in doc:
        print(attack_table(doc["attacks"]["rows"]))
    if "flood" in doc:
        print(flood_table(doc["flood"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
