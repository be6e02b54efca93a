"""The transport's callback only enqueues (issue 48): signatures, replay checks, decoding and
chunk hashing run on the thread that takes messages from the endpoint, never on the transport's
thread (paho's network thread over MQTT, the publisher's in memory); and what waits for that
thread is bounded, in all and per topic, dropping and counting what does not fit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import edge_sdk.reassembly as reassembly
import edge_sdk.wire as wire
from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.codec import WireModel
from edge_sdk.model_blobs import pack_models
from edge_sdk.protocol import Reply, Shutdown
from edge_sdk.transport import InMemoryBroker
from edge_sdk.wire import FRAME_COST, MIN_TOPIC_QUEUED_BYTES, Endpoint
from model_zoo import ArchSpec

RUN = "r"


def _transports(kind, request):
    if kind == "memory":
        broker = InMemoryBroker()
        return broker.connect("rx"), broker.connect("tx"), lambda: None
    from edge_sdk.transport.mqtt import MqttTransport

    url = request.getfixturevalue("mosquitto").url
    rx, tx = MqttTransport(url, "edgefl-inbox-rx"), MqttTransport(url, "edgefl-inbox-tx")
    return rx.connect(), tx.connect(), lambda: (rx.close(), tx.close())


@pytest.mark.parametrize("kind", ["memory", "mosquitto"])
def test_signatures_decoding_and_chunk_hashes_run_on_the_consumers_thread(
    kind, request, monkeypatch
):
    # Prepare: the coordinator's endpoint (its keyring checks every frame), every step that
    # inspects a frame recording the thread it ran on, and the transport's callback too.
    rx_t, tx_t, close = _transports(kind, request)
    keys = Keyring.ephemeral([topics.COORDINATOR, "c0"])
    ran: dict[str, set[threading.Thread]] = {}

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            ran.setdefault(name, set()).add(threading.current_thread())
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Keyring, "verify", recorded("verify", Keyring.verify))
    monkeypatch.setattr(wire, "decode", recorded("decode", wire.decode))
    monkeypatch.setattr(reassembly._Blob, "add", recorded("hash", reassembly._Blob.add))
    rx = Endpoint(rx_t, topics.up_all(RUN), keyring=keys[topics.COORDINATOR], chunk_bytes=64)
    monkeypatch.setattr(rx, "_on_payload", recorded("callback", rx._on_payload))
    rx.open()
    spec = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
    weights = {"fc.weight": torch.ones(3, 4), "fc.bias": torch.zeros(3)}
    refs, blobs = pack_models({"model": WireModel(spec, weights)})
    reply = Reply(run=RUN, sender="c0", task_id="t", round=1, phase="fit", ok=True, models=refs)
    tx = Endpoint(tx_t, "unused", keyring=keys["c0"], chunk_bytes=64)
    got = []

    def consume():
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            if (env := rx.receive(timeout=0.1)) is not None:
                got.append(env)

    consumer = threading.Thread(target=consume)
    consumer.start()

    # Execute: c0 sends a signed reply with its model in chunks (from this thread).
    tx.send(topics.up(RUN, "c0"), reply, blobs)
    consumer.join(30)

    # Assert: it arrived whole; the transport called back on its own thread (this one in
    # memory, paho's over MQTT), and every check ran on the consumer's thread alone.
    try:
        assert got and got[0].message.task_id == "t"
        assert len(blobs[refs["model"].blob.id]) > 64  # (so it came in several chunks)
        assert consumer not in ran["callback"]
        if kind == "memory":
            assert ran["callback"] == {threading.current_thread()}
        assert ran["verify"] == ran["decode"] == ran["hash"] == {consumer}
    finally:
        rx.close()
        close()


def test_a_flood_waiting_for_a_busy_consumer_is_bounded_per_topic_and_counted():
    # Prepare: nobody takes from the endpoint meanwhile (its consumer is training, say).
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), "up/+", max_pending_bytes=1 << 20).open()
    mallory, alice = broker.connect("mallory"), broker.connect("alice")
    frame = b"X" * 65536  # garbage: each is malformed, once someone looks at it
    n = 80  # 5 MiB and more, over a topic's share

    # Execute
    for _ in range(n):
        mallory.publish("up/mallory", frame)
    alice.publish("up/alice", wire.message_frame(Shutdown(run=RUN, sender="alice")))

    # Assert: mallory's topic held what fits its share (computed here), the rest was dropped
    # and counted at once; alice's message still waits, and comes.
    fits = MIN_TOPIC_QUEUED_BYTES // (len(frame) + FRAME_COST)
    assert rx.max_topic_queued_bytes == MIN_TOPIC_QUEUED_BYTES
    assert rx.rejections == {"queue_full": n - fits}
    env = rx.receive(timeout=1)
    assert env is not None and env.message.sender == "alice"
    assert rx.rejections == {"queue_full": n - fits, "malformed": fits}
    assert rx.queued_bytes == 0
    rx.close()


def test_the_inbox_holds_at_most_its_total_whatever_the_topics():
    broker = InMemoryBroker()
    total = 10 * (1000 + FRAME_COST)
    rx = Endpoint(broker.connect("rx"), "up/+", max_queued_bytes=total).open()
    tx = broker.connect("tx")
    for i in range(25):  # a sender per frame: no topic's share is what stops them
        tx.publish(f"up/s{i}", b"X" * 1000)
    assert rx.queued_bytes == total
    assert rx.rejections == {"queue_full": 15}
    assert rx.pump() == 10 and rx.queued_bytes == 0
    rx.close()
