"""The SDK on a clustered broker: a 3-node RabbitMQ cluster on this machine (rabbitmq_cluster.py),
devices spread over the nodes' MQTT listeners, the coordinator on node 0.

1. **Features across nodes**, with raw paho clients (MQTT 3.1.1, QoS 1): a retained message read
   on the node it was published on and on another; a retained message under a wildcard filter
   (how the SDK reads the chunks of a retained publication); a live message, a will and a
   persistent session moved from one node to another; a 1 MiB message; an MQTT 5 CONNECT.
2. **Federations**, as a deployment runs them (`edgefl coordinator` and three `edgefl client`
   processes, signed): FML (3 clients, mlr/mlp/cnn1 on 8×8 digits, 2 rounds; the deployment
   tests' federation) with the clients on nodes 0, 1, 2, compared with the same federation
   simulated in one process (which a one-broker deployment equals, tests/coordinator/
   test_deploy.py); FedeRiCo the same way, and with every client on node 0.

Skips with the reason (exit 0) where `rabbitmq-server` is not installed.

    python benchmarks/broker_cluster.py --json-out benchmarks/results/broker_cluster.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, machine
from rabbitmq_cluster import RabbitCluster, rabbitmq_missing

from coordinator.config import load_config
from coordinator.results_model import Results
from coordinator.simulator import simulate
from edge_sdk.auth import issue_keys

EDGEFL = str(Path(sys.executable).parent / "edgefl")
ARCHS = ["mlr", "mlp", "cnn1"]
DATA = ["--dataset", "digits", "--max-samples", "800", "--partition", "iid", "--clients", "3"]
SETS = ["--set", 'data.options={"size": 8}', "--set", "device=cpu"]
RUNS = {
    "fml": ["--algorithm", "fml", "--global-model", "mlr", "--local-epochs", "2", "--lr", "0.1"],
    "federico": ["--algorithm", "federico", "--set", "federico.lr=0.01"],
}


# -- 1. features --------------------------------------------------------------------------------
class Probe:
    """A paho MQTT 3.1.1 client on one node that records what it receives."""

    def __init__(self, port: int, *, cid: str | None = None, clean: bool = True, will=None):
        self.got: list[tuple[str, bytes, bool]] = []
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=cid or uuid.uuid4().hex[:12],
            protocol=mqtt.MQTTv311,
            clean_session=clean,
        )
        self.client.on_message = lambda c, u, m: self.got.append((m.topic, m.payload, m.retain))
        connected = threading.Event()
        self.client.on_connect = lambda c, u, f, reason, p: connected.set()
        if will is not None:
            self.client.will_set(will, b"gone", qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        if not connected.wait(10):  # the will counts once the broker accepted the CONNECT
            raise RuntimeError(f"no CONNACK from 127.0.0.1:{port}")

    def sub(self, flt: str, wait: float = 1.5) -> list[tuple[str, bytes, bool]]:
        self.client.subscribe(flt, qos=1)
        time.sleep(wait)
        return self.got

    def pub(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def close(self, clean: bool = True) -> None:
        if clean:
            self.client.disconnect()
        else:
            self.client.socket().close()  # a crash: the broker publishes the will
        self.client.loop_stop()


def mqtt5_accepted(port: int) -> bool:
    answered: list[Any] = []
    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.on_connect = lambda c_, u, f, reason, p: answered.append(reason)
    try:
        c.connect("127.0.0.1", port)
        c.loop_start()
        time.sleep(1.5)
    except OSError:
        return False
    finally:
        c.loop_stop()
    return bool(answered) and not answered[0].is_failure


def features(ports: list[int]) -> dict[str, bool]:
    t = f"edgefl/probe-{uuid.uuid4().hex[:6]}"
    a, b = ports[0], ports[1]
    pub = Probe(a)
    pub.pub(f"{t}/status", b"S", retain=True)
    pub.pub(f"{t}/pub/m/0", b"chunk", retain=True)
    time.sleep(0.5)
    out = {
        "retained_same_node": bool(Probe(a).sub(f"{t}/status")),
        "retained_other_node": bool(Probe(b).sub(f"{t}/status")),
        "retained_wildcard_same_node": bool(Probe(a).sub(f"{t}/pub/m/+")),
    }
    live = Probe(b)
    live.sub(f"{t}/live", 0.5)
    pub.pub(f"{t}/live", b"L")
    time.sleep(0.5)
    out["live_qos1_other_node"] = bool(live.got)
    watcher = Probe(a)
    watcher.sub(f"{t}/will", 0.5)
    Probe(ports[2], will=f"{t}/will").close(clean=False)
    time.sleep(2)
    out["will_other_node"] = bool(watcher.got)
    cid = f"edgefl-persist-{uuid.uuid4().hex[:6]}"
    away = Probe(ports[2], cid=cid, clean=False)
    away.sub(f"{t}/queued", 0.5)
    away.close()
    pub.pub(f"{t}/queued", b"Q")
    back = Probe(b, cid=cid, clean=False)
    time.sleep(1.5)
    out["persistent_session_moved_node"] = bool(back.got)
    big = Probe(ports[2])
    big.sub(f"{t}/big", 0.5)
    pub.pub(f"{t}/big", b"x" * (1 << 20))
    time.sleep(1.5)
    out["message_1mib_other_node"] = len(big.got) == 1
    out["mqtt5"] = mqtt5_accepted(a)
    return out


# -- 2. federations ----------------------------------------------------------------------------
def deploy(urls: list[str], algorithm: str, timeout: float) -> dict[str, Any]:
    """`edgefl coordinator` on urls[0], client ci on urls[1 + i]; exit codes, wall time, the
    results' accuracies and the lines that say what went wrong."""
    with tempfile.TemporaryDirectory(prefix="edgefl-cluster-") as tmp:
        return _deploy(Path(tmp), urls, algorithm, timeout)


def _deploy(tmp: Path, urls: list[str], algorithm: str, timeout: float) -> dict[str, Any]:
    keys = issue_keys(tmp / "keys", [f"c{i}" for i in range(3)])
    auth = {
        pid: ["--set", f"auth.key_file={keys[pid]}", "--set", f"auth.roster={keys['roster']}"]
        for pid in ["coordinator", "c0", "c1", "c2"]
    }
    run_id = f"cluster-{algorithm}-{uuid.uuid4().hex[:4]}"
    on = [["--broker", url, "--run-id", run_id] for url in urls]
    run = ["--clients", "3", "--rounds", "2", "--batch-size", "32", *RUNS[algorithm]]
    cmds = [[EDGEFL, "coordinator", *on[0], *run, "--out", str(tmp / "out"), *SETS]]
    cmds[0] += auth["coordinator"]
    for i, arch in enumerate(ARCHS):
        me = ["--id", f"c{i}", "--model", arch, "--index", str(i), "--seed", "0", "--threads", "1"]
        extra = ["--deploy", "any"] if algorithm == "federico" else []
        state = ["--state-dir", str(tmp / f"state{i}"), *SETS, *extra, *auth[f"c{i}"]]
        cmds.append([EDGEFL, "client", *on[1 + i], *me, *DATA, *state])
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    logs, codes = [], []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, t0 + timeout - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
        codes.append(p.returncode)
    out: dict[str, Any] = {"exit_codes": codes, "wall_s": round(time.monotonic() - t0, 1)}
    results = tmp / "out" / "results.json"
    if results.exists():
        res = Results.read(results)
        out["personal_acc"] = [c.personal_acc for c in res.clients]
        out["outcome"] = res.summary.outcome
    notes = [
        line.strip()
        for log in logs
        for line in log.splitlines()
        if "RetainedNotDelivered" in line or "retained publication" in line
    ]
    out["errors"] = sorted(set(notes))[:3]
    return out


def simulated(algorithm: str) -> list[float | None]:
    """The same federation in one process (what a one-broker deployment ends with)."""
    flags: dict[str, Any] = {
        "algorithm": algorithm,
        "data.dataset": "digits",
        "data.options": {"size": 8},
        "data.max_samples": 800,
        "data.partition": "iid",
        "models": ARCHS,
        "clients": 3,
        "rounds": 2,
        "device": "cpu",
    }
    overrides: dict[str, Any] = {}
    training: dict[str, Any] = {}
    if algorithm == "fml":
        flags["global_model"] = "mlr"
        training = {"local_epochs": 2, "batch_size": 32, "lr": 0.1}
    else:
        overrides = {"federico": {"lr": 0.01, "batch_size": 32}, "deploy": {"allow": ["any"]}}
    cfg = load_config(None, flags, overrides, training=training)
    return [c.personal_acc for c in simulate(cfg, progress=False).clients]


def tables(out: dict[str, Any]) -> str:
    if "skipped" in out:
        return f"skipped: {out['skipped']}"
    lines = ["| across a 3-node RabbitMQ 3.10 cluster | works |", "|---|---|"]
    lines += [
        f"| {k.replace('_', ' ')} | {'yes' if v else '**no**'} |"
        for k, v in out["features"].items()
    ]
    lines += [
        "",
        "| federation | clients on nodes | exit codes (coordinator, c0-c2) | wall s | "
        "accuracies | one broker | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in out["federations"].items():
        acc = r.get("personal_acc")
        same = "yes" if acc is not None and acc == r["simulated"] else "no"
        show = ", ".join(f"{a:.3f}" for a in acc) if acc else "—"
        ref = ", ".join(f"{a:.3f}" for a in r["simulated"])
        lines.append(
            f"| {name} | {r['nodes']} | {r['exit_codes']} | {r['wall_s']} | {show} "
            f"| {ref} | {same} |"
        )
    errors = {e for r in out["federations"].values() for e in r["errors"]}
    return "\n".join([*lines, "", *sorted(errors)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="per federation, seconds")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    out: dict[str, Any] = {"machine": machine()}
    why = rabbitmq_missing()
    if why is not None:
        out["skipped"] = why
        emit(out, a.json_out, tables)
        return 0
    with RabbitCluster(a.nodes) as cluster:
        out["cluster"] = {"nodes": cluster.running_nodes(), "start_s": cluster.start_s}
        out["features"] = features(cluster.mqtt_ports)
        spread = [cluster.urls[0], *(cluster.urls[i % a.nodes] for i in range(3))]
        one = [cluster.urls[0]] * 4
        out["federations"] = {}
        for name, algorithm, urls in [
            ("fml", "fml", spread),
            ("federico", "federico", spread),
            ("federico, one node", "federico", one),
        ]:
            r = deploy(urls, algorithm, a.timeout)
            r["nodes"] = ", ".join(str(cluster.urls.index(u)) for u in urls[1:])
            r["simulated"] = simulated(algorithm)
            out["federations"][name] = r
    emit(out, a.json_out, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
