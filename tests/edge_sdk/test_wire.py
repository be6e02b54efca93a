"""Codec, protocol and framing: bad input gets a specific error and the endpoint keeps serving."""

import json
import os
import threading
import time

import pytest
import torch

from edge_sdk import topics
from edge_sdk.codec import (
    PayloadError,
    WeightsError,
    WireModel,
    check_weights,
    clones,
    decode_weights,
    encode_weights,
    state_of,
)
from edge_sdk.ids import unique_id
from edge_sdk.model_blobs import pack_models, unpack_models
from edge_sdk.protocol import (
    ProtocolError,
    ProtocolVersionError,
    Register,
    Reply,
    Shutdown,
    decode,
    encode,
)
from edge_sdk.transport import InMemoryBroker, PayloadTooLarge
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec, build

SPEC = ArchSpec(family="mlp", num_classes=3, input_shape=(4,), kwargs={"hidden": [5]})


def _model() -> WireModel:
    return WireModel.of(SPEC, build(SPEC, seed=0))


def _reply(refs=None) -> Reply:
    return Reply(
        run="r", sender="c0", task_id="t", round=1, phase="fit", ok=True, models=refs or {}
    )


# -- codec ---------------------------------------------------------------------------------
def test_weights_round_trip_exactly():
    m = _model()
    back = decode_weights(encode_weights(m.weights))
    assert back.keys() == m.weights.keys()
    assert all(torch.equal(back[k], m.weights[k]) for k in back)


def test_fp16_transfer_halves_size_and_returns_float32():
    spec = SPEC.with_(input_shape=(64,), kwargs={"hidden": [200]})
    m = WireModel.of(spec, build(spec, seed=0))
    full, half = encode_weights(m.weights), encode_weights(m.weights, fp16=True)
    back = decode_weights(half)
    assert len(half) < 0.75 * len(full)
    assert all(v.dtype == torch.float32 for v in back.values())
    assert all(torch.allclose(back[k], m.weights[k], atol=1e-3) for k in back)


def test_corrupt_and_oversized_blobs_are_refused():
    data = encode_weights(_model().weights)
    with pytest.raises(PayloadError, match="corrupt"):
        decode_weights(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(PayloadError, match="over the limit"):
        decode_weights(data, max_bytes=10)
    with pytest.raises(PayloadError, match="over the limit"):
        encode_weights(_model().weights, max_bytes=10)


def test_decoded_tensors_are_views_of_a_received_buffer_and_copies_of_bytes():
    data = encode_weights(_model().weights)
    received = bytearray(data)  # what Endpoint.receive hands out: a writable buffer
    key = next(iter(_model().weights))
    decode_weights(memoryview(received))[key].add_(1)
    assert bytes(received) != data  # a view: no copy of a 40 MB model per client
    frozen = bytes(bytearray(data))  # its own object (bytes(data) would be data itself)
    decode_weights(frozen)[key].add_(1)
    assert frozen == data  # immutable bytes are never written through


def _blob(entries: dict, body: bytes) -> bytes:
    header = json.dumps(entries).encode()
    return len(header).to_bytes(8, "little") + header + body


@pytest.mark.parametrize(
    "offsets",
    [[[0, 4], [0, 4]], [[0, 4], [8, 12]], [[4, 8], [0, 4], [8, 12]]],
    ids=["overlap", "hole", "unused-tail"],
)
def test_weights_blobs_whose_tensors_do_not_tile_the_data_are_refused(offsets):
    entries = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": o}
        for i, o in enumerate(offsets[:2])
    }
    body = bytes(max(e for _, e in offsets))
    with pytest.raises(PayloadError, match="corrupt"):
        decode_weights(_blob(entries, body))


def test_an_empty_tensor_may_share_its_offset_with_the_next_one():
    entries = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},  # listed after "a"
    }
    got = decode_weights(_blob(entries, bytes(4)))
    assert got["a"].tolist() == [0.0] and got["b"].shape == (0,)


def test_nan_weights_and_wrong_shapes_are_refused():
    m = _model()
    bad = dict(m.weights)
    key = next(iter(bad))
    bad[key] = bad[key].clone().fill_(float("nan"))
    with pytest.raises(WeightsError, match="NaN"):
        check_weights(bad)
    wrong = dict(m.weights)
    wrong[key] = torch.zeros(2, 2)
    with pytest.raises(WeightsError, match="shape"):
        check_weights(wrong, m.weights)
    missing = dict(m.weights)
    del missing[key]
    with pytest.raises(WeightsError, match="missing"):
        check_weights(missing, m.weights)
    check_weights(missing, m.weights, partial=True)  # a subset is fine when partial


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_value_in_any_tensor_is_found_and_named(dtype, value):
    weights = {
        "a": torch.full((3, 2), 60000.0, dtype=dtype),  # large and finite in every dtype
        "empty": torch.zeros(0, dtype=dtype),
        "steps": torch.tensor([1, 2]),  # integers are not checked
        "b": torch.ones(2, 3, dtype=dtype),
        "c": torch.ones(4, dtype=dtype),
    }
    check_weights(weights)
    weights["b"][1, 2] = value
    with pytest.raises(WeightsError, match="tensor 'b' contains NaN or inf"):
        check_weights(weights)


def test_state_of_copies_a_models_weights_detached_into_new_standard_layout_memory():
    # Prepare: a cnn whose convolution weights are channels_last (as a CUDA trainer lays them
    # out); its parameters require grad
    spec = ArchSpec(family="cnn1", num_classes=3, input_shape=(1, 8, 8), kwargs={"hidden": 4})
    model = build(spec, seed=1).to(memory_format=torch.channels_last)
    live = dict(model.state_dict(keep_vars=True))
    assert any(t.dim() == 4 and not t.is_contiguous() for t in live.values())

    # Execute
    got = state_of(model)

    # Assert: the same values in new, contiguous memory, not tied to autograd or to the model
    assert got.keys() == live.keys()
    for k, t in live.items():
        c = got[k]
        assert torch.equal(c, t.detach()) and c.dtype == t.dtype and c.is_contiguous(), k
        assert (
            not c.requires_grad and c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        )
    with torch.no_grad():
        for t in live.values():
            t.add_(1.0)
    assert all(not torch.equal(got[k], t) for k, t in live.items())


@pytest.mark.parametrize("foreach", [True, False])
def test_clones_are_new_memory_in_the_layout_asked_for(foreach, monkeypatch):
    if not foreach:  # a torch without _foreach_clone (a device's own build may be older)
        monkeypatch.delattr(torch, "_foreach_clone", raising=False)
    x = torch.arange(2 * 3 * 4 * 5.0).view(2, 3, 4, 5)
    images = [x, x.to(memory_format=torch.channels_last), x[:, :, 1:3].double()]
    cases = [
        ([*images, x[:, 1], torch.ones(3)], torch.contiguous_format),
        (images, torch.channels_last),
    ]
    for ts, layout in cases:
        got = clones(ts, layout)
        assert len(got) == len(ts)
        for c, t in zip(got, ts, strict=True):
            assert (
                torch.equal(c, t) and c.dtype == t.dtype and c.is_contiguous(memory_format=layout)
            )
            assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert clones([], torch.contiguous_format) == []


def test_unpack_checks_weights_against_the_arch_spec():
    refs, blobs = pack_models({"global": _model()})
    assert unpack_models(refs, blobs)["global"].spec == SPEC
    other = SPEC.with_(num_classes=4)  # claims a spec the weights do not fit
    refs2 = {"global": refs["global"].model_copy(update={"spec": other})}
    with pytest.raises(WeightsError):
        unpack_models(refs2, blobs)


# -- protocol ------------------------------------------------------------------------------
def test_messages_round_trip_through_decode():
    msg = Shutdown(run="r", sender="coordinator")
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"kind": "nope", "run": "r", "sender": "s"}',
        b'{"kind": "shutdown", "run": "r", "sender": "s", "v": 3}',
        b'{"kind": "shutdown", "run": "r", "sender": "s", "surprise": 1}',
        b'{"kind": "register", "run": "r", "sender": "s"}',
    ],
)
def test_decode_refuses_malformed_messages(payload):
    with pytest.raises(ProtocolError):
        decode(payload)


def test_a_peer_of_another_protocol_version_is_refused_with_what_to_do_and_counted():
    old = b'{"kind": "shutdown", "run": "r", "sender": "s", "v": 1}'
    with pytest.raises(ProtocolVersionError, match="protocol version 1; this edgefl speaks "):
        decode(old)
    broker, _tx, rx = _pair()
    broker.connect().publish("in", b"EF1M" + old)
    assert rx.pump() == 1 and rx.rejections == {"old_protocol": 1}


def test_ids_that_would_break_topics_are_refused():
    with pytest.raises(ValueError, match="client id"):
        topics.down("run", "a/b")
    assert topics.topic_matches("edgefl/+/down/#", "edgefl/r/down/c0")
    assert not topics.topic_matches("edgefl/+/down", "edgefl/r/down/c0")


# -- endpoint framing ----------------------------------------------------------------------
def _pair(chunk_bytes=64, **kw):
    broker = InMemoryBroker()
    rx = Endpoint(broker.connect(), "in", chunk_bytes=chunk_bytes, **kw).open()
    tx = Endpoint(broker.connect(), "out", chunk_bytes=chunk_bytes)
    return broker, tx, rx


def test_endpoint_interrupt_wakes_a_waiting_receive_and_messages_still_arrive():
    # Prepare: a receiver blocked for up to a minute on an empty endpoint.
    _, tx, rx = _pair()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(rx.receive(timeout=60)), daemon=True)
    waiter.start()

    # Execute
    rx.interrupt()
    waiter.join(20)

    # Assert: it returned None long before its timeout; the next message is delivered as usual.
    assert not waiter.is_alive() and got == [None]
    tx.send("in", Shutdown(run="r", sender="coordinator", reason="done"))
    env = rx.receive(timeout=5)
    assert env is not None and isinstance(env.message, Shutdown)


def test_models_cross_an_endpoint_in_many_chunks():
    _, tx, rx = _pair(chunk_bytes=100)
    refs, blobs = pack_models({"model": _model()})
    tx.send("in", _reply(refs), blobs)
    env = rx.receive(timeout=1)
    assert env is not None and env.message.task_id == "t"
    got = unpack_models(env.message.models, env.blobs)["model"]
    assert all(torch.equal(got.weights[k], _model().weights[k]) for k in got.weights)


def test_reassembly_tolerates_duplicates_and_any_order():
    broker, tx, rx = _pair()
    captured = []
    broker.connect().subscribe("cap", lambda t, p: captured.append(p))
    refs, blobs = pack_models({"model": _model()})
    tx.send("cap", _reply(refs), blobs)
    *chunks, message = captured
    sink = broker.connect()
    for p in [message, *reversed(chunks), *chunks[:3]]:  # message first, chunks reversed, dupes
        sink.publish("in", p)
    env = rx.receive(timeout=1)
    assert env is not None and set(env.blobs) == {refs["model"].blob.id}
    assert rx.receive(timeout=0.05) is None  # duplicates produce nothing more


def test_bad_frames_are_dropped_and_the_endpoint_keeps_serving():
    broker, tx, rx = _pair()
    sink = broker.connect()
    sink.publish("in", b"garbage")
    sink.publish("in", b'EF1M{"kind": "nope"}')
    header = json.dumps({"blob": "b", "index": 5, "count": 2, "size": 10}).encode()
    sink.publish("in", b"EF1C" + len(header).to_bytes(4, "big") + header + b"x")
    assert rx.rejected == 0 and rx.pump() == 3  # checked by the consumer, not the callback
    assert rx.rejected == 3
    tx.send("in", Shutdown(run="r", sender="c"))
    env = rx.receive(timeout=1)
    assert env is not None and env.message.kind == "shutdown"


def test_blob_with_wrong_checksum_drops_its_message():
    _broker, tx, rx = _pair()
    refs, blobs = pack_models({"model": _model()})
    blob_id = refs["model"].blob.id
    tampered = {blob_id: blobs[blob_id][:-1] + bytes([blobs[blob_id][-1] ^ 1])}
    tx.send("in", _reply(refs), tampered)
    assert rx.receive(timeout=0.1) is None
    assert rx.rejected == 1


def test_oversized_blob_is_refused_before_reassembly_and_its_message_comes_at_once_marked():
    _broker, tx, rx = _pair(max_blob_bytes=100)
    refs, blobs = pack_models({"model": _model()})
    tx.send("in", _reply(refs), blobs)
    env = rx.receive(timeout=0.1)  # not after the blob timeout: its blob will never come
    blob_id = refs["model"].blob.id
    assert env is not None and env.blobs == {} and rx._held == 0
    assert "declares 500 bytes, over the limit of 100" in env.refused[blob_id]
    assert rx.rejections["oversized"] == len(blobs[blob_id]) // 64 + 1  # each of its chunks
    with pytest.raises(ValueError, match=f"model 'model': its blob {blob_id} did not arrive"):
        unpack_models(env.message.models, env.blobs)


def test_message_whose_blobs_never_arrive_expires():
    _broker, tx, rx = _pair(blob_timeout_s=0.05)
    refs, _ = pack_models({"model": _model()})
    tx.send("in", _reply(refs), {})  # blobs withheld
    assert rx.receive(timeout=0.1) is None
    assert rx.receive(timeout=0.01) is None
    assert rx._parked == []


# -- in-memory transport contract ----------------------------------------------------------
def test_memory_transport_routes_by_filter_and_enforces_size():
    broker = InMemoryBroker()
    a, b = broker.connect(max_payload_bytes=10), broker.connect()
    got = []
    b.subscribe("x/+", lambda t, p: got.append((t, p)))
    a.publish("x/1", b"hi")
    a.publish("y/1", b"no")
    with pytest.raises(PayloadTooLarge):
        a.publish("x/1", b"0123456789abc")
    b.unsubscribe("x/+")
    a.publish("x/2", b"gone")
    assert got == [("x/1", b"hi")]


def test_register_carries_spec_and_capabilities():
    msg = Register(
        run="r",
        sender="c0",
        spec=SPEC,
        capabilities={"n_train": 3, "num_classes": 3, "algorithms": ["fml"]},
    )
    back = decode(encode(msg))
    assert back.spec == SPEC and back.capabilities.n_train == 3


def test_late_duplicate_chunks_of_a_delivered_blob_are_ignored():
    broker, tx, rx = _pair()
    captured = []
    broker.connect().subscribe("cap", lambda t, p: captured.append(p))
    refs, blobs = pack_models({"model": _model()})
    tx.send("cap", _reply(refs), blobs)
    sink = broker.connect()
    for p in captured:
        sink.publish("in", p)
    assert rx.receive(timeout=1) is not None
    for p in captured[:-1]:  # QoS 1 redelivers chunks after the message was consumed
        sink.publish("in", p)
    assert rx._blobs == {} and rx.rejected == 0


def test_delivered_blobs_are_forgotten_after_the_blob_timeout_and_only_those():
    # Prepare: one blob delivered, then (after the timeout has passed for it) another
    _broker, tx, rx = _pair(blob_timeout_s=0.3)
    first, blobs = pack_models({"model": _model()})
    tx.send("in", _reply(first), blobs)
    assert rx.receive(timeout=1) is not None
    time.sleep(0.35)
    second, blobs = pack_models({"model": _model()})
    tx.send("in", _reply(second), blobs)
    assert rx.receive(timeout=1) is not None

    # Execute
    rx._expire()

    # Assert: the stale one is gone, the fresh one still guards against late duplicates
    assert [blob_id for _, blob_id in rx._consumed] == [second["model"].blob.id]


def test_a_forked_process_draws_other_ids_than_its_parent():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out without running anything else
        os.write(write, unique_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 64).decode() != unique_id()


def test_a_message_naming_one_blob_twice_is_delivered_once_with_it():
    _broker, tx, rx = _pair()
    refs, blobs = pack_models({"a": _model()})
    twice = {"a": refs["a"], "b": refs["a"]}
    tx.send("in", _reply(twice), blobs)
    env = rx.receive(timeout=1)
    assert env is not None and set(env.blobs) == {refs["a"].blob.id}
