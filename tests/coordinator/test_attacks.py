"""A hostile run on an open broker, with real processes: everything the issue tried, at once.

`edgefl coordinator` and three `edgefl client` processes (each with its own signing key) on a
mosquitto that lets anyone connect, read and publish anything, while the test plays the
attacker: it watches every task and answers c0's before c0 does (forged accuracies, impossible
sample counts, signatures made up, c0's own earlier frames replayed), orders c2 to shut down,
floods c1's topic with 10,000 malformed messages and an unregistered topic with chunks, and
takes c1's MQTT session again and again, and starts a second process as c1 with another
architecture and a client that comes late. The run must end with exactly the per-client
accuracies of an undisturbed one.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests_helpers import (
    ARCHS,
    FAST_EXPORT,
    ONE_VIEW,
    SETS,
    TRAIN,
    exit_codes,
    key_flags,
    simulated_fml_accuracies,
)

from edge_sdk import topics
from edge_sdk.protocol import Reply, Shutdown, Task, decode, encode
from edge_sdk.transport.mqtt import MqttTransport

ROUNDS = 6
DATA = ["--dataset", "digits", "--max-samples", "800", "--partition", "iid"]
# A process that imports the CLI and what its client command runs, waits for its trigger file,
# then runs it: it joins at once when triggered instead of spending seconds importing torch.
LATER = (
    "import sys, time, pathlib, coordinator.cli as cli\n"
    "import coordinator.deploy, coordinator.export, coordinator.federation, edge_sdk.client\n"
    "trigger = pathlib.Path(sys.argv[1])\n"
    "deadline = time.monotonic() + 300\n"
    "while not trigger.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
    "sys.argv = ['edgefl', *sys.argv[2:]]\n"
    "cli.main()\n"
)


class Attacker:
    """Anyone on the broker: reads every task, writes on every topic, holds no key."""

    def __init__(self, url, run):
        self.run, self.url = run, url
        self.t = MqttTransport(url, f"mallory-{run}").connect(10)
        self.seen_from_c0: list[bytes] = []  # c0's genuine (signed) frames, to replay
        self.forged = 0
        self.t.subscribe(topics.up(run, "c0"), self._on_c0)
        self.t.subscribe(f"{topics.ROOT}/{run}/down/+", self._on_down)

    def _on_c0(self, topic, payload):
        if payload.startswith(b"EF1S"):
            self.seen_from_c0.append(payload)

    def _on_down(self, topic, payload):
        if not payload.startswith(b"EF1S"):
            return
        msg = decode(payload[4 + 64 :])  # the attacker can read everything
        if not isinstance(msg, Task) or not topic.endswith("/c0"):
            if isinstance(msg, Task) and topic.endswith("/c1"):
                self._shutdown_c2()
            return
        up = topics.up(self.run, "c0")
        base = {"run": self.run, "sender": "c0", "task_id": msg.task_id, "round": msg.round}
        if msg.phase == "fit":  # an impossible reply, before c0's real one
            forged = Reply(**base, phase="fit", ok=True, n_samples=10**12)
        else:  # a perfect score for c0
            counts = {"personal_correct": 10.0, "personal_total": 10.0}
            forged = Reply(**base, phase=msg.phase, ok=True, metrics=counts)
        body = encode(forged)
        self.t.publish(up, b"EF1M" + body)  # unsigned
        self.t.publish(up, b"EF1S" + os.urandom(64) + body)  # a signature made up
        for frame in self.seen_from_c0[-3:]:  # c0's own words, again
            self.t.publish(up, frame)
        self.forged += 1

    def _shutdown_c2(self):
        body = encode(Shutdown(run=self.run, sender="coordinator", reason="pwned"))
        self.t.publish(topics.down(self.run, "c2"), b"EF1M" + body)

    def flood(self):
        # The chunks first: sent after the ten thousand frames below, on a loaded machine they
        # reached the coordinator after the run's last round, and were never counted.
        header = json.dumps({"blob": "x", "index": 0, "count": 200, "size": 200 << 20}).encode()
        chunk = b"EF1C" + len(header).to_bytes(4, "big") + header + b"\0" * (1 << 20)
        for i in range(20):  # a model's worth of chunks that never completes, unregistered
            self.t.publish(topics.up(self.run, f"x{i}"), chunk)
        up = topics.up(self.run, "c1")
        for i in range(5_000):  # on a registered client's topic: unsigned, and no frame at all
            self.t.publish(up, b"EF1M{not json" + str(i).encode())
            self.t.publish(up, b"junk" + str(i).encode())

    def take_sessions(self):
        """c1's MQTT session, taken from it again and again (anyone may, on an open broker)."""
        for _ in range(3):
            intruder = MqttTransport(self.url, f"edgefl-{self.run}-c1").connect(10)
            time.sleep(0.3)
            intruder.close()

    def close(self):
        self.t.close()


def _scrape(log):
    """The coordinator's metrics, from the port its log names (None before it serves them)."""
    found = re.search(r"Prometheus metrics on port (\d+)", log.read_text())
    if found is None:
        return None
    port = int(found.group(1))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def test_a_hostile_open_broker_changes_nothing_in_the_run(mosquitto, tmp_path):
    run = f"hostile-{os.getpid()}"
    keys = key_flags(tmp_path / "keys", ["c0", "c1", "c2", "c3"])
    common = ["--broker", mosquitto.url, "--run-id", run]
    out = tmp_path / "out"
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def start(name, *argv):  # the command line, in parts
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as log:
            command = [x for part in argv for x in part]
            procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    edgefl = [sys.executable, "-m", "coordinator"]
    start(
        "coordinator",
        [*edgefl, "coordinator", *common, "--algorithm", "fml", "--clients", "3", "-v"],
        ["--rounds", str(ROUNDS), "--global-model", "mlr", "--out", str(out)],
        ["--metrics-port", "0", *TRAIN, *ONE_VIEW, *SETS, *keys["coordinator"]],  # any free port
    )
    for i, arch in enumerate(ARCHS):
        me = ["--id", f"c{i}", "--model", arch, "--index", str(i), "--seed", "0"]
        state = ["--state-dir", str(tmp_path / f"state{i}"), "--threads", "1"]
        client = [*edgefl, "client", *common, *me, *DATA, "--clients", "3"]
        start(f"c{i}", client, state, SETS, FAST_EXPORT, keys[f"c{i}"])
    trigger = tmp_path / "go"
    # c1 again, as another architecture, with c1's key; and a fourth client after the start.
    dup = ["--id", "c1", "--model", "mlr", "--index", "1", "--clients", "3"]
    late = ["--id", "c3", "--model", "mlr", "--index", "3", "--clients", "4"]
    for name, me in (("dup", dup), ("late", late)):
        state = ["--state-dir", str(tmp_path / f"state-{name}"), "--threads", "1"]
        start(name, [sys.executable, "-c", LATER, str(trigger), "client", *common, *me, *DATA],
              state, SETS, keys[me[1]])  # fmt: skip
    attacker = Attacker(mosquitto.url, run)
    rounds_log = out / "rounds.jsonl"
    metrics = None
    try:
        deadline = time.monotonic() + 400
        while procs["coordinator"].poll() is None and time.monotonic() < deadline:
            if not trigger.exists() and "3 clients registered" in logs["coordinator"].read_text():
                trigger.touch()  # the run has started: now the duplicate and the latecomer
                attacker.flood()
                attacker.take_sessions()
            metrics = _scrape(logs["coordinator"]) or metrics
            time.sleep(0.2)
        codes = exit_codes(procs, deadline)
        dump = "\n".join(f"--- {n}\n{logs[n].read_text()[-3000:]}" for n in procs)
    finally:
        attacker.close()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()

    # Every genuine process finished; the two intruders were refused, said why, and left.
    assert {n: codes[n] for n in ("coordinator", "c0", "c1", "c2")} == dict.fromkeys(
        ("coordinator", "c0", "c1", "c2"), 0
    ), dump
    assert codes["dup"] not in (0, None), dump
    assert "cannot change its architecture" in logs["dup"].read_text(), dump
    assert not (tmp_path / "state-dup" / "c1.state").exists()  # it ran none of c1's tasks
    assert codes["late"] not in (0, None), dump
    assert "the run has already started" in logs["late"].read_text(), dump
    # c2 ignored the forged shutdown: it trained to the end and exported its model.
    assert all((tmp_path / f"state{i}" / f"c{i}.onnx").is_file() for i in range(3))
    # Not one forged word counted: the accuracies are those of an undisturbed run.
    assert attacker.forged >= ROUNDS
    rounds = [json.loads(x) for x in rounds_log.read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert all(r["replied"] == ["c0", "c1", "c2"] and not r["failed"] for r in rounds), dump
    results = json.loads((out / "results.json").read_text())
    assert [c["personal_acc"] for c in results["clients"]] == simulated_fml_accuracies(ROUNDS)
    # ... and everything dropped was counted, with a few log lines for ten thousand messages.
    assert metrics is not None
    for reason in ("unsigned", "bad_signature", "malformed", "unexpected_blob"):
        assert f'edgefl_rejected_messages_total{{reason="{reason}"}}' in metrics, reason
    coordinator_log = logs["coordinator"].read_text()
    assert sum("dropped" in line for line in coordinator_log.splitlines()) < 100
    assert coordinator_log.count("registered c0 (") == 1
