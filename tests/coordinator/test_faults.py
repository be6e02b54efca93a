"""Fault injection with real processes and a real mosquitto: every wait is bounded, and every
test ends by checking the outcome (the run finished, the result is right)."""

import json
import os
import signal
import subprocess
import time

import pytest
from tests_helpers import (
    ARCHS,
    DATA,
    EDGEFL,
    FAST_EXPORT,
    ONE_VIEW,
    SETS,
    TRAIN,
    key_flags,
    simulated_fml_accuracies,
)

from coordinator.broker import MosquittoBroker
from edge_sdk import topics
from edge_sdk.state import load_state
from edge_sdk.transport.mqtt import MqttTransport


class Fleet:
    """One `edgefl coordinator` and three `edgefl client` processes of one run."""

    def __init__(self, url, tmp_path, run_id, rounds, round_sets=()):
        self.tmp, self.out = tmp_path, tmp_path / "out"
        self.common = ["--broker", url, "--run-id", run_id]
        self.rounds, self.round_sets = rounds, list(round_sets)
        self.procs: dict[str, subprocess.Popen] = {}
        self.keys = key_flags(tmp_path / "keys", ["c0", "c1", "c2"])
        self.starts: dict[str, int] = {}
        self.killed: set[str] = set()  # killed on purpose: their exit code is expected

    def _command(self, name):
        if name == "coordinator":
            run = ["--algorithm", "fml", "--clients", "3", "--rounds", str(self.rounds), *ONE_VIEW]
            extra = [x for s in self.round_sets for x in ("--set", s)]
            out = ["--out", str(self.out), "--global-model", "mlr"]
            keys = self.keys["coordinator"]
            return [EDGEFL, "coordinator", *self.common, *run, *TRAIN, *out, *SETS, *extra, *keys]
        i = int(name[1:])
        me = ["--id", name, "--model", ARCHS[i], "--index", str(i), "--seed", "0"]
        state = ["--state-dir", str(self.tmp / f"state{i}"), "--threads", "1"]
        keys = self.keys[name]
        return [EDGEFL, "client", *self.common, *me, *DATA, *state, *SETS, *FAST_EXPORT, *keys]

    def kill(self, name):
        self.killed.add(name)
        self.procs[name].kill()  # SIGKILL: no goodbye, no flush
        self.procs[name].wait()

    def last_round(self):
        done = self.rounds_done()
        return done[-1]["round"] if done else 0

    def start(self, name):
        self.killed.discard(name)
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.tmp / f"{name}.{self.starts[name]}.log", "w")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            self._command(name), stdout=log, stderr=subprocess.STDOUT, text=True
        )

    def start_all(self):
        for name in ["coordinator", "c0", "c1", "c2"]:
            self.start(name)

    def log(self, name, n=None):
        return (self.tmp / f"{name}.{n or self.starts[name]}.log").read_text()

    def rounds_done(self):
        path = self.out / "rounds.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for_round(self, r, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(rec["round"] >= r for rec in self.rounds_done()):
                return
            dead = {
                n: p.returncode
                for n, p in self.procs.items()
                if p.poll() not in (None, 0) and n not in self.killed
            }
            assert not dead, f"processes died: {dead}\n{self.dump()}"
            time.sleep(0.1)
        raise AssertionError(f"round {r} not reached in {timeout} s\n{self.dump()}")

    def wait_all(self, timeout=240):
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish\n{self.dump()}") from None
        codes = {n: p.returncode for n, p in self.procs.items() if n not in self.killed}
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{self.dump()}"

    def dump(self):
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.tmp.glob("*.log"))

    def kill_everything(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


@pytest.fixture
def fleet_factory(tmp_path):
    made = []

    def make(url, run_id, rounds, round_sets=()):
        f = Fleet(url, tmp_path, run_id, rounds, round_sets)
        made.append(f)
        return f

    yield make
    for f in made:
        f.kill_everything()


class _Spy:
    """Counts the payload bytes the coordinator publishes, as the broker delivers them."""

    def __init__(self, url, run):
        self.total = 0
        self.t = MqttTransport(url, f"spy-{run}").connect(10)
        root = f"{topics.ROOT}/{run}"
        for flt in (f"{root}/status", f"{root}/down/+", f"{root}/bcast"):
            self.t.subscribe(flt, self._count)

    def _count(self, topic, payload):
        self.total += len(payload)


def test_a_coordinator_killed_after_round_r_resumes_and_ends_like_an_uninterrupted_run(
    mosquitto, fleet_factory
):
    fleet = fleet_factory(mosquitto.url, "kill-coordinator", rounds=5)
    spy = _Spy(mosquitto.url, "kill-coordinator")
    fleet.start_all()
    fleet.wait_for_round(2)
    fleet.kill("coordinator")
    done = len(load_state(fleet.out / "checkpoint-kill-coordinator.state")["records"])
    first = spy.total  # what the killed incarnation sent (and its will)
    fleet.start("coordinator")  # the same command
    fleet.wait_all()
    spy.t.close()
    assert f"resuming after round {done}" in fleet.log("coordinator")
    rounds = fleet.rounds_done()
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]  # each exactly once
    results = json.loads((fleet.out / "results.json").read_text())
    assert [c["personal_acc"] for c in results["clients"]] == simulated_fml_accuracies(5)
    # The byte counters cover both incarnations: the second one's own traffic, and the first
    # one's up to its last checkpoint (more than half of it: it had completed 2 of 3 rounds).
    second = spy.total - first
    assert second + first // 2 <= results["summary"]["coordinator_bytes_out"] <= spy.total


FAULT_ROUNDS = 24


def test_a_client_killed_mid_round_or_stalled_past_the_deadline_costs_only_its_reply(
    mosquitto, fleet_factory
):
    # Short rounds, enough that the run is still going when a killed client has restarted:
    # about 10 pass before it.
    fleet = fleet_factory(
        mosquitto.url,
        "client-faults",
        rounds=FAULT_ROUNDS,
        round_sets=[
            "round.quorum=0.5",
            "round.deadline_s=6",  # replies in time on a busy machine; SIGSTOP outlasts it
            "round.finalize_deadline_s=120",
            "round.retries=2",  # a round that misses quorum on a busy machine is tried again
            "round.reconnect_grace_s=2",  # the killed client is waited for 2 s, not 10
        ],
    )
    fleet.start_all()
    # SIGSTOP c1 past the deadline: rounds close without it; its late reply is discarded.
    fleet.wait_for_round(1)
    fleet.procs["c1"].send_signal(signal.SIGSTOP)
    stopped = fleet.last_round()
    fleet.wait_for_round(stopped + 2, timeout=60)
    fleet.procs["c1"].send_signal(signal.SIGCONT)
    resumed = fleet.last_round()
    # SIGKILL c2 in the middle of a round: its will fires, rounds go on at quorum without it.
    fleet.wait_for_round(resumed + 3)
    fleet.kill("c2")
    killed = fleet.last_round()
    fleet.wait_for_round(killed + 3)
    # Restarted with its state dir. The coordinator is paused meanwhile (well within its
    # keepalive), so the short rounds cannot all pass while the device is still starting.
    fleet.procs["coordinator"].send_signal(signal.SIGSTOP)
    fleet.start("c2")
    deadline = time.monotonic() + 35
    while "resumed from" not in fleet.log("c2") and time.monotonic() < deadline:
        time.sleep(0.2)
    fleet.procs["coordinator"].send_signal(signal.SIGCONT)
    restarted = fleet.last_round()
    fleet.wait_all()

    rounds = {r["round"]: r for r in fleet.rounds_done()}
    last = FAULT_ROUNDS + 1
    assert sorted(rounds) == list(range(1, last)) and not any(r["failed"] for r in rounds.values())
    assert "c1" not in rounds[stopped + 2]["replied"]  # closed at its deadline without c1
    assert any("c1" in rounds[r]["replied"] for r in range(resumed + 1, last))  # back again
    assert "stale_reply" in fleet.log("coordinator")
    assert all("c2" not in rounds[r]["replied"] for r in range(killed + 2, restarted + 1))
    assert any("c2" in rounds[r]["replied"] for r in range(restarted + 1, last))
    relaunch = fleet.log("c2", 2)
    assert "resumed from" in relaunch and "(round 0)" not in relaunch  # its saved state
    results = json.loads((fleet.out / "results.json").read_text())
    assert all(c["personal_acc"] is not None for c in results["clients"])


def test_everyone_reconnects_when_the_broker_restarts_mid_federation(tmp_path, fleet_factory):
    with MosquittoBroker(persistence=True, workdir=tmp_path / "broker") as broker:
        fleet = fleet_factory(broker.url, "broker-restart", rounds=8)
        fleet.start_all()
        fleet.wait_for_round(2)
        broker.restart(down_s=1.0)
        assert fleet.last_round() < 8  # the federation was mid-way when its broker went
        fleet.wait_all()
    rounds = fleet.rounds_done()
    assert [r["round"] for r in rounds] == list(range(1, 9))
    assert rounds[-1]["replied"] == ["c0", "c1", "c2"]  # everyone came back
    assert sum(r["failed"] for r in rounds) <= 1  # at most the round the broker was down in
    results = json.loads((fleet.out / "results.json").read_text())
    assert all(c["personal_acc"] is not None for c in results["clients"])
    assert all(os.path.exists(fleet.tmp / f"state{i}" / f"c{i}.onnx") for i in range(3))


def test_a_broker_restart_without_persistence_loses_no_reply_and_waits_out_no_deadline(
    tmp_path, fleet_factory
):
    # The broker forgets every queue and retained message. The coordinator republishes its
    # status and sends the open tasks again as the clients come back; a client whose reply was
    # lost sends it again. With a 10-minute deadline, waiting one out would not end in time.
    with MosquittoBroker(persistence=False, workdir=tmp_path / "broker") as broker:
        fleet = fleet_factory(
            broker.url, "broker-lost", rounds=6, round_sets=["round.deadline_s=600"]
        )
        fleet.start_all()
        fleet.wait_for_round(2)
        broker.restart(down_s=1.0)
        assert fleet.last_round() < 6
        fleet.wait_all(timeout=240)
    rounds = fleet.rounds_done()
    assert [r["round"] for r in rounds] == list(range(1, 7))
    assert all(r["replied"] == ["c0", "c1", "c2"] and not r["failed"] for r in rounds)
    results = json.loads((fleet.out / "results.json").read_text())
    assert [c["personal_acc"] for c in results["clients"]] == simulated_fml_accuracies(6)


def test_a_dead_device_under_the_default_quorum_and_deadline_costs_no_round(
    mosquitto, fleet_factory
):
    # No round settings: the defaults. c2 is killed; its will says so at once, and every round
    # closes with the two others, none waiting for it.
    fleet = fleet_factory(mosquitto.url, "dead-device", rounds=8)
    fleet.start_all()
    fleet.wait_for_round(2)
    fleet.kill("c2")
    killed = fleet.last_round()
    fleet.wait_all(timeout=240)
    assert "rounds close with 2 of 3 valid replies (round.quorum 0.5) or after 120 s" in fleet.log(
        "coordinator"
    )
    rounds = fleet.rounds_done()
    assert [r["round"] for r in rounds] == list(range(1, 9)) and not any(
        r["failed"] for r in rounds
    )
    assert all(r["replied"] == ["c0", "c1"] for r in rounds[killed + 1 :])
