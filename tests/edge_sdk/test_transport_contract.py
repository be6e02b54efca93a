"""One contract, three implementations: in memory, a real mosquitto, the embedded amqtt broker.

Every test here runs unchanged against each (the `make_transport` fixture is parametrized).
"""

import uuid

import pytest
import torch
from tests_helpers import eventually

from edge_sdk.codec import WireModel
from edge_sdk.model_blobs import pack_models, unpack_models
from edge_sdk.protocol import Reply
from edge_sdk.transport import ConnectError, PayloadTooLarge
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec, build


@pytest.fixture
def root() -> str:
    return f"contract/{uuid.uuid4().hex[:8]}"


def _collect(transport, topic_filter):
    got: list[tuple[str, bytes]] = []
    transport.subscribe(topic_filter, lambda t, p: got.append((t, p)))
    return got


def test_publish_reaches_matching_filters_only(make_transport, root):
    pub, sub, sub2 = make_transport("pub"), make_transport("sub"), make_transport("sub2")
    one, other, many = (
        _collect(sub, f"{root}/a/+"),
        _collect(sub, f"{root}/b"),
        _collect(sub2, f"{root}/#"),
    )
    with pytest.raises(ValueError, match="overlaps"):
        sub.subscribe(f"{root}/#", lambda t, p: None)
    for topic in (f"{root}/a/x", f"{root}/a/x/deep", f"{root}/c"):
        pub.publish(topic, topic.encode()).wait(10)
    # Two connections: each gets its messages in its own time.
    eventually(lambda: len(many) == 3 and len(one) >= 1)
    assert [t for t, _ in one] == [f"{root}/a/x"]
    assert sorted(p for _, p in many) == sorted(
        t.encode() for t in (f"{root}/a/x", f"{root}/a/x/deep", f"{root}/c")
    )
    assert other == []


def test_messages_on_one_topic_arrive_in_order(make_transport, root):
    pub, sub = make_transport("pub"), make_transport("sub")
    got = _collect(sub, f"{root}/seq")
    deliveries = [pub.publish(f"{root}/seq", str(i).encode()) for i in range(200)]
    for d in deliveries:
        d.wait(10)
    eventually(lambda: len(got) == 200)
    assert [int(p) for _, p in got] == list(range(200))


def test_retained_message_reaches_late_subscribers_until_cleared(make_transport, root):
    pub = make_transport("pub")
    pub.publish(f"{root}/status", b"v1", retain=True).wait(10)
    pub.publish(f"{root}/status", b"v2", retain=True).wait(10)
    late = make_transport("late")
    got = _collect(late, f"{root}/status")
    eventually(lambda: got == [(f"{root}/status", b"v2")])
    pub.publish(f"{root}/status", b"", retain=True).wait(10)  # empty retained clears it
    eventually(lambda: len(got) == 2)
    later = make_transport("later")
    nothing = _collect(later, f"{root}/status")
    pub.publish(f"{root}/marker", b"m").wait(10)
    marker = _collect(later, f"{root}/marker")
    pub.publish(f"{root}/marker", b"m").wait(10)
    eventually(lambda: marker)
    assert nothing == []


def test_unsubscribe_stops_delivery(make_transport, root):
    pub, sub = make_transport("pub"), make_transport("sub")
    got = _collect(sub, f"{root}/u")
    pub.publish(f"{root}/u", b"1").wait(10)
    eventually(lambda: len(got) == 1)
    sub.unsubscribe(f"{root}/u")
    probe = _collect(sub, f"{root}/probe")
    pub.publish(f"{root}/u", b"2").wait(10)
    pub.publish(f"{root}/probe", b"p").wait(10)
    eventually(lambda: probe)  # the probe went after the unsubscribed publish
    assert got == [(f"{root}/u", b"1")]


def test_what_was_published_while_disconnected_arrives_after_reconnect(
    make_transport, root, broker_kind, request
):
    pub, sub = make_transport("pub"), make_transport("sub")
    got = _collect(sub, f"{root}/q")
    pub.publish(f"{root}/q", b"before").wait(10)
    eventually(lambda: len(got) == 1)
    sub.disconnect()  # clean: the session (subscription, queue) stays on the broker
    if broker_kind == "amqtt":
        # amqtt 0.12 still hands a message published between a DISCONNECT and its tearing the
        # connection down to that connection, and loses it (seen under load, 1 run in 15).
        # MQTT 3.1.1's DISCONNECT has no answer, so a client cannot wait for that; the SDK
        # copes (a task is sent again when its client is back). Disconnected means: amqtt
        # says so.
        sessions = request.getfixturevalue("amqtt_broker")._broker._sessions
        eventually(lambda: sessions[sub.client_id][0].transitions.state == "disconnected")
    for i in range(3):
        pub.publish(f"{root}/q", b"while-%d" % i).wait(10)
    sub.connect(10)
    eventually(lambda: len(got) == 4)
    assert [p for _, p in got] == [b"before", b"while-0", b"while-1", b"while-2"]


def test_a_dropped_connection_fires_its_will_and_a_clean_one_does_not(
    make_transport, root, broker_kind
):
    watcher = make_transport("watcher")
    wills = _collect(watcher, f"{root}/will/+")
    crash = make_transport("crash", will=(f"{root}/will/crash", b"offline"))
    clean = make_transport("clean", will=(f"{root}/will/clean", b"offline"))
    clean.close()
    crash.abort()
    eventually(lambda: wills)
    marker = _collect(watcher, f"{root}/marker")
    make_transport("pub").publish(f"{root}/marker", b"m").wait(10)
    eventually(lambda: marker)
    if broker_kind == "amqtt":
        # amqtt 0.12 handles a DISCONNECT and the end of the connection after it in separate
        # tasks; when the second runs first it publishes the will of a client that left
        # cleanly (its broker.py, _handle_disconnect; seen in a few full-suite runs). The SDK
        # copes (a will only says "offline"), so here amqtt is held to the crash's will only.
        assert (f"{root}/will/crash", b"offline") in wills
    else:
        assert wills == [(f"{root}/will/crash", b"offline")]


def test_payload_over_the_limit_is_refused_before_sending(make_transport, root):
    pub, sub = make_transport("pub"), make_transport("sub")
    got = _collect(sub, f"{root}/big")
    with pytest.raises(PayloadTooLarge):
        pub.publish(f"{root}/big", b"x" * (pub.max_payload_bytes + 1))
    pub.publish(f"{root}/big", b"small").wait(10)
    eventually(lambda: got)
    assert got == [(f"{root}/big", b"small")]


def test_a_closed_transport_refuses_to_publish(make_transport, root):
    t = make_transport("t")
    t.close()
    with pytest.raises(ConnectError):
        t.publish(f"{root}/x", b"1")


def test_a_failing_subscriber_does_not_stop_delivery(make_transport, root):
    pub, sub = make_transport("pub"), make_transport("sub")

    def boom(topic, payload):
        raise RuntimeError("subscriber bug")

    sub.subscribe(f"{root}/bad", boom)
    got = _collect(sub, f"{root}/good")
    pub.publish(f"{root}/bad", b"1").wait(10)
    pub.publish(f"{root}/good", b"2").wait(10)
    eventually(lambda: got)
    assert got == [(f"{root}/good", b"2")]


def test_a_model_crosses_in_many_chunks_and_arrives_whole(make_transport, root):
    spec = ArchSpec(family="mlp", num_classes=10, input_shape=(64,), kwargs={"hidden": [512]})
    model = build(spec, seed=0)
    refs, blobs = pack_models({"m": WireModel.of(spec, model)})
    rx = Endpoint(make_transport("rx"), f"{root}/in").open()
    tx = Endpoint(make_transport("tx"), f"{root}/out", chunk_bytes=16 * 1024)
    reply = Reply(run="r", sender="c0", task_id="t", round=1, phase="fit", ok=True, models=refs)
    tx.send(f"{root}/in", reply, blobs)
    env = rx.receive(timeout=20)
    assert env is not None and env.message == reply
    got = unpack_models(env.message.models, env.blobs)["m"]
    assert all(torch.equal(got.weights[k], v) for k, v in model.state_dict().items())
    rx.close()
