"""The peer channel (decentralized algorithms), on memory, mosquitto and amqtt alike."""

import threading
import uuid

import pytest
import torch

from edge_sdk import peers
from edge_sdk.codec import WireModel
from edge_sdk.peers import PeerChannel, RetainedNotDelivered
from edge_sdk.transport import InMemoryBroker
from model_zoo import ArchSpec, build

SPEC = ArchSpec(family="mlp", num_classes=4, input_shape=(32,), kwargs={"hidden": [512]})


def _model(seed):
    return WireModel.of(SPEC, build(SPEC, seed=seed))


def _same(a, b):
    return a.spec == b.spec and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def _pair(make_transport):
    run = f"peers-{uuid.uuid4().hex[:6]}"
    a = PeerChannel(make_transport("a"), run, "a").open()
    b = PeerChannel(make_transport("b"), run, "b").open()
    a.inbox.chunk_bytes = b.inbox.chunk_bytes = 16 * 1024  # a model in several chunks
    return a, b


def test_a_published_model_is_fetched_from_its_retained_publication(make_transport):
    a, b = _pair(make_transport)
    m1, m2 = _model(1), _model(2)
    a.publish("model", m1, version=1)
    got = b.fetch("a", "model", min_version=1, timeout=10)
    assert got is not None and _same(got, m1)
    # An older version is not taken while a newer one is wanted: the fetch waits for it.
    later = threading.Timer(0.3, lambda: a.publish("model", m2, version=2))
    later.start()
    got = b.fetch("a", "model", min_version=2, timeout=10)
    later.join()
    assert got is not None and _same(got, m2)
    assert b.fetch("nobody", "model", timeout=0.3) is None


def test_messages_between_peers_arrive_by_round_and_sender(make_transport):
    a, b = _pair(make_transport)
    m1, m2 = _model(3), _model(4)
    a.send("b", "grad", 1, m1)
    a.send("b", "grad", 2, m2)
    got = b.receive("grad", 2, ["a"], timeout=10)
    assert set(got) == {"a"} and _same(got["a"], m2)
    assert b.receive("grad", 1, ["a"], timeout=0.2) == {}  # an older round is dropped once past


def _forgetting_retained(transport):
    """`transport` on a broker that drops the retained flag (RabbitMQ's MQTT plugin does, for a
    reader on another node or under a wildcard filter): live subscribers get every message,
    later ones none."""
    publish = transport.publish
    transport.publish = lambda topic, payload, *, retain=False: publish(topic, payload)
    return transport


def test_a_broker_that_keeps_no_retained_publication_is_named_at_the_first_publish(monkeypatch):
    monkeypatch.setattr(peers, "RETAINED_CHECK_S", 0.3)
    broker = InMemoryBroker()
    lost = PeerChannel(_forgetting_retained(broker.connect("a")), "run", "a").open()
    with pytest.raises(RetainedNotDelivered, match=r"RabbitMQ.*per node") as err:
        lost.publish("model", _model(1), version=1)
    assert "peer/a/pub/model" in str(err.value) and "EMQX" in str(err.value)
    # Every later round fails at once for the same reason, without waiting again.
    monkeypatch.setattr(peers, "read_retained", lambda *a, **k: pytest.fail("read again"))
    with pytest.raises(RetainedNotDelivered, match="RabbitMQ"):
        lost.publish("model", _model(1), version=2)
    # On a broker that keeps it, the publication is read back once, then never again.
    kept = PeerChannel(broker.connect("b"), "run", "b").open()
    monkeypatch.undo()
    kept.publish("model", _model(2), version=1)
    reads = []
    monkeypatch.setattr(peers, "read_retained", lambda *a, **k: reads.append(a) or None)
    kept.publish("model", _model(3), version=2)
    assert reads == []
