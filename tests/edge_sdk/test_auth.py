"""Signed frames: keys, signatures bound to topics, replays, and what an endpoint drops."""

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_helpers import raises_exactly

from edge_sdk import topics
from edge_sdk.auth import AuthError, AuthSettings, Keyring, ReplayGuard, issue_keys, read_roster
from edge_sdk.protocol import Reply, Status, decode
from edge_sdk.transport import InMemoryBroker
from edge_sdk.wire import Endpoint, message_frame

RUN = "r"


def _reply(task_id="t", sender="c0"):
    return Reply(run=RUN, sender=sender, task_id=task_id, round=1, phase="evaluate", ok=True)


def _pair(keys, me="c0"):
    """The coordinator's endpoint on every up topic, and `me`'s sending endpoint."""
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), topics.up_all(RUN), keyring=keys["coordinator"]).open()
    tx = Endpoint(broker.connect(me), "unused", keyring=keys[me])
    return broker, rx, tx


def test_issued_keys_load_for_their_owner_only_and_are_private(tmp_path):
    paths = issue_keys(tmp_path, ["c0", "c1"])
    assert stat.S_IMODE(os.stat(paths["c0"]).st_mode) == 0o600
    assert set(read_roster(paths["roster"])) == {"coordinator", "c0", "c1"}
    mine = Keyring.load(AuthSettings(key_file=paths["c0"], roster=paths["roster"]), "c0")
    assert mine is not None and mine.me == "c0"
    with raises_exactly(
        AuthError, "this private key is not 'c1''s in the roster (wrong key file?)"
    ):
        Keyring.load(AuthSettings(key_file=paths["c0"], roster=paths["roster"]), "c1")
    with pytest.raises(AuthError, match="the roster has no key for 'c7'"):
        Keyring.load(AuthSettings(key_file=paths["c0"], roster=paths["roster"]), "c7")
    # Issuing again for one more client keeps the others' keys.
    before = paths["c0"].read_bytes()
    again = issue_keys(tmp_path, ["c0", "c1", "c2"])
    assert again["c0"].read_bytes() == before and "c2" in read_roster(again["roster"])


def test_without_keys_the_error_says_how_to_get_them_or_to_run_open():
    with pytest.raises(AuthError, match=r"edgefl keys --clients .* auth\.open=true"):
        Keyring.load(AuthSettings(), "c0")
    assert Keyring.load(AuthSettings(open=True), "c0") is None


def test_a_signed_message_reaches_its_receiver_with_the_signers_words():
    keys = Keyring.ephemeral(["coordinator", "c0", "c1"])
    _, rx, tx = _pair(keys)
    tx.send(topics.up(RUN, "c0"), _reply("hello"))
    env = rx.receive(timeout=2)
    assert env is not None and env.message.task_id == "hello" and env.message.seq > 0
    rx.close()


def test_unsigned_forged_misplaced_and_replayed_frames_are_dropped_and_counted():
    keys = Keyring.ephemeral(["coordinator", "c0", "c1"])
    broker, rx, tx = _pair(keys)
    anyone = broker.connect("mallory")
    up0 = topics.up(RUN, "c0")
    anyone.publish(up0, message_frame(_reply("unsigned")))
    good = tx.frame(up0, _reply("real"))
    anyone.publish(up0, good[:4] + bytes(64) + good[68:])  # a signature made up
    anyone.publish(up0, good[:-2] + b"x}")  # the words changed under the signature
    anyone.publish(topics.up(RUN, "c1"), good)  # c0's frame moved to c1's topic
    c1 = Endpoint(broker.connect("c1"), "unused", keyring=keys["c1"])
    c1.send(up0, _reply("c1 speaking for c0"))  # c1's signature on c0's topic
    c1.send(topics.up(RUN, "c1"), _reply("c1 claiming c0", sender="c0"))
    anyone.publish(up0, good)  # the one genuine frame
    env = rx.receive(timeout=2)
    assert env is not None and env.message.task_id == "real"
    tx.send(up0, _reply("newer"))
    assert rx.receive(timeout=2).message.task_id == "newer"
    anyone.publish(up0, good)  # replayed after a newer one
    assert rx.receive(timeout=0.3) is None
    assert dict(rx.rejections) == {
        "unsigned": 1,
        "bad_signature": 4,
        "sender_mismatch": 1,
        "replayed": 1,
    }
    rx.close()


def test_a_duplicate_delivery_is_dropped_quietly_and_a_status_is_exempt_from_sequence():
    keys = Keyring.ephemeral(["coordinator", "c0"])
    broker = InMemoryBroker()
    rx = Endpoint(
        broker.connect("c0"), [topics.status(RUN), topics.down(RUN, "c0")], keyring=keys["c0"]
    ).open()
    coordinator = Endpoint(broker.connect("coordinator"), "unused", keyring=keys["coordinator"])
    status = Status(
        run=RUN, sender="coordinator", incarnation=1, phase="fit", rounds=2, algorithm="fml",
        accepting=False,
    )  # fmt: skip
    frame = coordinator.frame(topics.status(RUN), status)
    anyone = broker.connect("anyone")
    anyone.publish(topics.status(RUN), frame, retain=True)
    anyone.publish(topics.status(RUN), frame, retain=True)  # a retained status, read again
    assert rx.receive(timeout=2) is not None and rx.receive(timeout=2) is not None
    task_frame = coordinator.frame(topics.down(RUN, "c0"), _reply("x", sender="coordinator"))
    anyone.publish(topics.down(RUN, "c0"), task_frame)
    anyone.publish(topics.down(RUN, "c0"), task_frame)  # QoS 1 delivered it twice
    assert rx.receive(timeout=2) is not None and rx.receive(timeout=0.3) is None
    assert rx.rejected == 0
    rx.close()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_no_change_to_a_signed_frame_is_accepted(data):
    keys = _KEYS
    broker, rx, tx = _pair(keys)
    frame = bytearray(tx.frame(topics.up(RUN, "c0"), _reply("z")))
    at = data.draw(st.integers(4, len(frame) - 1))
    flip = data.draw(st.integers(1, 255))
    frame[at] ^= flip
    broker.connect("mallory").publish(topics.up(RUN, "c0"), bytes(frame))
    assert rx.receive(timeout=0.05) is None
    assert rx.rejected == 1
    rx.close()


_KEYS = Keyring.ephemeral(["coordinator", "c0"])


def test_sequence_numbers_grow_across_restarts_and_threads():
    keys = Keyring.ephemeral(["c0"])
    seqs = [keys["c0"].next_seq() for _ in range(1000)]
    assert seqs == sorted(set(seqs))
    later = Keyring.ephemeral(["c0"])["c0"]  # a new process of the same participant
    assert later.next_seq() > seqs[-1]


def test_an_open_endpoint_reads_signed_frames_and_a_keyed_one_tells_why_it_drops_unsigned(
    caplog,
):
    keys = Keyring.ephemeral(["coordinator", "c0"])
    broker = InMemoryBroker()
    open_rx = Endpoint(broker.connect("open"), topics.up_all(RUN)).open()
    Endpoint(broker.connect("c0"), "unused", keyring=keys["c0"]).send(
        topics.up(RUN, "c0"), _reply("signed")
    )
    env = open_rx.receive(timeout=2)
    assert env is not None and env.message.task_id == "signed"
    open_rx.close()
    keyed = Endpoint(broker.connect("k"), topics.up_all(RUN), keyring=keys["coordinator"]).open()
    broker.connect("x").publish(topics.up(RUN, "c0"), message_frame(_reply()))
    keyed.pump()  # checked on the consumer's thread (here), not in the transport's callback
    assert keyed.rejections["unsigned"] == 1
    assert "unsigned" in caplog.text and "keyless" in caplog.text
    keyed.close()


def test_decode_of_a_signed_body_is_the_message_sent():
    keys = Keyring.ephemeral(["coordinator", "c0"])
    tx = Endpoint(InMemoryBroker().connect("c0"), "unused", keyring=keys["c0"])
    frame = tx.frame(topics.up(RUN, "c0"), _reply("same"))
    assert frame[:4] == b"EF1S" and decode(frame[68:]).task_id == "same"


def test_the_replay_record_outlives_its_process_and_orders_statuses_by_incarnation(
    tmp_path, caplog
):
    path = tmp_path / "c0.replay.json"
    down, status = topics.down(RUN, "c0"), topics.status(RUN)
    first = ReplayGuard(path)
    assert first.check(down, "task", 5) is None
    assert first.check(status, "status", 7, incarnation=2) is None
    first.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = ReplayGuard(path)  # a new process of the same device
    assert again.check(down, "task", 5) == "duplicate"
    assert again.check(down, "task", 4) == "replayed"
    assert again.check(status, "status", 7, incarnation=2) is None  # the retained one, reread
    assert again.check(status, "status", 99, incarnation=1) == "replayed"  # an earlier run's
    assert again.check(status, "status", 3, incarnation=2) == "duplicate"  # its will, late
    assert again.check(status, "status", 1, incarnation=3) is None  # a new coordinator
    assert again.check(down, "presence", 1) is None  # decided by its epoch
    path.write_text("{not json")
    fresh = ReplayGuard(path)
    assert fresh.check(down, "task", 1) is None
    assert "cannot be read" in caplog.text
