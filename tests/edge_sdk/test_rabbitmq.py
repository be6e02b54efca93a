"""The SDK against RabbitMQ's MQTT plugin (Debian's rabbitmq-server 3.10), one node started by
benchmarks/rabbitmq_cluster.py: what works, and the clear error where it lacks what the SDK needs.
Skipped where rabbitmq-server is not installed (`make test` installs it as root; the
broker-cluster benchmark runs three nodes)."""

import threading
import uuid

import pytest
from tests_helpers import load_benchmark

from edge_sdk import peers
from edge_sdk.codec import WireModel
from edge_sdk.peers import PeerChannel, RetainedNotDelivered
from edge_sdk.transport.mqtt import MqttTransport
from model_zoo import ArchSpec, build

rabbitmq = load_benchmark("rabbitmq_cluster", "rabbitmq_cluster")

pytestmark = pytest.mark.skipif(
    rabbitmq.rabbitmq_missing() is not None, reason=str(rabbitmq.rabbitmq_missing())
)


@pytest.fixture(scope="module")
def node():
    with rabbitmq.RabbitCluster(1) as cluster:
        yield cluster.urls[0]


def test_rabbitmq_is_spoken_to_in_311_and_carries_live_qos1_messages(node):
    a = MqttTransport(node, f"a-{uuid.uuid4().hex[:6]}").connect(30)
    b = MqttTransport(node, f"b-{uuid.uuid4().hex[:6]}").connect(30)
    got = threading.Event()
    b.subscribe("edgefl/r/up/c0", lambda topic, payload: got.set())
    a.publish("edgefl/r/up/c0", b"hello").wait(10)
    assert (a.protocol_version, b.protocol_version) == ("3.1.1", "3.1.1")
    assert got.wait(10)
    a.close()
    b.close()


def test_a_peer_publication_on_rabbitmq_fails_at_once_naming_the_cause(node, monkeypatch):
    # RabbitMQ sends no retained message under a wildcard filter (the chunks' `.../+`): no peer
    # could ever read the publication, so the first one raises instead of leaving them waiting.
    monkeypatch.setattr(peers, "RETAINED_CHECK_S", 2.0)
    spec = ArchSpec(family="mlr", num_classes=4, input_shape=(8,))
    channel = PeerChannel(MqttTransport(node, f"p-{uuid.uuid4().hex[:6]}").connect(30), "r", "c0")
    channel.open()
    try:
        with pytest.raises(RetainedNotDelivered, match="RabbitMQ"):
            channel.publish("model", WireModel.of(spec, build(spec, seed=0)), version=1)
    finally:
        channel.close()
        channel.transport.close()
