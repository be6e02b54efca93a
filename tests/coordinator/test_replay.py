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
