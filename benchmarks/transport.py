"""What MQTT costs: model delivery, bytes on the wire, and a whole FML round, side by side.

Three measurements, each run from this one process against a mosquitto started on loopback and
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
   **Processes** (`--parts processes`): the same delivery with every receiver a process of its
   own, as on devices: the SDK as `edgefl client` runs it (glibc's allocator tuned,
   edge_sdk.malloc) and untuned, against raw paho subscriber processes. `*_cpu_s` there is the
   receivers' CPU time until each held the model.
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
    python benchmarks/transport.py --parts processes --sizes 40 --clients 20 --repeat 3

Prints one JSON object, then tables.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import torch
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import ended, machine, save

from coordinator.broker import MosquittoBroker
from coordinator.config import load_config
from coordinator.federation import prepare_federation
from coordinator.simulator import run_federation
from edge_sdk import topics
from edge_sdk.malloc import tune_for_streams
from edge_sdk.protocol import BlobRef, ModelRef, Reply, Task
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import BrokerSettings, MqttTransport
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec

MB = 1024 * 1024
RUN = "bench"
SPEC = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))  # the refs' label only
SETTLE_S = 2.0
MQTT_MD_RAW_S = 1.13  # mqtt.md: raw paho, 40 MB in 1 MiB QoS 1 chunks to 20 subscribers


# -- 1. delivery -------------------------------------------------------------------------------
def _payload(size: int, seed: int) -> bytes:
    """The model's bytes, the same in every process that is given the same seed."""
    return random.Random(seed).randbytes(size)


def _blob_ref(payload: bytes, seed: int) -> BlobRef:
    sha = hashlib.sha256(payload).hexdigest()
    return BlobRef(id=f"model-{seed}", sha256=sha, size=len(payload), shared=True)


def _connect(kind: str, url: str | None, memory: InMemoryBroker | None, who: str) -> Transport:
    if kind == "memory":
        assert memory is not None
        return memory.connect(who, max_payload_bytes=2 * MB)
    settings = BrokerSettings(url=url, ack_timeout_s=600)
    return MqttTransport(settings, f"{who}-{uuid.uuid4().hex[:6]}").connect(30)


def _receiver(
    kind: str, url: str | None, memory: InMemoryBroker | None, cid: str, size: int
) -> tuple[Transport, Endpoint]:
    """A client's connection, subscribed as EdgeClient subscribes (its down topic, broadcast)."""
    t = _connect(kind, url, memory, cid)
    topics_ = [topics.down(RUN, cid), topics.bcast(RUN)]
    ep = Endpoint(t, topics_, shared_topic=topics.bcast(RUN), max_blob_bytes=2 * size).open()
    return t, ep


def _serve(
    cid: str, ep: Endpoint, ref: BlobRef, payload: bytes, stamp: Any, all_delivered: Any
) -> None:
    """One client: receive the task and its model, `stamp()`, and once every client holds the
    model (as after local training: the replies do not compete with the delivery), reply with
    a model of the same size."""
    env = ep.receive(timeout=600)  # verified against the sha256 in the task's BlobRef
    stamp()
    all_delivered.wait()
    assert env is not None and env.blobs[ref.id] == payload  # and byte for byte, untimed
    back = BlobRef(id=f"r-{cid}", sha256=ref.sha256, size=ref.size)
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


def _coordinate(coord: Endpoint, ref: BlobRef, payload: bytes, n: int) -> float:
    """As the coordinator does (server.py): the broadcast acknowledged, then every task sent
    before waiting for their acknowledgements; returns when every reply is in."""
    coord.wait(coord.publish_blobs(topics.bcast(RUN), {ref.id: payload}))
    sent = []
    for i in range(n):
        task = Task(
            run=RUN,
            sender="coordinator",
            task_id=f"c{i}",
            round=1,
            rounds=1,
            phase="fit",
            algorithm="fml",
            models={"m": ModelRef(spec=SPEC, blob=ref)},
        )
        sent += coord.send(topics.down(RUN, f"c{i}"), task, wait=False)
    coord.wait(sent)
    for _ in range(n):
        assert coord.receive(timeout=600) is not None
    return time.perf_counter()


def _coordinator(
    kind: str, url: str | None, memory: InMemoryBroker | None, size: int, n: int
) -> tuple[Transport, Endpoint]:
    t = _connect(kind, url, memory, "coordinator")
    pending = 4 * n * size  # every reply in flight at once
    ep = Endpoint(t, topics.up_all(RUN), max_blob_bytes=2 * size, max_total_pending_bytes=pending)
    return t, ep.open()


def bench_delivery(kind: str, url: str | None, size: int, n: int, seed: int = 0) -> dict[str, Any]:
    """The clients are threads of this process; `deliver_cpu_s` is this process's CPU time."""
    memory = InMemoryBroker()
    payload = _payload(size, seed)
    ref = _blob_ref(payload, seed)
    coord_t, coord = _coordinator(kind, url, memory, size, n)
    clients = [(f"c{i}", *_receiver(kind, url, memory, f"c{i}", size)) for i in range(n)]
    delivered: list[tuple[float, float]] = []
    all_delivered = threading.Barrier(n)

    def stamp() -> None:
        delivered.append((time.perf_counter(), time.process_time()))  # list.append is atomic

    threads = [
        threading.Thread(target=_serve, args=(cid, ep, ref, payload, stamp, all_delivered))
        for cid, _, ep in clients
    ]
    for th in threads:
        th.start()
    t0, c0 = time.perf_counter(), time.process_time()
    t1 = _coordinate(coord, ref, payload, n)
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
        "deliver_s": max(d[0] for d in delivered) - t0,
        "deliver_cpu_s": max(d[1] for d in delivered) - c0,
        "round_trip_s": t1 - t0,
        "coordinator_bytes_out": bytes_out,
        "coordinator_bytes_in": bytes_in,
    }


# Receivers as processes: forked from a server process that has imported this module (and so
# torch, paho and the SDK) once, not from this process and its threads. perf_counter is
# CLOCK_MONOTONIC on Linux, one clock for every process of the machine.
@functools.cache
def _forks() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__"])
    return ctx


def _sdk_process(
    url: str, cid: str, size: int, seed: int, tune: bool, ready: Any, out: Any, barrier: Any
) -> None:
    if tune:
        tune_for_streams()  # as the edgefl commands do (broker.tune_malloc, on by default)
    payload = _payload(size, seed)
    t, ep = _receiver("mosquitto", url, None, cid, size)
    ready.put(cid)
    c0 = time.process_time()

    def stamp() -> None:
        out.put((time.perf_counter(), time.process_time() - c0))

    _serve(cid, ep, _blob_ref(payload, seed), payload, stamp, barrier)
    ep.close()
    t.close()


def bench_delivery_processes(
    url: str, size: int, n: int, *, tune: bool = True, seed: int = 1
) -> dict[str, Any]:
    """The SDK's clients as n processes (as devices run them), the coordinator in this one.
    `tune`: the clients tune glibc's allocator as `edgefl client` does (edge_sdk.malloc).
    `deliver_cpu_s`: the clients' CPU time until each held the model (not the sender's)."""
    ctx = _forks()
    ready, out, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(n)
    procs = [
        ctx.Process(target=_sdk_process, args=(url, f"c{i}", size, seed, tune, ready, out, barrier))
        for i in range(n)
    ]
    for pr in procs:
        pr.start()
    payload = _payload(size, seed)
    ref = _blob_ref(payload, seed)
    coord_t, coord = _coordinator("mosquitto", url, None, size, n)
    for _ in range(n):
        ready.get(timeout=300)
    t0 = time.perf_counter()
    t1 = _coordinate(coord, ref, payload, n)
    stamps = [out.get(timeout=600) for _ in range(n)]
    for pr in procs:
        pr.join(60)
    coord.close()
    coord_t.close()
    return {
        "size_mb": size / MB,
        "clients": n,
        "deliver_s": max(s[0] for s in stamps) - t0,
        "deliver_cpu_s": sum(s[1] for s in stamps),
        "round_trip_s": t1 - t0,
    }


def _raw_subscriber(
    url: str, i: int, topic: str, protocol: str, size: int, keep: bool
) -> tuple[Any, threading.Event]:
    """A paho subscriber on `topic`; its event is set once it has `size` bytes. Without `keep`
    it counts the bytes and drops them; with it, it does the least that a receiver that uses the
    model must do: append every payload to one buffer and hash it (sha256)."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    version = mqtt.MQTTv5 if protocol == "5" else mqtt.MQTTv311
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"raw-sub-{i}-{topic[-6:]}", protocol=version
    )
    c.max_inflight_messages_set(100)
    got, kept, digest = [0], bytearray(), hashlib.sha256()
    subscribed, done = threading.Event(), threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        got[0] += len(msg.payload)
        if keep:
            kept.extend(msg.payload)
            digest.update(msg.payload)
        if got[0] >= size:
            done.set()

    c.on_message = on_message
    c.on_subscribe = lambda *_: subscribed.set()
    c.connect(host, int(port))
    c.loop_start()
    c.subscribe(topic, qos=1)
    if not subscribed.wait(30):
        raise RuntimeError(f"raw subscriber {i}: no SUBACK")
    return c, done


def _raw_process(
    url: str, i: int, topic: str, protocol: str, size: int, keep: bool, ready: Any, out: Any
) -> None:
    c, done = _raw_subscriber(url, i, topic, protocol, size, keep)
    ready.put(i)
    c0 = time.process_time()
    done.wait(600)
    out.put((time.perf_counter(), time.process_time() - c0))
    c.loop_stop()
    c.disconnect()


def bench_raw_paho(
    url: str,
    size: int,
    n: int,
    protocol: str = "3.1.1",
    keep: bool = False,
    processes: bool = False,
) -> dict[str, Any]:
    """The floor: paho alone, 1 MiB QoS 1 chunks, no framing, no checksum, n subscribers
    (threads of this process, or `processes`), until all hold every byte. `protocol` "3.1.1" is
    paho's default (how mqtt.md measured its 1.13 s); "5" is what the SDK speaks, and paho's
    MQTT 5 decoding copies each payload twice more. `keep`: see `_raw_subscriber`. `cpu_s`: this
    process's CPU time meanwhile, or with `processes` the subscribers' until each had it all."""
    topic = f"raw/{uuid.uuid4().hex[:6]}"
    if processes:
        ctx = _forks()
        ready, out = ctx.Queue(), ctx.Queue()
        args = (url, topic, protocol, size, keep, ready, out)
        procs = [ctx.Process(target=_raw_process, args=(url, i, *args[1:])) for i in range(n)]
        for pr in procs:
            pr.start()
        for _ in procs:
            ready.get(timeout=300)
    else:
        subs = [_raw_subscriber(url, i, topic, protocol, size, keep) for i in range(n)]
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    version = mqtt.MQTTv5 if protocol == "5" else mqtt.MQTTv311
    pub = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"raw-pub-{topic[-6:]}", protocol=version
    )
    pub.max_inflight_messages_set(100)
    pub.connect(host, int(port))
    pub.loop_start()
    payload = _payload(size, 2)
    t0, c0 = time.perf_counter(), time.process_time()
    infos = [pub.publish(topic, payload[i : i + MB], qos=1) for i in range(0, size, MB)]
    for info in infos:
        info.wait_for_publish(600)
    if processes:
        stamps = [out.get(timeout=600) for _ in procs]
        elapsed = max(s[0] for s in stamps) - t0
        cpu = sum(s[1] for s in stamps)
        for pr in procs:
            pr.join(60)
    else:
        for _, done in subs:
            done.wait(600)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        for c, _ in subs:
            c.loop_stop()
            c.disconnect()
    pub.loop_stop()
    pub.disconnect()
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
        "fleet": "network",  # every model through the transport, in memory or over the broker
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
        **_against_floors(size, n, mq, raw, raw5, kept),
        "memory_deliver_s": mem["deliver_s"],
        "memory_round_trip_s": mem["round_trip_s"],
        "coordinator_bytes_out": mq["coordinator_bytes_out"],
    }


def _against_floors(
    size: int,
    n: int,
    sdk: dict[str, Any],
    raw: dict[str, Any],
    raw5: dict[str, Any],
    kept: dict[str, Any],
) -> dict[str, Any]:
    """A row's SDK figures next to the raw-paho floors: over MQTT 3.1.1, over MQTT 5, and over
    MQTT 5 keeping and hashing what it receives, as the SDK must. The CPU times are the
    receivers' (threads: this whole process's) while delivering."""
    return {
        "size_mb": size / MB,
        "clients": n,
        "mqtt_deliver_s": sdk["deliver_s"],
        "mqtt_round_trip_s": sdk["round_trip_s"],
        "raw_paho_deliver_s": raw["raw_paho_s"],
        "raw_paho_v5_deliver_s": raw5["raw_paho_s"],
        "raw_paho_v5_keep_deliver_s": kept["raw_paho_s"],
        "mqtt_vs_raw": sdk["deliver_s"] / raw["raw_paho_s"],
        "mqtt_vs_raw_v5": sdk["deliver_s"] / raw5["raw_paho_s"],
        "mqtt_vs_raw_v5_keep": sdk["deliver_s"] / kept["raw_paho_s"],
        "mqtt_deliver_cpu_s": sdk["deliver_cpu_s"],
        "raw_paho_cpu_s": raw["cpu_s"],
        "raw_paho_v5_cpu_s": raw5["cpu_s"],
        "raw_paho_v5_keep_cpu_s": kept["cpu_s"],
    }


def processes_row(url: str, size: int, n: int) -> dict[str, Any]:
    """One size x clients with every receiver a process of its own, as on devices: the SDK as
    `edgefl client` runs it (allocator tuned) and untuned, raw paho over MQTT 3.1.1 and 5, and
    raw paho over MQTT 5 that keeps and hashes what it receives."""

    def settled(result: dict[str, Any]) -> dict[str, Any]:
        time.sleep(SETTLE_S)  # the last run's processes free their memory before the next one
        return result

    sdk = settled(bench_delivery_processes(url, size, n))
    plain = settled(bench_delivery_processes(url, size, n, tune=False))
    raw = settled(bench_raw_paho(url, size, n, processes=True))
    raw5 = settled(bench_raw_paho(url, size, n, protocol="5", processes=True))
    kept = settled(bench_raw_paho(url, size, n, protocol="5", keep=True, processes=True))
    return {
        **_against_floors(size, n, sdk, raw, raw5, kept),
        "mqtt_untuned_deliver_s": plain["deliver_s"],
        "mqtt_untuned_deliver_cpu_s": plain["deliver_cpu_s"],
        "mqtt_vs_mqtt_md": sdk["deliver_s"] / MQTT_MD_RAW_S if (size, n) == (40 * MB, 20) else None,
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


Column = tuple[str, int, str, Any]  # header, width, format, row key or function of the row
_FLOOR_COLUMNS: list[Column] = [
    ("raw 3.1.1 s", 11, ".3f", "raw_paho_deliver_s"),
    ("raw v5 s", 8, ".3f", "raw_paho_v5_deliver_s"),
    ("keep v5 s", 9, ".3f", "raw_paho_v5_keep_deliver_s"),
    ("mqtt/raw", 8, ".2f", "mqtt_vs_raw"),
    ("mqtt/raw v5", 11, ".2f", "mqtt_vs_raw_v5"),
    ("mqtt/keep v5", 12, ".2f", "mqtt_vs_raw_v5_keep"),
    ("cpu mqtt/raw", 12, ".2f", lambda r: r["mqtt_deliver_cpu_s"] / r["raw_paho_cpu_s"]),
    ("mqtt rt s", 9, ".3f", "mqtt_round_trip_s"),
]


def _print_table(rows: list[dict[str, Any]], sdk_columns: list[Column]) -> None:
    """MB, clients, the SDK's own columns, then the floors (_against_floors)."""
    columns = [("MB", 5, ".0f", "size_mb"), ("clients", 7, "", "clients")]
    columns += sdk_columns + _FLOOR_COLUMNS
    print(" ".join(f"{head:>{width}}" for head, width, _, _ in columns))
    for r in rows:
        cells = (key(r) if callable(key) else r[key] for _, _, _, key in columns)
        print(" ".join(f"{v:>{c[1]}{c[2]}}" for c, v in zip(columns, cells, strict=True)))


def print_delivery(rows: list[dict[str, Any]]) -> None:
    _print_table(
        rows, [("memory s", 9, ".3f", "memory_deliver_s"), ("mqtt s", 8, ".3f", "mqtt_deliver_s")]
    )


def print_processes(rows: list[dict[str, Any]]) -> None:
    print("receivers as processes:")
    sdk = [
        ("mqtt s", 8, ".3f", "mqtt_deliver_s"),
        ("untuned s", 9, ".3f", "mqtt_untuned_deliver_s"),
    ]
    _print_table(rows, sdk)
    for r in rows:
        if r["mqtt_vs_mqtt_md"] is not None:
            print(
                f"40 MB to 20 clients: {r['mqtt_deliver_s']:.2f} s = {r['mqtt_vs_mqtt_md']:.2f}x "
                f"mqtt.md's raw paho {MQTT_MD_RAW_S} s (goal: 1.5x)"
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


PARTS = {"delivery", "processes", "rounds"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,40", help="model sizes in MB")
    p.add_argument("--clients", default="1,5,20", help="client counts")
    p.add_argument("--rounds", type=int, default=5, help="FML rounds for the overhead")
    p.add_argument("--quick", action="store_true", help="1,10 MB x 1,5 clients, 3 rounds")
    p.add_argument(
        "--parts",
        default=",".join(sorted(PARTS)),
        help="which parts: delivery, processes, rounds (comma-separated)",
    )
    p.add_argument("--repeat", type=int, default=1, help="measure each delivery row this often")
    p.add_argument("--json-out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.clients, args.rounds = "1,10", "1,5", 3
    sizes = [int(float(s) * MB) for s in args.sizes.split(",")]
    counts = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "machine": machine(paho=importlib.metadata.version("paho-mqtt")),
        "delivery": [],
        "processes": [],
        "rounds": {},
    }
    parts = set(args.parts.split(","))
    if not parts <= PARTS:
        p.error(f"--parts: unknown part(s) {sorted(parts - PARTS)}")
    with MosquittoBroker() as broker:
        if "delivery" in parts:
            for size in sizes:
                for n in counts:
                    for _ in range(args.repeat):
                        print(f"delivery {size // MB} MB x {n} ...", file=sys.stderr)
                        report["delivery"].append(delivery_row(broker.url, size, n))
        if "processes" in parts:
            for size in sizes:
                for n in counts:
                    for _ in range(args.repeat):
                        print(f"processes {size // MB} MB x {n} ...", file=sys.stderr)
                        report["processes"].append(processes_row(broker.url, size, n))
        if "rounds" in parts:
            report["rounds"] = bench_rounds(broker.url, args.rounds)
    ended(report)
    print(save(report, args.json_out))
    print()
    if report["delivery"]:
        print_delivery(report["delivery"])
    if report["processes"]:
        print_processes(report["processes"])
    if report["rounds"]:
        print_rounds(report["rounds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
