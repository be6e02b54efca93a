"""What MQTT costs: model delivery, bytes on the wire, and a whole FML round, side by side.

Three measurements, each run in this one process against a mosquitto started on loopback and
against the in-memory transport (the simulator's), so only ratios taken in the same run matter:

1. **Delivery.** A model of 1, 10 and 40 MB goes to 1, 5 and 20 clients the way the coordinator
   sends it (chunks once on the broadcast topic, then a small task per client that references
   them), each client reassembles and verifies it (sha256) and, once every client holds it (as
   after local training: the uploads do not compete with the delivery), answers with a model of
   the same size on its own up topic. `deliver_s`: until every client holds the verified model;
   `round_trip_s`: until the coordinator holds every reply. Next to it, **raw paho**: one paho
   publisher, n paho subscribers, the same bytes in 1 MiB QoS 1 chunks, no framing, no checksum
   — the floor the SDK is held to (goal: 40 MB to 20 clients within 1.5× of it), over MQTT 3.1.1
   (paho's default, as mqtt.md measured it) and over MQTT 5 (what the SDK speaks). The clients
   of both are threads of this one process; `*_cpu_s` is this process's CPU time meanwhile.
2. **Bytes on the wire per round** (what the coordinator's connection carries) for a 10-client
   LeNet5 FML round: global model once on the broadcast topic vs a copy per task (how the SDK
   sent it before the broadcast topic), client uploads in fp32 vs fp16.
3. **Round overhead.** The same 10-client LeNet5 FML rounds in memory and over mosquitto
   (clients as threads of this process in both); overhead = (mqtt − memory) / memory, median of
   rounds 2.. (round 1 warms up), at FML's default local budget and at a minimal one. Goal: ≤ 10 %.

    python benchmarks/transport.py                    # everything (a few minutes on 2 cores)
    python benchmarks/transport.py --quick            # 1 and 10 MB, 1 and 5 clients, 3 rounds
    python benchmarks/transport.py --json-out transport.json
    python benchmarks/transport.py --parts delivery --sizes 40 --clients 20 --repeat 3

Prints one JSON object, then tables.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import paho.mqtt.client as mqtt
import torch
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import MosquittoBroker
from coordinator.config import load_config
from coordinator.simulator import prepare_federation, run_federation
from edge_sdk import topics
from edge_sdk.protocol import BlobRef, ModelRef, Reply, Task
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import BrokerSettings, MqttTransport
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec

MB = 1024 * 1024
RUN = "bench"
SPEC = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))  # the refs' label only


# -- 1. delivery -------------------------------------------------------------------------------
def _connect(kind: str, url: str | None, memory: InMemoryBroker, who: str) -> Transport:
    if kind == "memory":
        return memory.connect(who, max_payload_bytes=2 * MB)
    settings = BrokerSettings(url=url, ack_timeout_s=600)
    return MqttTransport(settings, f"{who}-{uuid.uuid4().hex[:6]}").connect(30)


def bench_delivery(kind: str, url: str | None, size: int, n: int) -> dict[str, Any]:
    memory = InMemoryBroker()
    payload = os.urandom(size)
    ref = BlobRef(
        id=uuid.uuid4().hex, sha256=hashlib.sha256(payload).hexdigest(), size=size, shared=True
    )
    coord_t = _connect(kind, url, memory, "coordinator")
    coord = Endpoint(
        coord_t, topics.up_all(RUN), max_blob_bytes=2 * size, max_total_pending_bytes=4 * n * size
    ).open()
    clients = []
    for i in range(n):
        t = _connect(kind, url, memory, f"c{i}")
        ep = Endpoint(
            t,
            [topics.down(RUN, f"c{i}"), topics.bcast(RUN)],
            shared_topic=topics.bcast(RUN),
            max_blob_bytes=2 * size,
        ).open()
        clients.append((f"c{i}", t, ep))
    delivered: list[float] = []
    cpu: list[float] = []
    lock = threading.Lock()
    all_delivered = threading.Barrier(n)

    def serve(cid: str, ep: Endpoint) -> None:
        env = ep.receive(timeout=600)  # verified against the sha256 in the task's BlobRef
        with lock:
            delivered.append(time.perf_counter())
            cpu.append(time.process_time())
        # Replies wait until every client holds the model, as they would after local training:
        # the delivery is timed without 20 uploads of the same size competing with it.
        all_delivered.wait()
        assert env is not None and env.blobs[ref.id] == payload  # and byte for byte, untimed
        back = BlobRef(id=f"r-{cid}", sha256=ref.sha256, size=size)
        reply = Reply(
            run=RUN,
            sender=cid,
            task_id=cid,
            round=1,
            phase="fit",
            ok=True,
            models={"m": ModelRef(spec=SPEC, blob=back)},
        )
        ep.send(topics.up(RUN, cid), reply, {back.id: payload})

    threads = [threading.Thread(target=serve, args=(cid, ep)) for cid, _, ep in clients]
    for th in threads:
        th.start()
    t0, c0 = time.perf_counter(), time.process_time()
    # As the coordinator does (server.py): the broadcast acknowledged, then every task sent
    # before waiting for their acknowledgements.
    coord.wait(coord.publish_blobs(topics.bcast(RUN), {ref.id: payload}))
    sent = []
    for cid, _, _ in clients:
        task = Task(
            run=RUN,
            sender="coordinator",
            task_id=cid,
            round=1,
            rounds=1,
            phase="fit",
            algorithm="fml",
            models={"m": ModelRef(spec=SPEC, blob=ref)},
        )
        sent += coord.send(topics.down(RUN, cid), task, wait=False)
    coord.wait(sent)
    for _ in range(n):
        assert coord.receive(timeout=600) is not None
    t1 = time.perf_counter()
    for th in threads:
        th.join()
    bytes_out, bytes_in = coord_t.stats.bytes_out, coord_t.stats.bytes_in
    for _, t, ep in clients:
        ep.close()
        t.close()
    coord.close()
    coord_t.close()
    return {
        "transport": kind,
        "size_mb": size / MB,
        "clients": n,
        "deliver_s": max(delivered) - t0,
        "deliver_cpu_s": max(cpu) - c0,
        "round_trip_s": t1 - t0,
        "coordinator_bytes_out": bytes_out,
        "coordinator_bytes_in": bytes_in,
    }


def bench_raw_paho(
    url: str, size: int, n: int, protocol: str = "3.1.1", keep: bool = False
) -> dict[str, Any]:
    """The floor: paho alone, 1 MiB QoS 1 chunks, n subscribers, until all hold every byte.

    `protocol` "3.1.1" is paho's default (how mqtt.md measured its 1.13 s); "5" is what the SDK
    speaks, and paho's MQTT 5 decoding copies each payload twice more. Without `keep` each
    subscriber only counts the bytes and drops them; with it, it does the least that a receiver
    that uses the model must do: append every payload to one buffer and hash it (sha256).
    """
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    version = mqtt.MQTTv5 if protocol == "5" else mqtt.MQTTv311
    got = [0] * n
    kept = [bytearray() for _ in range(n)]
    hashes = [hashlib.sha256() for _ in range(n)]
    done = threading.Event()
    topic = f"raw/{uuid.uuid4().hex[:6]}"
    subs = []
    for i in range(n):
        c = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"raw-sub-{i}-{topic[-6:]}", protocol=version
        )
        c.max_inflight_messages_set(100)

        def on_message(client: Any, userdata: Any, msg: Any, i: int = i) -> None:
            got[i] += len(msg.payload)
            if keep:
                kept[i] += msg.payload
                hashes[i].update(msg.payload)
            if all(g >= size for g in got):
                done.set()

        c.on_message = on_message
        c.connect(host, int(port))
        c.subscribe(topic, qos=1)
        c.loop_start()
        subs.append(c)
    time.sleep(0.5)  # let every SUBACK land
    pub = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"raw-pub-{topic[-6:]}", protocol=version
    )
    pub.max_inflight_messages_set(100)
    pub.connect(host, int(port))
    pub.loop_start()
    payload = os.urandom(size)
    t0, c0 = time.perf_counter(), time.process_time()
    infos = [pub.publish(topic, payload[i : i + MB], qos=1) for i in range(0, size, MB)]
    for info in infos:
        info.wait_for_publish(600)
    done.wait(600)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    for c in [pub, *subs]:
        c.loop_stop()
        c.disconnect()
    return {"size_mb": size / MB, "clients": n, "raw_paho_s": elapsed, "cpu_s": cpu}


# -- 2 and 3. a real FML round -------------------------------------------------------------------
# Two local budgets for the same 10-client LeNet5 FML round: FML's defaults (E = 5 epochs,
# batch 128, algorithms.md) on 1200 samples per client, and a minimal one (1 epoch, batch 32,
# 600 samples per client) where the round is short and the transport's share largest.
BUDGETS: dict[str, dict[str, Any]] = {
    "fml_defaults": {"max_samples": 12000, "training": {}},
    "minimal": {"max_samples": 6000, "training": {"local_epochs": 1, "batch_size": 32}},
}


def _round_config(rounds: int, url: str | None, budget: str) -> Any:
    dataset = "fashion_mnist" if os.path.exists("/usr/share/datasets/fashion-mnist") else "digits"
    flags: dict[str, Any] = {
        "algorithm": "fml",
        "data.dataset": dataset,
        "data.max_samples": BUDGETS[budget]["max_samples"],
        "data.partition": "iid",
        "models": ["lenet5"],
        "clients": 10,
        "rounds": rounds,
        "device": "cpu",
        "round.deadline_s": 600,
        "broker.url": url,
    }
    if dataset == "digits":
        flags["data.options"] = {"size": 28}
    training = {"lr": 0.05, **BUDGETS[budget]["training"]}
    return load_config(None, flags, training=training, environ=False)


def bench_round(
    url: str | None, rounds: int, budget: str = "minimal", **settings: Any
) -> dict[str, Any]:
    """FML rounds through the simulator's own path; coordinator traffic from its RunResult."""
    cfg = _round_config(rounds, url, budget).model_copy(update=settings)
    result = run_federation(cfg, prepare_federation(cfg), "fml")
    secs = [r.seconds for r in result.rounds]
    return {
        "transport": "memory" if url is None else "mosquitto",
        "budget": budget,
        "dataset": cfg.data.dataset,
        "round_seconds": secs,
        "median_round_s": statistics.median(secs[1:] if len(secs) > 1 else secs),
        # registration and the finalize phase ride along; spread over the rounds
        "bytes_per_round": (result.bytes_out + result.bytes_in) / rounds,
        "mean_personal_acc": result.rounds[-1].mean_personal_acc,
    }


def delivery_row(url: str, size: int, n: int) -> dict[str, Any]:
    """One size x clients: in memory, the SDK over mosquitto, raw paho over MQTT 3.1.1 and 5."""
    mem = bench_delivery("memory", None, size, n)
    mq = bench_delivery("mosquitto", url, size, n)
    raw = bench_raw_paho(url, size, n)
    raw5 = bench_raw_paho(url, size, n, protocol="5")
    kept = bench_raw_paho(url, size, n, protocol="5", keep=True)
    return {
        "size_mb": size / MB,
        "clients": n,
        "memory_deliver_s": mem["deliver_s"],
        "memory_round_trip_s": mem["round_trip_s"],
        "mqtt_deliver_s": mq["deliver_s"],
        "mqtt_round_trip_s": mq["round_trip_s"],
        "raw_paho_deliver_s": raw["raw_paho_s"],
        "raw_paho_v5_deliver_s": raw5["raw_paho_s"],
        "mqtt_vs_raw": mq["deliver_s"] / raw["raw_paho_s"],
        "mqtt_vs_raw_v5": mq["deliver_s"] / raw5["raw_paho_s"],
        # raw paho over MQTT 5 that keeps and hashes what it receives, as the SDK must
        "raw_paho_v5_keep_deliver_s": kept["raw_paho_s"],
        "mqtt_vs_raw_v5_keep": mq["deliver_s"] / kept["raw_paho_s"],
        # CPU time of this process (all its threads) while delivering
        "mqtt_deliver_cpu_s": mq["deliver_cpu_s"],
        "raw_paho_cpu_s": raw["cpu_s"],
        "raw_paho_v5_cpu_s": raw5["cpu_s"],
        "raw_paho_v5_keep_cpu_s": kept["cpu_s"],
        "coordinator_bytes_out": mq["coordinator_bytes_out"],
    }


def bench_rounds(url: str, rounds: int) -> dict[str, Any]:
    print("FML rounds: memory, mosquitto, per-task copies, fp16 uploads ...", file=sys.stderr)
    overhead = {}
    for budget in BUDGETS:
        memory = bench_round(None, rounds, budget)
        mqtt_round = bench_round(url, rounds, budget)
        overhead[budget] = {
            "memory": memory,
            "mosquitto": mqtt_round,
            "overhead_s": mqtt_round["median_round_s"] - memory["median_round_s"],
            "overhead": mqtt_round["median_round_s"] / memory["median_round_s"] - 1,
        }
    shared = bench_round(url, 2)
    copies = bench_round(url, 2, broadcast=False)
    fp16 = bench_round(url, 2, fp16_upload=True)
    return {
        "overhead": overhead,
        "bytes_per_round": {
            "broadcast_fp32": shared["bytes_per_round"],
            "copy_per_task_fp32": copies["bytes_per_round"],
            "broadcast_fp16_uploads": fp16["bytes_per_round"],
        },
    }


def print_delivery(rows: list[dict[str, Any]]) -> None:
    print(f"{'MB':>5} {'clients':>7} {'memory s':>9} {'mqtt s':>8} {'raw 3.1.1 s':>11} "
          f"{'raw v5 s':>8} {'keep v5 s':>9} {'mqtt/raw':>8} {'mqtt/raw v5':>11} "
          f"{'mqtt/keep v5':>12} {'cpu mqtt/raw':>12} {'mqtt rt s':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['size_mb']:>5.0f} {r['clients']:>7} {r['memory_deliver_s']:>9.3f} "
            f"{r['mqtt_deliver_s']:>8.3f} {r['raw_paho_deliver_s']:>11.3f} "
            f"{r['raw_paho_v5_deliver_s']:>8.3f} {r['raw_paho_v5_keep_deliver_s']:>9.3f} "
            f"{r['mqtt_vs_raw']:>8.2f} {r['mqtt_vs_raw_v5']:>11.2f} "
            f"{r['mqtt_vs_raw_v5_keep']:>12.2f} "
            f"{r['mqtt_deliver_cpu_s'] / r['raw_paho_cpu_s']:>12.2f} "
            f"{r['mqtt_round_trip_s']:>9.3f}"
        )


def print_rounds(rr: dict[str, Any]) -> None:
    for budget, o in rr["overhead"].items():
        m, q = o["memory"], o["mosquitto"]
        print(
            f"FML round, 10 clients, LeNet5 ({m['dataset']}, {budget}): memory "
            f"{m['median_round_s']:.2f} s, mosquitto {q['median_round_s']:.2f} s, overhead "
            f"{o['overhead_s']:+.2f} s ({100 * o['overhead']:+.1f}%)"
        )
    b = rr["bytes_per_round"]
    print(
        f"bytes per round at the coordinator: broadcast {b['broadcast_fp32'] / MB:.2f} MB, "
        f"copy per task {b['copy_per_task_fp32'] / MB:.2f} MB, "
        f"broadcast + fp16 uploads {b['broadcast_fp16_uploads'] / MB:.2f} MB"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,40", help="model sizes in MB")
    p.add_argument("--clients", default="1,5,20", help="client counts")
    p.add_argument("--rounds", type=int, default=5, help="FML rounds for the overhead")
    p.add_argument("--quick", action="store_true", help="1,10 MB x 1,5 clients, 3 rounds")
    p.add_argument(
        "--parts", default="delivery,rounds", help="which parts: delivery, rounds (comma-separated)"
    )
    p.add_argument("--repeat", type=int, default=1, help="measure each delivery row this often")
    p.add_argument("--json-out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.clients, args.rounds = "1,10", "1,5", 3
    sizes = [int(float(s) * MB) for s in args.sizes.split(",")]
    counts = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "paho": importlib.metadata.version("paho-mqtt"),
            "load_avg": os.getloadavg(),
        },
        "delivery": [],
        "rounds": {},
    }
    parts = set(args.parts.split(","))
    if not parts <= {"delivery", "rounds"}:
        p.error(f"--parts: unknown part(s) {sorted(parts - {'delivery', 'rounds'})}")
    with MosquittoBroker() as broker:
        if "delivery" in parts:
            for size in sizes:
                for n in counts:
                    for _ in range(args.repeat):
                        print(f"delivery {size // MB} MB x {n} ...", file=sys.stderr)
                        report["delivery"].append(delivery_row(broker.url, size, n))
        if "rounds" in parts:
            report["rounds"] = bench_rounds(broker.url, args.rounds)
    report["machine"]["load_avg_after"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print()
    if report["delivery"]:
        print_delivery(report["delivery"])
    if report["rounds"]:
        print_rounds(report["rounds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
