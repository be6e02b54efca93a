"""Replays across runs: a previous run's signed words mean nothing to a later run with the same
run id and keys. Each coordinator start binds its messages to a fresh incarnation nonce, a
client obeys a shutdown only from the incarnation it registered with, and its replay record
lives in its state directory."""

from tests_helpers import small_federation

from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.protocol import Shutdown, Status, decode
from edge_sdk.transport import InMemoryBroker


def _signed(frame):
    return decode(frame[4 + 64 :]) if frame.startswith(b"EF1S") else None


def _recorder(broker):
    """Every signed frame on the coordinator's topics, as published."""
    frames = []
    spy = broker.connect("spy")
    for flt in (topics.status("default"), f"{topics.ROOT}/default/down/+"):
        spy.subscribe(flt, lambda topic, payload: frames.append((topic, payload)))
    return frames


def _run(coordinator, clients):
    for c in clients:
        c.start()
    try:
        return coordinator.run()
    finally:
        for c in clients:
            c.stop()


def test_a_previous_runs_shutdown_and_finished_status_replayed_into_a_new_run_are_ignored(
    tmp_path,
):
    keys = Keyring.ephemeral([topics.COORDINATOR, "c0", "c1", "c2"])
    state = tmp_path / "state"
    # Run 1, recorded by someone on the (open) broker.
    first = InMemoryBroker()
    frames = _recorder(first)
    _run(*small_federation(broker=first, rounds=1, keys=keys, state_dir=state))
    shutdown = next(
        p
        for t, p in frames
        if t == topics.down("default", "c2") and isinstance(_signed(p), Shutdown)
    )
    finished = next(
        p for t, p in frames if isinstance(m := _signed(p), Status) and m.phase == "finished"
    )
    # Run 2: same run id, same keys, same devices; the recording is replayed, retained, after
    # the coordinator announced itself and before the clients start.
    second = InMemoryBroker()
    coordinator, clients = small_federation(broker=second, rounds=1, keys=keys, state_dir=state)
    mallory = second.connect("mallory")
    mallory.publish(topics.down("default", "c2"), shutdown, retain=True)
    mallory.publish(topics.status("default"), finished, retain=True)
    result = _run(coordinator, clients)
    assert [c.error for c in result.clients] == [None, None, None]
    assert all(c.personal_acc is not None for c in result.clients)
    assert all(r.replied == ["c0", "c1", "c2"] for r in result.rounds)
    assert not any(c.refused for c in clients)


def test_a_finished_status_replayed_over_the_current_one_is_replaced_at_once():
    # An old run's "finished" status is replayed, retained, over the running coordinator's.
    # The fleet reads its status topic back and publishes its own again within STATUS_AGAIN_S,
    # so a device that starts now reads the current one; its periodic refresh (every 30 s, for
    # brokers that lose retained messages) would come after such a device gave up (6 s).
    keys = Keyring.ephemeral([topics.COORDINATOR, "c0", "c1", "c2"])
    first = InMemoryBroker()
    frames = _recorder(first)
    _run(*small_federation(broker=first, rounds=1, keys=keys))
    finished = next(
        p for t, p in frames if isinstance(m := _signed(p), Status) and m.phase == "finished"
    )
    second = InMemoryBroker()
    coordinator, _ = small_federation(broker=second, rounds=1, keys=keys)
    fleet = coordinator.fleet
    fleet._receive(0.3)  # (what the fleet's first wait does: it republishes once connected)
    retained = []
    second.connect("mallory").publish(topics.status("default"), finished, retain=True)
    fleet._receive(1.0)
    second.connect("late").subscribe(topics.status("default"), lambda t, p: retained.append(p))
    status = _signed(retained[-1])
    assert (status.phase, status.incarnation) == ("registering", coordinator.incarnation)
    assert fleet.rejections() == {}
    fleet.pause()
