"""One process per client id, replies only from it, failed rounds that change nothing, and
bounded memory and log lines under floods (in-process, over the in-memory transport)."""

import json
import logging
import threading
import time

import pytest
from tests_helpers import eventually, small_federation

import edge_sdk.serving as serving_mod
from coordinator.deploy import metrics_collector
from edge_sdk import topics
from edge_sdk.algorithms import FitResult
from edge_sdk.client import EdgeClient, RegistrationRefused
from edge_sdk.node import ClientNode
from edge_sdk.protocol import Presence, Reply, Task, decode
from edge_sdk.transport import InMemoryBroker
from edge_sdk.wire import Endpoint


def _started(clients):
    for c in clients:
        c.start()
    return clients


def _chunk(blob, index, count, size, data):
    header = json.dumps({"blob": blob, "index": index, "count": count, "size": size}).encode()
    return b"EF1C" + len(header).to_bytes(4, "big") + header + data


def test_a_round_recorded_failed_leaves_every_clients_state_as_it_was():
    # c0 sends an impossible fit reply in round 2 only; with quorum 1 and no retry, round 2
    # fails. The clients that trained in it go back to their state before it, so round 2's
    # evaluation scores what round 1's did, client by client.
    class FailsRound2(EdgeClient):
        def run_task(self, task, blobs):
            result = super().run_task(task, blobs)
            if task.phase == "fit" and task.round == 2:
                return FitResult(models=result.models, metrics=result.metrics, n_samples=10**9)
            return result

    coordinator, clients = small_federation(
        algorithm="fml",
        client_cls=FailsRound2,
        rounds=3,
        config={"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        quorum=1.0,
        retries=0,
    )
    result = coordinator.run() if _started(clients) else None
    first, failed, third = result.rounds
    assert (first.failed, failed.failed, third.failed) == (False, True, False)
    assert failed.trained == ["c0", "c1", "c2"]
    assert failed.client_acc == first.client_acc
    assert third.client_acc != first.client_acc  # round 3 trained on from there
    for c in clients:
        c.stop()


def test_the_newest_process_of_a_client_id_counts_and_the_older_one_is_told_to_stop():
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, rounds=3)
    old = clients[1]
    newer = []

    def second_process(rec):  # after round 1, c1 starts again elsewhere (same id, same key)
        if rec.round == 1:
            node = ClientNode("c1", old.spec, old.data, seed=1)
            c = EdgeClient(node, broker.connect("c1-again"), keyring=old.keyring)
            newer.append(c.start())  # registers while the coordinator runs round 2

    coordinator.on_round = second_process
    result = coordinator.run() if _started(clients) else None
    assert not old.wait(20) or old.refused is not None
    with pytest.raises(RegistrationRefused, match="another process registered as c1"):
        old.run(timeout=1)
    assert newer[0].tasks_done >= 2  # rounds 2 and 3 went to the newer process
    assert all(r.replied == ["c0", "c1", "c2"] for r in result.rounds)
    for c in [*clients, *newer]:
        c.stop()


def test_a_reply_signed_by_the_client_but_from_another_process_does_not_count():
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, rounds=1, quorum=1.0)
    tasks = []
    broker.connect("spy").subscribe(
        topics.down("default", "c1"),
        lambda t, p: tasks.append(m) if isinstance(m := decode(p[68:]), Task) else None,
    )
    # Another process holding c1's key (not registered) answers c1's tasks first: c1's own
    # reply to a task waits until the twin has answered it (else, on a busy machine, c1 could
    # answer first and the twin's reply would find the task closed).
    twin = Endpoint(broker.connect("twin"), "unused", keyring=clients[1].keyring)
    answered: set[str] = set()
    twin_sent = threading.Condition()

    def answer():  # the initial evaluation, round 1's fit and evaluation, the finalize
        while len(answered) < 4:
            for t in [t for t in tasks if t.task_id not in answered]:
                reply = Reply(
                    run="default", sender="c1", task_id=t.task_id, round=t.round,
                    phase=t.phase, ok=True, session="ab" * 8, incarnation=t.incarnation,
                )  # fmt: skip
                twin.send(topics.up("default", "c1"), reply)
                with twin_sent:
                    answered.add(t.task_id)
                    twin_sent.notify_all()
            time.sleep(0.005)

    own_send = clients[1]._send

    def after_the_twin(msg, blobs=None):
        if isinstance(msg, Reply):
            with twin_sent:
                twin_sent.wait_for(lambda: msg.task_id in answered, timeout=20)
        own_send(msg, blobs)

    clients[1]._send = after_the_twin
    threading.Thread(target=answer, daemon=True).start()
    result = coordinator.run() if _started(clients) else None
    assert result.rounds[0].replied == ["c0", "c1", "c2"] and not result.rounds[0].failed
    assert coordinator.fleet.rejected["wrong_session"] >= 1
    by_id = {c.id: c for c in result.clients}
    assert by_id["c1"].personal_acc is not None
    for c in clients:
        c.stop()


def test_reassembly_holds_no_blob_for_a_stranger_and_a_models_worth_for_a_client():
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, rounds=1)
    _started(clients)
    fleet = coordinator.fleet
    eventually(lambda: fleet.online() == {"c0", "c1", "c2"} or bool(fleet.gather(5, None)))
    endpoint = fleet.endpoint
    endpoint.blob_timeout_s = 0.3
    mallory = broker.connect("mallory")
    mib = b"\0" * (1 << 20)
    for i in range(20):  # 20 MiB towards a 200 MiB blob, from nobody the run knows
        mallory.publish(topics.up("default", "x"), _chunk("big", i, 200, 200 << 20, mib))
        endpoint.pump()  # (as the coordinator takes them: checked on its thread)
    assert endpoint._held == 0 and endpoint.rejections["unexpected_blob"] == 20
    for i in range(20):  # and the same on a registered client's topic
        mallory.publish(topics.up("default", "c0"), _chunk("big", i, 200, 200 << 20, mib))
        endpoint.pump()
    # They fill c0's bound (a tiny model's worth, not hundreds of MiB); the next is refused and
    # the blob, which can never be whole now, dropped with what it held: nothing to expire.
    assert fleet._per_client_bound() < 5 << 20
    assert endpoint._held == 0 and 0 < endpoint.rejections["oversized"] < 20
    assert endpoint.rejections["blob_expired"] == 0
    for c in clients:
        c.stop()
    fleet.pause()


def test_a_flood_of_bad_messages_is_counted_whole_and_logged_once(caplog):
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), topics.up_all("r")).open()
    flood = broker.connect("flood")
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            flood.publish(topics.up("r", "c1"), b"EF1M{not json" + str(i).encode())
        header = b'{"blob": "b", "index": 1e999, "count": 2, "size": 10}'
        chunk = b"EF1C" + len(header).to_bytes(4, "big") + header + b"xx"
        flood.publish(topics.up("r", "c1"), chunk)  # an index that is not a number
        rx.pump()
    assert rx.rejections["malformed"] == 1001
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)  # no traceback
    rx.close()


@pytest.mark.parametrize("reannounce_s", [60.0, 0.0], ids=["answers", "without-the-answer"])
def test_a_client_whose_online_presence_was_lost_says_it_again_to_the_coordinators_status(
    monkeypatch, reannounce_s
):
    # A broker restarted without persistence: c2's will (offline) reached the coordinator, then
    # c2 came back before the coordinator did, so its "online" reached no one (dropped here).
    # The coordinator, back, publishes its status again; c2 answers it with its presence.
    monkeypatch.setattr(serving_mod, "REANNOUNCE_S", reannounce_s)
    broker = InMemoryBroker()
    # (no reconnection grace: c2 counts as online only once its presence arrives)
    coordinator, clients = small_federation(broker=broker, rounds=1, reconnect_grace_s=0)
    _started(clients)
    fleet = coordinator.fleet
    eventually(lambda: fleet.online() == {"c0", "c1", "c2"} or bool(fleet.gather(5, None)))
    c2 = clients[2]
    send, lost = c2._try_send, []

    def lossy(msg):
        if isinstance(msg, Presence) and msg.online and not lost:
            lost.append(msg)  # the broker lost it
            return None
        return send(msg)

    monkeypatch.setattr(c2, "_try_send", lossy)
    c2.transport.abort()  # the will fires
    eventually(lambda: "c2" not in fleet.online())
    c2.transport.connect()  # back, on a new connection; its presence is lost
    eventually(lambda: bool(lost))
    fleet._on_reconnect()  # the coordinator is back on the broker
    fleet._receive(0)  # and publishes its status again
    if reannounce_s:
        eventually(lambda: "c2" in fleet.online())
    else:
        time.sleep(1.0)
        assert "c2" not in fleet.online()
    for c in clients:
        c.stop()
    fleet.pause()


@pytest.mark.parametrize("grace_s", [10.0, 0.0], ids=["within-the-grace", "without-a-grace"])
def test_a_client_whose_connection_drops_mid_task_and_comes_back_within_the_grace_counts(grace_s):
    # c0's connection dies while it trains (its will fires) and comes back once the others
    # have replied. Within round.reconnect_grace_s the phase still waits for it, and its reply
    # (sent on the new connection) counts; with no grace the round closed without it.
    box = {}

    class Drops(EdgeClient):
        def run_task(self, task, blobs):
            result = super().run_task(task, blobs)
            if task.phase == "fit" and task.round == 1:
                fleet = box["coordinator"].fleet
                self.transport.abort()
                eventually(lambda: "c0" not in fleet.members.online)
                eventually(lambda: set(fleet._tasks) <= {"c0"})  # the others replied
                self.transport.connect()
            return result

    coordinator, clients = small_federation(client_cls=Drops, rounds=1, reconnect_grace_s=grace_s)
    box["coordinator"] = coordinator
    result = coordinator.run() if _started(clients) else None
    (record,) = result.rounds
    assert record.trained == ["c0", "c1", "c2"]
    assert record.replied == (["c0", "c1", "c2"] if grace_s else ["c1", "c2"])
    for c in clients:
        c.stop()


def test_a_client_that_says_it_is_leaving_is_not_waited_for():
    # A goodbye (SIGTERM, Ctrl-C) is not a dropped connection: with a grace as long as the
    # deadline, the fit phase still closes as soon as the others replied, without c0.
    # The run may end before c0's thread records what it saw, so the test waits for that.
    box = {}
    closed_without_c0 = threading.Event()

    class Leaves(EdgeClient):
        def run_task(self, task, blobs):
            if task.phase == "fit":
                self._try_send(
                    self._presence(self.transport.connection, online=False, leaving=True)
                )
                fleet = box["coordinator"].fleet
                eventually(lambda: "c0" not in fleet._tasks, timeout=20)
                closed_without_c0.set()
            return super().run_task(task, blobs)

    coordinator, clients = small_federation(
        client_cls=Leaves, rounds=1, reconnect_grace_s=600, deadline_s=600
    )
    box["coordinator"] = coordinator
    result = coordinator.run() if _started(clients) else None
    assert closed_without_c0.wait(30) and result.rounds[0].replied == ["c1", "c2"]
    for c in clients:
        c.stop()


def test_scraping_the_daemons_metrics_during_the_rounds_loses_no_reply():
    # The daemon's /metrics is read on the HTTP server's thread while the round loop waits for
    # replies. Counting who is online there once took in what had arrived, on that thread: a
    # reply it took was dropped as stale, and the round waited out its deadline for it.
    coordinator, clients = small_federation(rounds=4, deadline_s=10)
    collector = metrics_collector(coordinator)
    done, scrapes = threading.Event(), []

    def scrape():
        while not done.is_set():
            scrapes.append({m.name: m.samples for m in collector.collect()})

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        result = coordinator.run() if _started(clients) else None
    finally:
        done.set()
        scraper.join(10)
    assert len(scrapes) > 10
    assert [r.replied for r in result.rounds] == [["c0", "c1", "c2"]] * 4
    assert coordinator.fleet.rejections()["stale_reply"] == 0
    assert scrapes[-1]["edgefl_clients_online"][0].value == 3
    for c in clients:
        c.stop()


@pytest.mark.parametrize("unfit", [["c0"], ["c0", "c1"]], ids=["one-client", "most-clients"])
def test_a_broker_most_clients_find_lacking_ends_the_run_at_once_and_tells_them(monkeypatch, unfit):
    # Clients whose peers cannot read retained publications (RabbitMQ's cluster) fail their fit
    # tasks with RetainedNotDelivered. When most of a phase's clients say so, no round can
    # succeed: the run stops in round 1 with that reason, and the clients are told (shut down),
    # instead of every round failing in turn. One client saying so (it may lie) changes nothing.
    from coordinator.fleet import BrokerUnfit
    from edge_sdk.peers import RetainedNotDelivered

    said = "the broker did not deliver this client's own retained publication"
    run_task = EdgeClient.run_task

    def lacking(self, task, blobs):
        if task.phase == "fit" and self.client_id in unfit:
            raise RetainedNotDelivered(f"{self.client_id}: {said}")
        return run_task(self, task, blobs)

    monkeypatch.setattr(EdgeClient, "run_task", lacking)
    coordinator, clients = small_federation(rounds=2)
    if len(unfit) == 1:
        result = coordinator.run() if _started(clients) else None
        assert [r.replied for r in result.rounds] == [["c1", "c2"]] * 2
    else:
        with pytest.raises(
            BrokerUnfit, match=f"2 of 3 clients .*: RetainedNotDelivered: c0: {said}"
        ):
            coordinator.run() if _started(clients) else None
        assert coordinator.records == []  # it stopped in round 1
    for c in clients:
        assert c.wait(10) and c.finished  # told to stop, not left waiting
        c.stop()
