"""The in-memory broker's route cache: routes follow sessions and subscriptions as they change."""

from edge_sdk.transport import InMemoryBroker


def test_memory_broker_stops_routing_to_a_closed_session_after_a_cached_route():
    # Prepare: two sessions on one topic; one publish caches the topic's route.
    broker = InMemoryBroker()
    got: dict[str, list[bytes]] = {"a": [], "b": []}
    a, b, pub = broker.connect("a"), broker.connect("b"), broker.connect("pub")
    a.subscribe("t/x", lambda _t, p: got["a"].append(p))
    b.subscribe("t/+", lambda _t, p: got["b"].append(p))
    pub.publish("t/x", b"1")

    # Execute: a leaves (its session ends), b narrows its subscription, c joins.
    a.close()
    b.unsubscribe("t/+")
    b.subscribe("t/y", lambda _t, p: got["b"].append(p))
    c = broker.connect("c")
    got["c"] = []
    c.subscribe("t/#", lambda _t, p: got["c"].append(p))
    pub.publish("t/x", b"2")

    # Assert: only the subscriptions that exist now receive the second message.
    assert got == {"a": [b"1"], "b": [b"1"], "c": [b"2"]}


def test_memory_broker_drops_the_cached_route_of_a_session_that_closed():
    # Prepare
    broker = InMemoryBroker()
    got: list[bytes] = []
    a, pub = broker.connect("a"), broker.connect("pub")
    a.subscribe("t/x", lambda _t, p: got.append(p))
    pub.publish("t/x", b"1")

    # Execute: the session ends and nothing else changes before the next publish.
    a.close()
    pub.publish("t/x", b"2")

    # Assert
    assert got == [b"1"]
