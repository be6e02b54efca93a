"""Bad peers cost only their own messages: each test here names one way to misbehave."""

import json
import threading

import pytest
import torch
from tests_helpers import eventually, small_federation

from edge_sdk import topics
from edge_sdk.algorithms import FitResult
from edge_sdk.client import EdgeClient
from edge_sdk.codec import WeightsError, check_weights
from edge_sdk.model_blobs import pack_models
from edge_sdk.protocol import Capabilities, Register, Registered, Status, Task, decode, encode
from edge_sdk.reassembly import BLOB_COST, CHUNK_COST, SPARE_CHUNKS
from edge_sdk.transport import InMemoryBroker
from edge_sdk.wire import Endpoint, message_frame
from model_zoo import ArchSpec


def _liar(**changes):
    """An EdgeClient whose replies carry whatever `changes` says (metrics, n_samples)."""

    class Liar(EdgeClient):
        def run_task(self, task, blobs):
            result = super().run_task(task, blobs)
            metrics = dict(result.metrics)
            if task.phase != "fit" and "metrics" in changes:
                metrics = changes["metrics"](metrics)
            n = changes.get("n_samples", result.n_samples) if task.phase == "fit" else 0
            return FitResult(models=result.models, metrics=metrics, n_samples=n)

    return Liar


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda m: {k: v for k, v in m.items() if k != "personal_total"}, id="missing"),
        pytest.param(lambda m: m | {"personal_correct": m["personal_total"] + 5}, id="above-1"),
        pytest.param(lambda m: m | {"personal_correct": -1.0}, id="negative"),
        pytest.param(lambda m: m | {"personal_total": 1e9, "personal_correct": 1.0}, id="huge"),
        pytest.param(lambda m: m | {"global_correct": 2.5}, id="fractional"),
    ],
)
def test_replies_with_malformed_metrics_are_rejected_and_the_run_goes_on(corrupt):
    coordinator, clients = small_federation(client_cls=_liar(metrics=corrupt), quorum=0.5)
    for c in clients:
        c.start()
    result = coordinator.run()
    assert len(result.rounds) == 2 and result.rounds[-1].mean_personal_acc is not None
    assert coordinator.fleet.rejected["invalid_reply"] >= 3  # two evaluations + finalize
    by_id = {c.id: c for c in result.clients}
    assert by_id["c0"].personal_acc is None and by_id["c1"].personal_acc is not None


def test_a_reply_claiming_more_samples_than_registered_is_not_averaged():
    coordinator, clients = small_federation(client_cls=_liar(n_samples=10**12), quorum=0.5)
    for c in clients:
        c.start()
    result = coordinator.run()
    assert all(r.replied == ["c1", "c2"] for r in result.rounds)
    assert coordinator.fleet.rejected["invalid_reply"] >= 2


def _raw(broker, cid):
    """A peer that publishes hand-made frames on `cid`'s up topic."""
    t = broker.connect(f"raw-{cid}")
    return lambda frame: t.publish(topics.up("default", cid), frame)


def _register(sender, incarnation, **caps):
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    capabilities = {"n_train": 10, "num_classes": 10, "algorithms": ["fedavg"]} | caps
    return Register(
        run="default", sender=sender, spec=spec, capabilities=capabilities, incarnation=incarnation
    )


def test_registrations_with_invalid_or_mismatched_senders_are_dropped():
    # Open mode (no keys): the coordinator's own checks of ids and topics (with keys, nothing
    # unsigned gets that far: tests/coordinator/test_auth.py).
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, keys={})
    inc = coordinator.incarnation
    bad_id = json.loads(encode(_register("ok", inc)))
    bad_id["sender"] = "no/slashes here"
    _raw(broker, "x")(b"EF1M" + json.dumps(bad_id).encode())  # not an id: malformed
    _raw(broker, "c9")(message_frame(_register("c1", inc)))  # on c9's topic, claims to be c1
    for c in clients:
        c.start()
    result = coordinator.run()
    assert [c.id for c in result.clients] == ["c0", "c1", "c2"]
    assert coordinator.fleet.endpoint.rejections["malformed"] == 1
    assert coordinator.fleet.rejected["sender_mismatch"] == 1


def test_a_huge_class_count_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="less than or equal"):
        Capabilities(n_train=1, num_classes=10**9)
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, keys={})
    got = []
    broker.connect("spy").subscribe(topics.down("default", "big"), lambda t, p: got.append(p))
    spec = ArchSpec(family="mlr", num_classes=50_000, input_shape=(3, 224, 224))
    big = Register(
        run="default",
        sender="big",
        spec=spec,
        capabilities={"n_train": 10, "num_classes": 50_000, "algorithms": ["fedavg"]},
        incarnation=coordinator.incarnation,
    )
    _raw(broker, "big")(message_frame(big))
    for c in clients:
        c.start()
    assert [c.id for c in coordinator.run().clients] == ["c0", "c1", "c2"]
    answer = decode(got[0][4:])
    assert answer.accepted is False and "over the limit" in answer.reason


def test_tensor_dtypes_must_match_the_architecture():
    reference = {"w": torch.zeros(2, 2), "steps": torch.zeros((), dtype=torch.int64)}
    with pytest.raises(WeightsError, match=r"is torch\.int32, expected torch\.float32"):
        check_weights(
            {"w": torch.zeros(2, 2, dtype=torch.int32), "steps": reference["steps"]}, reference
        )


# -- reassembly: memory and scope ------------------------------------------------------------
def _chunk(blob, index, count, size, data):
    header = json.dumps({"blob": blob, "index": index, "count": count, "size": size}).encode()
    return b"EF1C" + len(header).to_bytes(4, "big") + header + data


def test_reassembly_memory_is_bounded_by_bytes_received_not_by_headers():
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx", max_payload_bytes=2**21), "in", max_pending_bytes=4096)
    rx.open()
    tx = broker.connect("tx", max_payload_bytes=2**21)
    for i in range(50):  # each claims a 2-byte blob and carries 1 MiB
        tx.publish("in", _chunk(f"b{i}", 0, 2, 2, b"x" * 2**20))
        rx.pump()  # (as a consumer takes them: checked on its thread)
    assert rx._held <= 4096
    assert rx.rejected == 50
    for i in range(50):  # honest small chunks still fit, until the bound says no
        tx.publish("in", _chunk(f"s{i}", 0, 2, 200, b"y" * 100))
        rx.pump()
    assert rx._held <= 4096
    rx.close()


def test_one_sender_filling_its_bound_does_not_crowd_out_another():
    broker = InMemoryBroker()
    # room for 3 of mallory's half blobs per topic (each 200 bytes and its bookkeeping)
    half = 200 + CHUNK_COST + BLOB_COST
    rx = Endpoint(
        broker.connect("rx"), "up/+", max_pending_bytes=3 * half, max_total_pending_bytes=9 * half
    ).open()
    tx = broker.connect("tx")
    for i in range(20):  # mallory keeps sending halves of blobs that never complete
        tx.publish("up/mallory", _chunk(f"m{i}", 0, 2, 400, b"x" * 200))
    rx.pump()
    assert rx._held_by["up/mallory"] == 3 * half
    tx.publish("up/alice", _chunk("a", 0, 2, 400, b"y" * 200))
    tx.publish("up/alice", _chunk("a", 1, 2, 400, b"y" * 200))
    rx.pump()
    assert rx._blobs[("up/alice", "a")].complete
    for who in ("bob", "carol", "dave"):  # many senders: the total bound holds as well
        for i in range(5):
            tx.publish(f"up/{who}", _chunk(f"{who}{i}", 0, 2, 400, b"z" * 200))
    rx.pump()
    assert rx._held <= 9 * half
    rx.close()


def test_a_flood_of_tiny_chunks_is_bounded_by_their_count_and_bookkeeping():
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), "in", max_pending_bytes=1 << 20).open()
    tx = broker.connect("tx")
    for i in range(5000):  # one-byte chunks: 5,000 bytes, far under the byte bound alone
        tx.publish("in", _chunk(f"a{i}", 0, 2, 2, b"x"))
        tx.publish("in", _chunk(f"b{i // 999}", 1 + i % 999, 1000, 1000, b"x"))
        rx.pump()
    cap = rx.chunk_bound(1 << 20)  # 2 whole chunks and SPARE_CHUNKS
    assert cap == 2 + SPARE_CHUNKS and rx._chunks <= cap
    assert rx._held <= 1 << 20 and rx.rejections["oversized"] > 9000
    rx.close()


def test_incomplete_blobs_expire_on_a_timer_without_receive():
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), "in", blob_timeout_s=0.1).open()
    broker.connect("tx").publish("in", _chunk("half", 0, 2, 20, b"x" * 10))
    rx.pump()  # filed by its consumer; then nobody receives
    assert rx._held == 10 + CHUNK_COST + BLOB_COST
    eventually(lambda: rx._held == 0 and not rx._blobs, timeout=3)
    rx.close()


def test_one_peer_cannot_preempt_another_peers_blob():
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), topics.up_all("r")).open()
    spec = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
    from edge_sdk.codec import WireModel
    from model_zoo import build

    refs, blobs = pack_models({"m": WireModel.of(spec, build(spec, seed=0))})
    blob_id = refs["m"].blob.id
    # Mallory sees the id go by and races a blob of her own under it, on her own topic.
    mallory = broker.connect("mallory")
    mallory.publish(topics.up("r", "mallory"), _chunk(blob_id, 0, 1, 5, b"evil!"))
    alice = Endpoint(broker.connect("alice"), "unused")
    from edge_sdk.protocol import Reply

    reply = Reply(run="r", sender="alice", task_id="t", round=1, phase="fit", ok=True, models=refs)
    alice.send(topics.up("r", "alice"), reply, blobs)
    env = rx.receive(timeout=2)
    assert env is not None and env.blobs[blob_id] == blobs[blob_id]
    assert env.topic == topics.up("r", "alice")
    rx.close()


# -- the client side -----------------------------------------------------------------------
def _fit_task(config, task_id="t1", run="default", sender="coordinator", incarnation=1):
    return Task(
        run=run,
        sender=sender,
        task_id=task_id,
        round=1,
        rounds=2,
        phase="evaluate",
        algorithm="local",
        config=config,
        incarnation=incarnation,
    )


def _registered_client(broker, coordinator, client):
    """Start `client` and play its coordinator (signing with the coordinator's key, incarnation
    1) up to an accepted registration; returns the coordinator's voice, an Endpoint that signs."""
    voice = Endpoint(
        broker.connect("coordinator-voice"), "unused", keyring=coordinator.fleet.keyring
    )
    client.start()
    status = Status(
        run="default",
        sender="coordinator",
        incarnation=1,
        phase="registering",
        rounds=2,
        algorithm="local",
        accepting=True,
    )
    voice.send(topics.status("default"), status, retain=True)
    eventually(lambda: client.status is not None)
    answer = Registered(
        run="default", sender="coordinator", accepted=True, session=client.session, incarnation=1
    )
    voice.send(topics.down("default", client.client_id), answer)
    eventually(lambda: client.accepted)
    return voice


def test_a_client_obeys_only_its_runs_coordinator_on_its_own_down_topic():
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, incarnation=1)
    client = clients[0]
    voice = _registered_client(broker, coordinator, client)
    cfg = {"local_epochs": 1}
    voice.send(topics.bcast("default"), _fit_task(cfg, "on-bcast"))
    voice.send(topics.down("default", "c0"), _fit_task(cfg, "other-run", run="x"))
    voice.send(topics.down("default", "c0"), _fit_task(cfg, "fake", sender="c1"))
    voice.send(topics.down("default", "c1"), _fit_task(cfg, "not-mine"))
    anyone = broker.connect("someone")  # unsigned, or signed by a client: not the coordinator
    anyone.publish(topics.down("default", "c0"), message_frame(_fit_task(cfg, "unsigned")))
    c1 = Endpoint(broker.connect("c1-voice"), "unused", keyring=clients[1].keyring)
    c1.send(topics.down("default", "c0"), _fit_task(cfg, "signed-by-c1"))
    voice.send(topics.down("default", "c0"), _fit_task(cfg, "real"))
    eventually(lambda: client.tasks_done == 1)
    assert list(client._seen) == ["real"]
    rejected = client.endpoint.rejections
    assert (rejected["sender_mismatch"], rejected["unsigned"], rejected["bad_signature"]) == (
        2,
        1,
        1,
    )
    client.stop()


def test_a_task_whose_config_differs_is_refused_and_the_state_is_kept():
    broker = InMemoryBroker()
    coordinator, clients = small_federation(broker=broker, incarnation=1)
    client = clients[0]
    replies = []
    broker.connect("spy").subscribe(topics.up("default", "c0"), lambda t, p: replies.append(p))
    voice = _registered_client(broker, coordinator, client)
    voice.send(topics.down("default", "c0"), _fit_task({"local_epochs": 1}, "a"))
    eventually(lambda: client.tasks_done == 1)
    algorithm = client.algorithm
    before = {k: v.clone() for k, v in algorithm.model.state_dict().items()}
    voice.send(topics.down("default", "c0"), _fit_task({"local_epochs": 7}, "b"))
    eventually(lambda: client.tasks_done == 2)
    last = decode([p for p in replies if p.startswith(b"EF1S")][-1][4 + 64 :])
    assert last.ok is False and "differs" in last.error
    assert client.algorithm is algorithm
    assert all(torch.equal(before[k], v) for k, v in algorithm.model.state_dict().items())
    client.stop()


def test_a_chunk_header_nested_deeper_than_json_can_parse_is_counted_as_malformed():
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect("rx"), "in").open()
    deep = b"[" * 100_000 + b"]" * 100_000
    broker.connect("tx").publish("in", b"EF1C" + len(deep).to_bytes(4, "big") + deep + b"x")
    rx.pump()
    assert rx.rejections == {"malformed": 1}
    rx.close()


class _Boaster(EdgeClient):
    """c0: every blob of its replies declares 10**12 bytes in its chunk header."""

    def _send(self, msg, blobs=None):
        for blob_id in blobs or {}:
            self.transport.publish(self._up, _chunk(blob_id, 0, 2, 10**12, b"x"))
        self.endpoint.send(self._up, msg)


def test_a_reply_whose_blob_declares_a_terabyte_fails_its_task_at_once():
    coordinator, clients = small_federation(client_cls=_Boaster, rounds=1, deadline_s=600)
    for c in clients:
        c.start()
    done: list = []
    runner = threading.Thread(target=lambda: done.append(coordinator.run()), daemon=True)
    runner.start()
    runner.join(120)  # a round that waited for c0's blob would take its 600 s deadline
    for c in clients:
        c.stop()
    assert done, "the round waited for a blob that was refused"
    assert done[0].rounds[0].replied == ["c1", "c2"]
    assert coordinator.fleet.rejected["invalid_reply"] >= 1
