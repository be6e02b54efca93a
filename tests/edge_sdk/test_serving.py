"""How an EdgeClient is served: its registration retries, and many clients served by one thread
with `open()` and `step()` (as the fleet benchmark serves thousands), over the in-memory broker."""

import threading
import time

import torch
from tests_helpers import small_federation

import edge_sdk.serving as serving_mod
from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.client import EdgeClient
from edge_sdk.client_data import ClientData
from edge_sdk.node import ClientNode
from edge_sdk.protocol import Register, Status, decode
from edge_sdk.transport import InMemoryBroker
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec


def _data(n=8):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.arange(n) % 10
    return ClientData(x, y, x[:2], y[:2], x[:2], y[:2], num_classes=10)


def test_an_unanswered_registration_is_sent_again_less_and_less_often(monkeypatch):
    # A coordinator that never answers (it is admitting thousands): the client registers when
    # it first sees the run's status, then again after 2, 4, 8, 16 s and every 30 s after that
    # (jitter pinned to 1), and a status published again meanwhile (every 2 s) triggers
    # nothing. A new coordinator incarnation is registered with at once, and the waits start
    # over. Before, every status and every 2 s sent a registration again.
    clock = [1000.0]
    monkeypatch.setattr(serving_mod, "_now", lambda: clock[0])
    monkeypatch.setattr(serving_mod.random, "uniform", lambda a, b: 1.0)
    broker = InMemoryBroker()
    keys = Keyring.ephemeral([topics.COORDINATOR, "c0"])
    registered = []

    def on_up(topic, payload):
        if isinstance(decode(payload[68:]), Register):
            registered.append(clock[0] - 1000)

    broker.connect("spy").subscribe(topics.up("default", "c0"), on_up)
    coordinator = Endpoint(
        broker.connect("coordinator"), [topics.up_all("default")], keyring=keys["coordinator"]
    )
    spec = ArchSpec(family="mlr", input_shape=(1, 8, 8), num_classes=10)
    client = EdgeClient(ClientNode("c0", spec, _data()), broker.connect("c0"), keyring=keys["c0"])
    client.open()

    def status(incarnation):
        msg = Status(
            run="default",
            sender=topics.COORDINATOR,
            incarnation=incarnation,
            phase="registering",
            rounds=1,
            algorithm="fedavg",
            accepting=True,
        )
        coordinator.send(topics.status("default"), msg, retain=True)
        while (env := client.endpoint.receive(timeout=10)) is None:  # (a wake-up: connected)
            client.step(None)
        client.step(env)

    status(7)
    for _ in range(200):  # 100 s, a status every 2 s and the idle step every 0.5 s
        clock[0] += 0.5
        if clock[0] % 2 == 0:
            status(7)
        client.step(None)
    assert registered == [0, 2, 6, 14, 30, 60, 90]
    status(8)  # the coordinator restarted
    for _ in range(8):
        clock[0] += 0.5
        client.step(None)
    assert registered[7:] == [100, 102]
    client.stop()


def test_a_connection_that_came_back_makes_the_next_step_due_at_once_and_it_says_online():
    # A host serving thousands with step() calls it for an idle client only once idle_wait()
    # runs out: a client whose connection dropped (its will said offline) and came back must
    # be due at once, or the coordinator counts it gone for up to a second more.
    broker = InMemoryBroker()
    keys = Keyring.ephemeral([topics.COORDINATOR, "c0"])
    said = []
    broker.connect("spy").subscribe(
        topics.up("default", "c0"), lambda topic, payload: said.append(decode(payload[68:]))
    )
    spec = ArchSpec(family="mlr", input_shape=(1, 8, 8), num_classes=10)
    client = EdgeClient(ClientNode("c0", spec, _data()), broker.connect("c0"), keyring=keys["c0"])
    client.open()
    client.step(None)  # (its first connection, announced)
    assert client.idle_wait() > 0

    client.transport.abort()  # no DISCONNECT: its will fires
    client.transport.connect()
    assert [m.online for m in said[1:]] == [False]
    assert client.idle_wait() == 0
    client.step(None)
    assert [m.online for m in said[1:]] == [False, True]
    assert client.idle_wait() > 0  # announced: idle again
    client.stop()


def test_one_thread_serves_many_clients_with_open_and_step_and_ends_like_threads_do():
    # The same federation twice: each client on a thread of its own (start), then all three
    # served in turn by this test's thread (open, then step with what each received).
    def federation():
        return small_federation(n=3, rounds=3, config={"local_epochs": 1, "lr": 0.1})

    coordinator, clients = federation()
    for c in clients:
        c.start()
    threaded = coordinator.run()
    for c in clients:
        c.stop()

    coordinator, clients = federation()
    box = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", coordinator.run()))
    for c in clients:
        c.open()
    runner.start()
    serving = set(clients)
    # (until every client has seen the end: the coordinator's run returns once it has said it,
    # which a client on a loaded machine may not have read yet)
    deadline = time.monotonic() + 120
    while serving and time.monotonic() < deadline:
        for c in list(serving):
            if c.step(c.endpoint.receive(timeout=0.01)):
                serving.discard(c)
    runner.join(60)
    served = box["result"]
    assert not serving and all(c.finished for c in clients)
    assert [c.personal_acc for c in served.clients] == [c.personal_acc for c in threaded.clients]
    assert [r.replied for r in served.rounds] == [["c0", "c1", "c2"]] * 3
    assert [(r.online, r.offline) for r in served.rounds] == [(3, [])] * 3
    for c in clients:
        c.stop()
