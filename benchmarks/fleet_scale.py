"""Fleet scale: one coordinator and N emulated devices, each its own MQTT connection.

What one coordinator costs per device and per round, and where it tops out. The coordinator is
the real `edgefl coordinator` process (signed messages, FedAvg on MLR over 8x8 digits). Each
device is a real `EdgeClient` (the SDK's registration, tasks, signed replies, will, presence)
with its own Ed25519 key and its own MQTT connection (paho, MQTT 5, persistent session), around a
real `ClientNode` that trains its MLR on 40 digits of its own. A few worker processes hold
hundreds to thousands of devices each: one thread per process drives every connection through
paho's external event loop (a selector over their sockets) and serves each client with
`EdgeClient.step()`, so no device needs a thread or a process. A device's publishes are handed
to paho at QoS 1 and not waited for (the thread that would wait is the one that reads the
acks); `--train-ms` holds each device's reply back that long, as a slower device would.

Measured (the monitor samples the coordinator's and the broker's processes with psutil each time
the coordinator's retained status changes phase, and reads mosquitto's $SYS counters):
- round latency (the coordinator's rounds.jsonl) and time to register the fleet;
- the coordinator's CPU seconds per device-round (a device-round: one device's fit and, in
  rounds that evaluate, evaluation task) and its RSS per registered device;
- mosquitto's RSS; PUBLISH messages and bytes through the broker per device-round;
- with `--drop R`, 10% of the devices lose their connection at once (no DISCONNECT: their wills
  fire) early in round R's fit phase and reconnect after `--down-s`: that round's latency against
  the others', and how many devices replied in it.

    python benchmarks/fleet_scale.py --devices 100 1000          # a scaling table
    python benchmarks/fleet_scale.py --devices 10000 --per-round 100 --rounds 5
    python benchmarks/fleet_scale.py --devices 1000 --drop 3 --json-out fleet.json

Prints one JSON object, then a table (each N, then the fitted slope of each figure against N).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, machine

RUN = "fleet"
EDGEFL = str(Path(sys.executable).parent / "edgefl")
TRAIN, VAL, TEST = 40, 10, 10  # digits per device


# -- the device side: many connections on one thread -------------------------------------------
class SharedLoop:
    """One selector over the sockets of many paho clients (paho's external event loop): reads,
    writes, keep-alives, and the publishes held back by `--train-ms`."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.transports: list[LoopTransport] = []
        self.ready: set[Any] = set()  # clients whose endpoint received something
        self.held: list[tuple[float, LoopTransport]] = []
        self._misc_at = 0.0

    def watch(self, client: Any, sock: socket.socket, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            self.selector.modify(sock, events, client)
        except (KeyError, ValueError):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.register(sock, events, client)

    def forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)

    def turn(self, timeout: float) -> None:
        for key, mask in self.selector.select(timeout):
            transport: LoopTransport = key.data
            if mask & selectors.EVENT_READ:
                transport.client.loop_read(1000)
            if mask & selectors.EVENT_WRITE and transport.client.socket() is not None:
                transport.client.loop_write()
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, transport = self.held.pop(0)
            transport.release()
        if now - self._misc_at >= 1.0:  # keep-alive pings, paho's timeouts
            self._misc_at = now
            for t in self.transports:
                if t.client.socket() is not None:
                    t.client.loop_misc()


class LoopTransport:
    """One device's MQTT connection (the `Transport` contract, as `MqttTransport` keeps it),
    driven by a `SharedLoop` instead of a thread of its own. `publish` hands the message to paho
    and returns a delivery already resolved."""

    def __init__(self, loop: SharedLoop, host: str, port: int, client_id: str) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from edge_sdk.transport.base import TransportStats

        self.loop, self.host, self.port = loop, host, port
        self.max_payload_bytes = 64 * 1024 * 1024
        self.stats = TransportStats()
        self.connection = 0
        self.on_reconnect: Any = None
        self.owner: Any = None  # the EdgeClient it serves
        self.hold_until = 0.0
        self._held: list[tuple[str, bytes, bool]] = []
        self._subs: dict[str, Any] = {}
        self._will: Any = None
        self._ever = False
        self.connected = False
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        c.max_inflight_messages_set(100)
        c.max_queued_messages_set(0)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_socket_open = lambda cl, u, s: loop.watch(self, s, False)
        c.on_socket_close = lambda cl, u, s: loop.forget(s)
        c.on_socket_register_write = lambda cl, u, s: loop.watch(self, s, True)
        c.on_socket_unregister_write = lambda cl, u, s: loop.watch(self, s, False)
        self.client = c
        loop.transports.append(self)

    # the Transport contract
    def set_will(self, topic: str, payload: Any, *, retain: bool = False) -> None:
        self._will = (topic, payload, retain)

    def _apply_will(self) -> None:
        if self._will is not None:
            topic, payload, retain = self._will
            body = payload(self.connection) if callable(payload) else payload
            self.client.will_set(topic, body, qos=1, retain=retain)

    def connect(self, timeout: float | None = None) -> LoopTransport:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._apply_will()
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client.connect(self.host, self.port, keepalive=60, clean_start=False, properties=props)
        return self

    def reconnect(self) -> None:
        self.connection += 1
        self._apply_will()
        self.client.reconnect()

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> Any:
        from edge_sdk.transport.base import Delivery

        if time.monotonic() < self.hold_until:
            if not self._held:
                self.loop.held.append((self.hold_until, self))
                self.loop.held.sort(key=lambda x: x[0])
            self._held.append((topic, payload, retain))
        else:
            self.client.publish(topic, payload, qos=1, retain=retain)
        self.stats.messages_out += 1
        self.stats.bytes_out += len(payload)
        delivery = Delivery(topic)
        delivery.resolve()
        return delivery

    def release(self) -> None:
        held, self._held = self._held, []
        for topic, payload, retain in held:
            self.client.publish(topic, payload, qos=1, retain=retain)

    def subscribe(self, topic_filter: str, callback: Any) -> None:
        self._subs[topic_filter] = callback
        if self.connected:
            self.client.subscribe(topic_filter, qos=1)

    def unsubscribe(self, topic_filter: str) -> None:
        if self._subs.pop(topic_filter, None) is not None and self.connected:
            self.client.unsubscribe(topic_filter)

    def disconnect(self) -> None:
        self.client.disconnect()

    def close(self) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.DISCONNECT)
        props.SessionExpiryInterval = 0
        self.client.disconnect(properties=props)

    def abort(self) -> None:
        """Drop the TCP connection without DISCONNECT, as a crash would: the will fires."""
        sock = self.client.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # paho's callbacks (the loop's thread)
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            return
        self.connected = True
        if self._subs:
            client.subscribe([(f, 1) for f in self._subs])
        if self._ever and self.on_reconnect is not None:
            self.on_reconnect()
        self._ever = True

    def _on_disconnect(self, *args: Any) -> None:
        self.connected = False

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        from edge_sdk.topics import topic_matches

        topic, payload = msg.topic, bytes(msg.payload)
        self.stats.messages_in += 1
        self.stats.bytes_in += len(payload)
        for flt, cb in self._subs.items():
            if topic_matches(flt, topic):
                cb(topic, payload)
        self.loop.ready.add(self.owner)


def _device_data(index: int, x: Any, y: Any) -> Any:
    """Device `index`'s own 40/10/10 digits (a seeded draw; devices overlap)."""
    import torch

    from edge_sdk.client_data import ClientData

    rng = np.random.default_rng(index)
    pick = torch.from_numpy(rng.choice(len(y), TRAIN + VAL + TEST, replace=False))
    xs, ys = x[pick], y[pick]
    a, b = TRAIN, TRAIN + VAL
    return ClientData(xs[:a], ys[:a], xs[a:b], ys[a:b], xs[b:], ys[b:], num_classes=10)


def worker(args: argparse.Namespace) -> int:
    """Serve devices d<first>..d<first+count-1> until the run finishes (or SIGTERM); SIGUSR1:
    drop 10% of them at once, reconnecting after --down-s."""
    import torch

    from edge_sdk import topics
    from edge_sdk.auth import Keyring, _read_private, read_roster
    from edge_sdk.client import EdgeClient
    from edge_sdk.node import ClientNode
    from model_zoo import ArchSpec
    from model_zoo.data import load_digits

    torch.set_num_threads(1)
    ds = load_digits(size=8)
    roster = read_roster(args.roster)  # once: a device believes the coordinator, and itself
    spec = ArchSpec(family="mlr", input_shape=(1, 8, 8), num_classes=10)
    loop = SharedLoop()
    clients = []
    for i in range(args.first, args.first + args.count):
        cid = f"d{i}"
        t = LoopTransport(loop, "127.0.0.1", args.port, f"edgefl-{RUN}-{cid}")
        node = ClientNode(cid, spec, _device_data(i, ds.x, ds.y), run_id=RUN, seed=i)
        mine = {pid: roster[pid] for pid in (cid, topics.COORDINATOR)}
        keyring = Keyring(cid, _read_private(Path(args.keys) / f"{cid}.key"), mine)
        client = EdgeClient(node, t, keyring=keyring)  # type: ignore[arg-type]
        t.owner = client
        clients.append(client)
    drop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: drop.set())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    train_s = args.train_ms / 1000
    for k, client in enumerate(clients):  # connect in batches, serving meanwhile
        client.open()
        if k % 100 == 99:
            loop.turn(0.01)
    active = set(clients)
    down: list[Any] = []
    back_at = 0.0
    idle_at = 0.0
    print(f"worker {args.first}: {len(clients)} devices connecting", flush=True)
    while active and not stop.is_set():
        loop.turn(0.02)
        while loop.ready:
            client = loop.ready.pop()
            if client not in active:
                continue
            while (env := client.endpoint.receive(timeout=0)) is not None:
                if train_s and type(env.message).__name__ == "Task":
                    client.transport.hold_until = time.monotonic() + train_s
                if client.step(env):
                    active.discard(client)
                    client.transport.close()
                    break
        now = time.monotonic()
        if now - idle_at >= 0.5:  # registration retries, connections that came back
            idle_at = now
            for client in list(active):
                if client.idle_wait() <= 0.5 and client.step(None):
                    active.discard(client)
        if drop.is_set():
            drop.clear()
            down = random.Random(args.first).sample(clients, max(1, len(clients) // 10))
            for client in down:
                client.transport.abort()
            back_at = time.monotonic() + args.down_s
        if down and time.monotonic() >= back_at:
            for client in down:
                with contextlib.suppress(OSError):
                    client.transport.reconnect()
            down = []
    done = sum(c.finished for c in clients)
    print(f"worker {args.first}: {done} of {len(clients)} devices finished", flush=True)
    loop.turn(0.5)
    return 0


# -- the run --------------------------------------------------------------------------------
class Monitor:
    """Follows the coordinator's retained status and mosquitto's $SYS counters; samples both
    processes at each change of phase."""

    def __init__(
        self, port: int, coordinator: psutil.Process, broker: psutil.Process, checkpoint: Path
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.coordinator, self.broker, self.checkpoint = coordinator, broker, checkpoint
        self.sys: dict[str, float] = {}
        self.samples: list[dict[str, Any]] = []
        self._last: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fleet-monitor")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe([(f"edgefl/{RUN}/status", 0), ("$SYS/broker/#", 0)])
        self.client.loop_start()
        self.sample("start", 0)

    def sample(self, phase: str, round_: int) -> dict[str, Any]:
        row: dict[str, Any] = {"t": time.monotonic(), "phase": phase, "round": round_}
        try:
            cpu = self.coordinator.cpu_times()
            row["coord_cpu_s"] = cpu.user + cpu.system
            row["coord_rss"] = self.coordinator.memory_info().rss
        except psutil.Error:
            pass
        with contextlib.suppress(OSError):
            row["ckpt_bytes"] = self.checkpoint.stat().st_size
        with contextlib.suppress(psutil.Error):
            row["broker_rss"] = self.broker.memory_info().rss
            cpu = self.broker.cpu_times()
            row["broker_cpu_s"] = cpu.user + cpu.system
        with self._lock:
            row.update(self.sys)
            self.samples.append(row)
        return row

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        if msg.topic.startswith("$SYS/"):
            name = msg.topic.removeprefix("$SYS/broker/")
            if name in SYS_COUNTERS:
                with contextlib.suppress(ValueError), self._lock:
                    self.sys[name] = float(msg.payload)
            return
        payload = bytes(msg.payload)
        with contextlib.suppress(ValueError, KeyError):
            body = json.loads(payload[68:] if payload.startswith(b"EF1S") else payload[4:])
            key = (body["phase"], int(body["round"]))
            if key != self._last:
                self._last = key
                self.sample(*key)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


SYS_COUNTERS = (
    "publish/messages/received",
    "publish/messages/sent",
    "bytes/received",
    "bytes/sent",
    "clients/connected",
)


def _raise_fd_limit() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def run_one(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from coordinator.broker import MosquittoBroker
    from edge_sdk.auth import issue_keys

    per_round = min(args.per_round or n, n)
    work.mkdir(parents=True, exist_ok=True)
    ids = [f"d{i}" for i in range(n)]
    t0 = time.monotonic()
    keys = issue_keys(work / "keys", ids)
    keygen_s = time.monotonic() - t0
    broker = MosquittoBroker(
        extra_config="sys_interval 1\nmax_connections -1\nmax_keepalive 600",
        workdir=work / "broker",
    ).start()
    out = work / "out"
    launch = [EDGEFL]
    if args.profile:  # the coordinator's threads sampled by py-spy (`pip install py-spy`)
        prof = work / "coordinator.folded"
        launch = ["py-spy", "record", "--nonblocking", "-r", "200", "--format", "raw"]
        launch += ["-o", str(prof), "--", EDGEFL]
    # fmt: off
    command = [
        *launch, "coordinator", "--broker", broker.url, "--run-id", RUN,
        "--algorithm", "fedavg", "--clients", str(n), "--rounds", str(args.rounds),
        "--clients-per-round", str(per_round), "--local-epochs", "1", "--batch-size", "20",
        "--lr", "0.1", "--register-timeout", "1800", "--deadline", str(args.deadline),
        "--out", str(out), "--set", "device=cpu", "--set", "data.dataset=digits",
        "--set", f"round.eval_every={args.eval_every or args.rounds}",
        "--set", f"round.reconnect_grace_s={args.down_s + 20}",
        "--set", f"auth.key_file={keys['coordinator']}",
        "--set", f"auth.roster={keys['roster']}", "--log-level", "WARNING",
        *(x for setting in args.set for x in ("--set", setting)),
    ]
    # fmt: on
    coordinator = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=open(work / "coordinator.log", "w"),  # noqa: SIM115
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    coord = psutil.Process(coordinator.pid)
    while args.profile and not coord.children():
        time.sleep(0.05)
    coord = coord.children()[0] if args.profile else coord
    monitor = None
    workers: list[subprocess.Popen[bytes]] = []
    try:
        while not (work / "broker" / "mosquitto.log").exists():
            time.sleep(0.1)
        monitor = Monitor(
            broker.port,
            coord,
            psutil.Process(broker.proc.pid),  # type: ignore[union-attr]
            out / f"checkpoint-{RUN}.state",
        )
        # The coordinator is up once it published its status: its RSS then is its baseline.
        while not any(s["phase"] == "registering" for s in monitor.samples):
            if coordinator.poll() is not None:
                raise RuntimeError((work / "coordinator.log").read_text()[-3000:])
            time.sleep(0.1)
        share = -(-n // args.procs)
        for first in range(0, n, share):
            cmd = [
                sys.executable, __file__, "--worker", "--first", str(first),
                "--count", str(min(share, n - first)), "--port", str(broker.port),
                "--keys", str(work / "keys"), "--roster", str(keys["roster"]),
                "--train-ms", str(args.train_ms), "--down-s", str(args.down_s),
            ]  # fmt: skip
            workers.append(
                subprocess.Popen(
                    cmd,
                    stdout=open(work / f"worker{first}.log", "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
        dropped_at = None
        while coordinator.poll() is None:
            time.sleep(0.05)
            if args.drop and dropped_at is None:
                fits = [s for s in monitor.samples if s["phase"] == "fit"]
                if fits and fits[-1]["round"] == args.drop:
                    time.sleep(0.2)  # the tasks are out
                    for w in workers:
                        w.send_signal(signal.SIGUSR1)
                    dropped_at = monitor.sample("drop", args.drop)["t"]
        end = monitor.sample("end", args.rounds)
        for w in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.wait(60)
    finally:
        if monitor is not None:
            monitor.close()
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.wait(30)
            if w.poll() is None:
                w.kill()
        if coordinator.poll() is None:
            coordinator.kill()
        broker.stop()
    if coordinator.returncode != 0:
        raise RuntimeError((work / "coordinator.log").read_text()[-3000:])
    return _figures(n, per_round, args, monitor.samples, end, out, keygen_s, dropped_at)


def _figures(
    n: int,
    per_round: int,
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    end: dict[str, Any],
    out: Path,
    keygen_s: float,
    dropped_at: float | None,
) -> dict[str, Any]:
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines() if x.strip()]
    start = next(s for s in samples if s["phase"] == "registering")
    registered = next(s for s in samples if s["phase"] not in ("start", "registering"))
    first_fit = next(s for s in samples if s["phase"] == "fit")
    last = [s for s in samples if s["phase"] == "finalize"]
    rounds_end = last[0] if last else end
    evaluated = sum(1 for r in rounds if r.get("mean_personal_acc") is not None)
    device_rounds = per_round * len(rounds) + n * evaluated
    cpu = rounds_end["coord_cpu_s"] - first_fit["coord_cpu_s"]
    seconds = [r["seconds"] for r in rounds]
    steady = [s for r, s in zip(rounds, seconds, strict=True) if r["round"] != args.drop]

    # Rounds that only train (no evaluation on every client): CPU from one fit status to the
    # next, the cost of a round of `per_round` devices with all the others registered and idle.
    fits = {s["round"]: s for s in samples if s["phase"] == "fit"}
    evals = {r["round"] for r in rounds if r.get("mean_personal_acc") is not None}
    fit_cpu = [
        fits[r + 1]["coord_cpu_s"] - fits[r]["coord_cpu_s"]
        for r in fits
        if r + 1 in fits and r not in evals and r != args.drop and r + 1 != args.drop
    ]

    # What the coordinator keeps grows by this much a round (fitted from each fit status on,
    # after the first round's checkpoint): its checkpoint file and its RSS.
    def growth(key: str) -> float | None:
        pts = [(r, s[key]) for r, s in sorted(fits.items()) if r >= 2 and key in s]
        return _line(pts)[0] if len(pts) >= 3 else None

    def delta(key: str) -> float | None:
        if key in rounds_end and key in first_fit:
            return (rounds_end[key] - first_fit[key]) / device_rounds
        return None

    row: dict[str, Any] = {
        "devices": n,
        "per_round": per_round,
        "rounds": len(rounds),
        "rounds_failed": sum(bool(r["failed"]) for r in rounds),
        "evaluated_rounds": evaluated,
        "device_rounds": device_rounds,
        "register_s": registered["t"] - start["t"],
        "register_cpu_ms_per_device": 1000 * (registered["coord_cpu_s"] - start["coord_cpu_s"]) / n,
        "round_s_median": float(np.median(steady)) if steady else None,
        "round_s": seconds,
        "coord_cpu_ms_per_device_round": 1000 * cpu / device_rounds,
        "fit_round_cpu_ms": 1000 * float(np.median(fit_cpu)) if fit_cpu else None,
        "coord_rss_mb": registered["coord_rss"] / 2**20,
        "coord_rss_kb_per_device": (registered["coord_rss"] - start["coord_rss"]) / 1024 / n,
        "coord_rss_mb_end": rounds_end["coord_rss"] / 2**20,
        "broker_rss_mb": max(s.get("broker_rss", 0) for s in samples) / 2**20,
        "broker_cpu_ms_per_device_round": 1000 * (delta("broker_cpu_s") or 0.0),
        "publishes_per_device_round": (delta("publish/messages/received") or 0.0)
        + (delta("publish/messages/sent") or 0.0),
        "bytes_per_device_round": (delta("bytes/received") or 0.0) + (delta("bytes/sent") or 0.0),
        "replied_per_round": [len(r["replied"]) for r in rounds],
        "ckpt_kb_end": (last[0] if last else end).get("ckpt_bytes", 0) / 1024,
        "ckpt_bytes_per_round": growth("ckpt_bytes"),
        "coord_rss_kb_per_round": (g / 1024) if (g := growth("coord_rss")) is not None else None,
        "keygen_s": keygen_s,
        "train_ms": args.train_ms,
    }
    if dropped_at is not None:
        dropped = next(r for r in rounds if r["round"] == args.drop)
        row["drop"] = {
            "round": args.drop,
            "devices_dropped": sum(max(1, c // 10) for c in _shares(n, args.procs)),
            "down_s": args.down_s,
            "round_s": dropped["seconds"],
            "replied": len(dropped["replied"]),
            "planned": len(dropped["trained"]),
        }
    return row


def _shares(n: int, procs: int) -> list[int]:
    share = -(-n // procs)
    return [min(share, n - first) for first in range(0, n, share)]


def _line(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares fit y = a + b·x through the points: (b, a)."""
    b, a = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    return float(b), float(a)


def _slope(rows: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """Least-squares fit key = a + b·N over the rows: (b, a)."""
    pts = [(r["devices"], r[key]) for r in rows if r.get(key) is not None]
    return _line(pts) if len(pts) >= 2 else None


COLUMNS = [
    ("devices", "N", "{:d}"),
    ("per_round", "per round", "{:d}"),
    ("register_s", "register N (s)", "{:.1f}"),
    ("round_s_median", "round (s)", "{:.2f}"),
    ("coord_cpu_ms_per_device_round", "coord CPU/dev-round (ms)", "{:.2f}"),
    ("fit_round_cpu_ms", "coord CPU/training round (ms)", "{:.0f}"),
    ("register_cpu_ms_per_device", "coord CPU/registration (ms)", "{:.2f}"),
    ("coord_rss_kb_per_device", "coord RSS/device (KiB)", "{:.1f}"),
    ("coord_rss_mb_end", "coord RSS (MiB)", "{:.0f}"),
    ("broker_rss_mb", "broker RSS (MiB)", "{:.0f}"),
    ("ckpt_bytes_per_round", "checkpoint growth/round (B)", "{:.0f}"),
    ("coord_rss_kb_per_round", "coord RSS growth/round (KiB)", "{:.0f}"),
    ("broker_cpu_ms_per_device_round", "broker CPU/dev-round (ms)", "{:.2f}"),
    ("publishes_per_device_round", "publishes/dev-round", "{:.1f}"),
    ("bytes_per_device_round", "bytes/dev-round", "{:.0f}"),
]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        cells = [fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    fits = [(k, name, _slope(rows, k)) for k, name, _ in COLUMNS[2:]]
    if len(rows) > 1:
        cells = [f"{s[0]:.3g}/device" if s else "-" for _, _, s in fits]
        lines.append("| slope | | " + " | ".join(cells) + " |")
    for r in rows:
        if "drop" in r:
            d = r["drop"]
            lines.append(
                f"\nN={r['devices']}: {d['devices_dropped']} devices dropped at once in round "
                f"{d['round']} and came back after {d['down_s']} s: that round took "
                f"{d['round_s']:.1f} s (median {r['round_s_median']:.1f} s), {d['replied']} of "
                f"{d['planned']} replied."
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--per-round", type=int, help="clients_per_round (default: all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--eval-every", type=int, help="round.eval_every (default: the last round)")
    p.add_argument("--procs", type=int, default=2, help="device worker processes")
    p.add_argument("--train-ms", type=float, default=0.0, help="each reply held back this long")
    p.add_argument("--drop", type=int, help="drop 10%% of the devices in this round")
    p.add_argument("--down-s", type=float, default=3.0)
    p.add_argument("--deadline", type=float, default=600.0)
    p.add_argument(
        "--set", action="append", default=[], help="a coordinator setting KEY=VALUE (repeat)"
    )
    p.add_argument("--json-out")
    p.add_argument("--profile", action="store_true", help="the coordinator under py-spy")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    # a worker process (started by the run)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    p.add_argument("--roster", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fds = _raise_fd_limit()
    if args.worker:
        return worker(args)
    start = machine(fd_limit=fds)
    base = Path(tempfile.mkdtemp(prefix="edgefl-fleet-"))
    rows = []
    for n in args.devices:
        rows.append(run_one(n, args, base / f"n{n}"))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "benchmark": "fleet_scale",
        "machine": start,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "first", "count")},
        "rows": rows,
        "slopes": {k: _slope(rows, k) for k, _, _ in COLUMNS[2:]},
        "work": str(base) if args.keep else None,
    }
    emit(result, Path(args.json_out) if args.json_out else None, lambda out: table(out["rows"]))
    if not args.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
