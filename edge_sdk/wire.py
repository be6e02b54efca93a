"""Framing on top of a Transport: messages plus chunked, checksummed blobs.

Every payload is a frame: `EF1S` + a 64-byte Ed25519 signature + message JSON (an endpoint with a
`Keyring`, see `edge_sdk.auth`), `EF1M` + message JSON (open mode: unsigned), or `EF1C` + a
4-byte header length + header JSON (blob id, chunk index, chunk count, blob size) + chunk bytes.
A sender publishes a message's blobs in ~1 MB chunks first and the message last; the receiver
reassembles blobs (tolerating duplicates and any order) and hands a message to its consumer only
once every blob it references has arrived and matched the sha256 its (signed) message names.
An endpoint with a keyring drops unsigned frames, frames not signed by the one participant who
may write their topic, and replays; every dropped frame is counted by reason (`rejections`) and
logged at most once per topic and reason per minute.

Blobs are scoped to the topic they arrived on: a message can only use blobs sent on its own topic,
or, for a `BlobRef` marked `shared`, on the endpoint's shared topic (the run's broadcast topic,
which only the coordinator may write). So one peer cannot pre-empt another's blob by guessing its
id. Memory is bounded by the bytes actually received (not by what chunk headers claim), and
incomplete or unclaimed blobs expire on a timer.

The transport callback (`_on_payload`, on paho's network thread for MQTT, the publisher's in
memory) only puts the raw frame on the endpoint's inbox, a queue bounded in bytes (each frame
counted with FRAME_COST of bookkeeping), in all and per topic (so one sender's flood cannot
crowd out the others while the consumer is busy), by default as reassembly is (with floors,
MIN_QUEUED_BYTES and MIN_TOPIC_QUEUED_BYTES): a frame that does not fit is dropped and counted
(`queue_full`), and the callback never waits.
Everything else happens on the thread that takes messages from the endpoint (`receive()`, or
`pump()`): signature checks, replay checks, message decoding, filing chunks (appending each in
order to its blob and hashing it as it comes), and the checksum comparison. So a slow check or a
flood of frames costs the consumer's thread, never the network thread that keeps the connection
alive, and what the consumer decides (a new bound once the run says how large its models are)
applies to every frame after it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import random
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edge_sdk.auth import SIGNATURE_BYTES, Keyring, ReplayGuard
from edge_sdk.codec import (
    DEFAULT_MAX_BLOB_BYTES,
    Buffer,
    PayloadError,
    WireModel,
    check_weights,
    decode_weights,
    encode_weights,
    sha256_hex,
)
from edge_sdk.malloc import release_free_memory
from edge_sdk.protocol import (
    BlobRef,
    Message,
    ModelRef,
    ProtocolError,
    ProtocolVersionError,
    decode,
    encode,
)
from edge_sdk.ratelog import RateLimitedLog
from edge_sdk.topics import writer_of
from edge_sdk.transport.base import Delivery, Transport
from model_zoo import ArchSpec, build

__all__ = [
    "Endpoint",
    "Envelope",
    "message_frame",
    "model_bytes",
    "pack_models",
    "reference_shapes",
    "unique_id",
    "unpack_models",
]

log = logging.getLogger(__name__)

_MSG = b"EF1M"
_SIGNED = b"EF1S"
_CHUNK = b"EF1C"
DEFAULT_CHUNK_BYTES = 1024 * 1024
# What reassembly holds is counted with its bookkeeping, measured with tracemalloc (a flood of
# one-byte chunks cost 300-600 bytes each beside its byte): per chunk held, the frame it keeps
# alive, its view and its index entry; per blob, its record (hash state, buffer, entries).
CHUNK_COST = 512
BLOB_COST = 512
# Chunks a topic may hold beyond what its byte bound needs in whole chunks (small blobs, such as
# a tiny model's, come as one short chunk each).
SPARE_CHUNKS = 256
# What a frame waiting in the inbox costs beside its payload (its bytes object, the tuple and the
# queue's slot hold ~150 bytes; counted generously, like a chunk held).
FRAME_COST = CHUNK_COST
# The inbox holds at least this much by default, whatever reassembly's bounds (a few frames of
# the largest payload an MQTT transport takes, and many small ones), in all and per topic.
MIN_QUEUED_BYTES = 16 * DEFAULT_CHUNK_BYTES
MIN_TOPIC_QUEUED_BYTES = 4 * DEFAULT_CHUNK_BYTES
# Freeing this much (bookkeeping included) at once: the pages go back to the kernel.
_RELEASE_BYTES = 1024 * 1024
MAX_HEADER_BYTES = 1024  # a chunk header (blob id, index, count, size) needs a few hundred
# Blobs refused (over the size limit, or no room), remembered so that the message that names one
# is handed on at once, marked, instead of waiting for chunks that will never come.
_REFUSED_KEPT = 256
_BlobKey = tuple[str, str]  # (topic it arrived on, blob id)


class _Janitor:
    """One daemon thread for every open endpoint: expires stale blobs and parked messages even
    when nobody calls receive() (one thread, however many simulated clients)."""

    def __init__(self) -> None:
        self._endpoints: weakref.WeakSet[Endpoint] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, endpoint: Endpoint) -> None:
        with self._lock:
            self._endpoints.add(endpoint)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgefl-expiry", daemon=True)
                self._thread.start()

    def forget(self, endpoint: Endpoint) -> None:
        with self._lock:
            self._endpoints.discard(endpoint)

    def _run(self) -> None:
        while True:
            with self._lock:
                endpoints = list(self._endpoints)
            period = min((e.blob_timeout_s / 4 for e in endpoints), default=5.0)
            time.sleep(max(0.05, min(1.0, period)))
            for e in endpoints:
                e._expire()


_JANITOR = _Janitor()


_IDS = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _IDS.seed(os.urandom(16)))  # no ids shared by forks


def unique_id(bits: int = 128) -> str:
    """A random hex id (blob and task ids), from a generator seeded once per process: a uuid4
    reads the OS's random source every time, a system call that, under a simulation's hundred
    threads, cost ~0.4 ms waiting to get the interpreter back (benchmarks/simulate_scale.py)."""
    return f"{_IDS.getrandbits(bits):0{bits // 4}x}"


def message_frame(message: Message) -> bytes:
    """The bytes of a message frame (what `send` publishes; what a will carries)."""
    return _MSG + encode(message)


@dataclass
class Envelope:
    """A received message, the topic it came on, and the blobs it references, verified;
    `refused`: those of its blobs this endpoint refused (over the size limit, no room), with
    why: they will not come, so the message is handed on at once without them."""

    message: Message
    blobs: dict[str, bytearray] = field(default_factory=dict)
    topic: str = ""
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class _Blob:
    """A blob in reassembly. Chunks join `data` in index order as they arrive, hashed on the
    way, so nothing is left to copy or hash when the last one lands; a chunk that comes early
    waits in `early` until the gap before it fills."""

    count: int
    size: int
    started: float
    data: bytearray = field(default_factory=bytearray)
    digest: Any = field(default_factory=hashlib.sha256)
    early: dict[int, memoryview] = field(default_factory=dict)
    joined: int = 0  # chunks in `data`
    received: int = 0  # bytes actually held
    cost: int = 0  # what it counts against the bounds: its bytes and bookkeeping
    chunks: int = 0  # chunks held (joined and early)

    @property
    def complete(self) -> bool:
        return self.joined == self.count

    def has(self, index: int) -> bool:
        return index < self.joined or index in self.early

    def add(self, index: int, part: memoryview, cost: int) -> None:
        self.early[index] = part
        self.received += len(part)
        self.cost += cost
        self.chunks += 1
        while self.joined in self.early:
            part = self.early.pop(self.joined)
            self.data += part
            self.digest.update(part)
            self.joined += 1


@dataclass
class _Ready:
    """A message whose blobs are all here; checked against their checksums and handed out by
    `receive()`."""

    message: Message
    topic: str
    blobs: dict[str, tuple[BlobRef, _Blob]]
    refused: dict[str, str] = field(default_factory=dict)


class Endpoint:
    """One participant's mailbox on a transport: send messages with blobs, receive envelopes.

    `subscriptions` are the topic filters it listens on; `shared_topic` (one of them) carries
    blobs that messages on any topic may reference (`BlobRef.shared`).
    """

    def __init__(
        self,
        transport: Transport,
        subscriptions: str | Sequence[str],
        *,
        shared_topic: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_pending_bytes: int | None = None,
        max_total_pending_bytes: int | None = None,
        blob_timeout_s: float = 120.0,
        ack_timeout_s: float = 120.0,
        scope: Callable[[str], str] | None = None,
        keyring: Keyring | None = None,
        pending_bound: Callable[[str], int] | None = None,
        replay: ReplayGuard | None = None,
        max_queued_bytes: int | None = None,
    ) -> None:
        """`keyring`: sign what is sent and accept only frames signed by their topic's writer
        (None: open mode, nothing signed or checked). `pending_bound(topic)`: the bytes that
        topic may hold in reassembly (0: no blobs expected there), instead of
        `max_pending_bytes` for all. `replay`: the record of what was seen (default: a new
        one, in memory). `max_queued_bytes`: what frames received but not yet taken by the
        consumer may hold in all, FRAME_COST each included (default: `max_total_pending_bytes`,
        as `set_limits` changes it, and at least MIN_QUEUED_BYTES); per topic, they may hold
        `max_pending_bytes` (at least MIN_TOPIC_QUEUED_BYTES, at most the total)."""
        self.transport = transport
        subs = [subscriptions] if isinstance(subscriptions, str) else list(subscriptions)
        self.subscriptions = subs
        self.shared_topic = shared_topic
        self.chunk_bytes = min(chunk_bytes, transport.max_payload_bytes - 512)
        self.max_blob_bytes = max_blob_bytes
        # Bytes held for reassembly, bookkeeping included (CHUNK_COST, BLOB_COST): per topic (one
        # sender cannot crowd out the others), and in all (a flood over many topics is bounded
        # too). The chunks held are capped alike (`chunk_bound`).
        self.max_pending_bytes = max_pending_bytes or 2 * max_blob_bytes
        self.max_total_pending_bytes = max_total_pending_bytes or 4 * self.max_pending_bytes
        self.blob_timeout_s = blob_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.rejections: Counter[str] = Counter()  # frames/messages dropped, by reason
        self.keyring = keyring
        # Without a keyring: the writers whose signed frames arrived (they expect ours signed).
        self.signed_writers: set[str] = set()
        self.pending_bound = pending_bound
        self.replay = replay or ReplayGuard()
        self._log = RateLimitedLog(log)
        self._lock = threading.Lock()
        self._blobs: dict[_BlobKey, _Blob] = {}
        self._held = 0  # bytes held in _blobs, with their bookkeeping
        self._held_by: Counter[str] = Counter()  # ... per topic
        self._chunks = 0  # chunks held in _blobs
        self._chunks_by: Counter[str] = Counter()  # ... per topic
        # Recently delivered (late duplicates are dropped), oldest first: expiry stops at the
        # first one still fresh instead of walking all (a coordinator delivers ~100 per round).
        self._consumed: dict[_BlobKey, float] = {}
        self._parked: list[tuple[Message, str, float]] = []
        self._refused: dict[_BlobKey, str] = {}  # oldest first, at most _REFUSED_KEPT
        # Frames as the transport delivered them, for the consumer's thread (None: interrupt()),
        # and what they hold (bytes with FRAME_COST each); then the messages made whole, in order.
        self._inbox: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()
        self._queued = 0
        self._queued_by: Counter[str] = Counter()  # ... per topic
        self._max_queued_bytes = max_queued_bytes
        self._ready: deque[_Ready] = deque()
        self._consuming = threading.Lock()
        self._open = False
        self._scope = scope

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def max_queued_bytes(self) -> int:
        """What frames waiting for the consumer may hold (payloads and FRAME_COST each)."""
        return self._max_queued_bytes or max(self.max_total_pending_bytes, MIN_QUEUED_BYTES)

    @property
    def max_topic_queued_bytes(self) -> int:
        """What frames waiting for the consumer may hold per topic."""
        return min(self.max_queued_bytes, max(self.max_pending_bytes, MIN_TOPIC_QUEUED_BYTES))

    @property
    def queued_bytes(self) -> int:
        """What the frames waiting for the consumer hold now."""
        return self._queued

    @property
    def rejected(self) -> int:
        return sum(self.rejections.values())

    def _reject(self, reason: str, detail: str, topic: str, *, stranger: bool = False) -> None:
        """Count a dropped frame; log it unless its sender logged this reason lately. Senders
        that are no one (`stranger`: no key, not registered) share one line per reason, so a
        flood over many topics is still a line a minute."""
        self.rejections[reason] += 1
        where = self.subscriptions[0]
        key = ("stranger" if stranger else topic, reason)
        self._log.warning(key, "%s: dropped %s on %s: %s", where, reason, topic, detail)

    def set_limits(
        self, *, max_pending_bytes: int, max_total_pending_bytes: int | None = None
    ) -> None:
        """Resize what reassembly may hold (e.g. once the run says how large its models are)."""
        with self._lock:
            self.max_pending_bytes = max_pending_bytes
            self.max_total_pending_bytes = max_total_pending_bytes or 4 * max_pending_bytes

    def frame(self, topic: str, message: Message) -> bytes:
        """The bytes that publish `message` on `topic`: signed (with a fresh sequence number)
        when this endpoint has a keyring, else a plain message frame."""
        if self.keyring is None:
            return message_frame(message)
        body = encode(message.model_copy(update={"seq": self.keyring.next_seq()}))
        return b"".join((_SIGNED, self.keyring.sign(topic, body), body))

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Endpoint:
        if not self._open:
            for flt in self.subscriptions:
                self.transport.subscribe(flt, self._on_payload)
            self._open = True
            _JANITOR.watch(self)
        return self

    def close(self) -> None:
        if self._open:
            for flt in self.subscriptions:
                self.transport.unsubscribe(flt)
            self._open = False
            _JANITOR.forget(self)

    # -- sending ---------------------------------------------------------------------------
    def publish_blobs(
        self,
        topic: str,
        blobs: Mapping[str, bytes],
        *,
        retain: bool = False,
        chunk_topics: bool = False,
    ) -> list[Delivery]:
        """Publish blobs as chunks on `topic` (for messages that reference them as shared).

        `chunk_topics` puts the i-th chunk of all on `topic/i` (retained chunks need a topic
        each, across blobs); receivers then scope them to `topic` (see `scope`).
        """
        out: list[Delivery] = []
        for blob_id, data in blobs.items():
            view = memoryview(data)  # slices without copies; each frame is joined once
            count = max(1, -(-len(data) // self.chunk_bytes))
            for i in range(count):
                header = json.dumps(
                    {"blob": blob_id, "index": i, "count": count, "size": len(data)}
                ).encode()
                piece = view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]
                out.append(
                    self.transport.publish(
                        f"{topic}/{len(out)}" if chunk_topics else topic,
                        b"".join((_CHUNK, len(header).to_bytes(4, "big"), header, piece)),
                        retain=retain,
                    )
                )
        return out

    def send(
        self,
        topic: str,
        message: Message,
        blobs: Mapping[str, bytes] | None = None,
        *,
        retain: bool = False,
        wait: bool = True,
    ) -> list[Delivery]:
        """Publish every blob as chunks, then the message that references them.

        With `wait` (default) block until the broker acknowledged every frame, raising its
        refusal as a typed `TransportError` (e.g. `NotAuthorized`).
        """
        deliveries = self.publish_blobs(topic, blobs or {})
        deliveries.append(self.transport.publish(topic, self.frame(topic, message), retain=retain))
        if wait:
            self.wait(deliveries)
        return deliveries

    def wait(self, deliveries: Sequence[Delivery]) -> None:
        deadline = time.monotonic() + self.ack_timeout_s
        for d in deliveries:
            d.wait(max(0.0, deadline - time.monotonic()))

    # -- receiving -------------------------------------------------------------------------
    def receive(self, timeout: float | None = None) -> Envelope | None:
        """Next complete, verified envelope, or None after `timeout` seconds (or sooner, once
        for each `interrupt()`). The frames received meanwhile are checked and filed here, on
        the caller's thread."""
        self._expire()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self._ready:
                try:
                    ready = self._ready.popleft()
                except IndexError:  # another consumer took it
                    break
                env = self._verify(ready)
                if env is not None:
                    return env
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                frame = self._inbox.get(timeout=left)
            except queue.Empty:
                return None
            if frame is None:
                return None
            self._take(*frame)

    def pump(self) -> int:
        """Check and file every frame received so far, now, on the caller's thread (what
        `receive()` does as it goes); the messages made whole wait for `receive()`. Returns how
        many frames it took; an `interrupt()` met on the way is kept for `receive()`."""
        taken = 0
        interrupted = False
        while True:
            try:
                frame = self._inbox.get_nowait()
            except queue.Empty:
                break
            if frame is None:
                interrupted = True
                continue
            self._take(*frame)
            taken += 1
        if interrupted:
            self._inbox.put(None)
        return taken

    def interrupt(self) -> None:
        """Make a `receive()` in progress (or the next one) return None now."""
        self._inbox.put(None)

    def _on_payload(self, topic: str, payload: bytes) -> None:
        """The transport's callback (its network thread): queue the frame, or drop it when the
        inbox is full. Nothing else happens here."""
        cost = len(payload) + FRAME_COST
        with self._inbox_lock:
            held, on_topic = self._queued, self._queued_by[topic]
            fits = (
                held + cost <= self.max_queued_bytes
                and on_topic + cost <= self.max_topic_queued_bytes
            )
            if fits:
                self._queued += cost
                self._queued_by[topic] += cost
        if not fits:
            self._reject(
                "queue_full",
                f"a {len(payload)}-byte frame, with {on_topic} bytes on its topic and {held} in "
                "all waiting for the consumer",
                topic,
                stranger=True,  # one line a minute for a flood, however many topics it uses
            )
            return
        self._inbox.put((topic, payload))

    def _take(self, topic: str, payload: bytes) -> None:
        cost = len(payload) + FRAME_COST
        with self._inbox_lock:
            self._queued -= cost
            self._queued_by[topic] -= cost
            if not self._queued_by[topic]:
                del self._queued_by[topic]
        with self._consuming:  # one frame at a time, in order, whoever consumes
            self._process(topic, payload)

    def _verify(self, ready: _Ready) -> Envelope | None:
        blobs = {}
        for blob_id, (ref, blob) in ready.blobs.items():
            # A bytearray, not bytes: writable, so decode_weights makes views of it, not copies.
            data = blob.data
            if len(data) != ref.size or blob.digest.hexdigest() != ref.sha256:
                self._reject(
                    "checksum", f"blob {blob_id} failed its checksum; message dropped", ready.topic
                )
                return None
            blobs[blob_id] = data
        return Envelope(ready.message, blobs, ready.topic, ready.refused)

    def _process(self, topic: str, payload: bytes) -> None:
        """Check a frame and file it (the consumer's thread): a chunk joins its blob, a message
        whose blobs are all here is ready for `receive()`, the rest waits for its blobs; what
        fails a check is dropped and counted."""
        try:
            if payload.startswith(_CHUNK):
                self._on_chunk(topic, payload)
            elif payload.startswith(_SIGNED):
                msg = self._verified(topic, payload)
                if msg is not None:
                    self._on_message(topic, msg)
            elif payload.startswith(_MSG):
                if self.keyring is not None:
                    self._reject("unsigned", "an unsigned message (is its sender keyless?)", topic)
                else:
                    self._on_message(topic, decode(payload[len(_MSG) :]))
            else:
                raise ProtocolError("unknown frame type")
        except _Unexpected as exc:
            self._reject("unexpected_blob", str(exc), topic, stranger=True)
        except ProtocolVersionError as exc:
            self._reject("old_protocol", str(exc), topic)
        except PayloadError as exc:
            self._reject("oversized", str(exc), topic)
        except (ProtocolError, ValueError, ArithmeticError, RecursionError) as exc:
            self._reject("malformed", str(exc), topic)

    def _verified(self, topic: str, payload: bytes) -> Message | None:
        """The message of a signed frame, when its topic's writer signed it and it is fresh."""
        signature = payload[4 : 4 + SIGNATURE_BYTES]
        body = payload[4 + SIGNATURE_BYTES :]
        if self.keyring is None:  # open mode: nothing to check against
            owner = writer_of(topic)
            if owner is not None:  # but the peer signs, so it checks what we send (unsigned)
                self.signed_writers.add(owner[1])
            return decode(body)
        owner = writer_of(topic)
        if owner is None:
            raise ProtocolError(f"{topic} has no writer in the topic layout")
        run, writer = owner
        if not self.keyring.verify(writer, topic, body, signature):
            known = writer in self.keyring.roster
            why = "wrong signature" if known else "no key in the roster"
            detail = f"not signed by {writer} ({why})"
            self._reject("bad_signature", detail, topic, stranger=not known)
            return None
        msg = decode(body)
        if msg.sender != writer or msg.run != run:
            claim = f"sender {msg.sender!r} of run {msg.run!r}"
            self._reject("sender_mismatch", f"{writer} signed a {msg.kind} claiming {claim}", topic)
            return None
        stale = self.replay.check(topic, msg.kind, msg.seq, getattr(msg, "incarnation", 0))
        if stale == "replayed":
            self._reject("replayed", f"a {msg.kind} older than the last one accepted", topic)
            return None
        if stale == "duplicate":
            log.debug("a duplicate %s on %s", msg.kind, topic)
            return None
        return msg

    def _on_chunk(self, topic: str, payload: bytes) -> None:
        n = int.from_bytes(payload[4:8], "big")
        if n > MAX_HEADER_BYTES:
            raise ProtocolError(f"a chunk header of {n} bytes (at most {MAX_HEADER_BYTES})")
        try:
            header = json.loads(payload[8 : 8 + n])
            blob_id = header["blob"]
            index, count, size = (header[k] for k in ("index", "count", "size"))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ProtocolError(f"bad chunk header: {type(exc).__name__}: {exc}") from exc
        # Whole numbers only: 1e999 is a float (inf), True an int; neither is a count.
        if not all(type(v) is int for v in (index, count, size)) or not isinstance(blob_id, str):
            raise ProtocolError("chunk header fields must be a string id and whole numbers")
        data = memoryview(payload)[8 + n :]  # no copy: the part keeps its frame alive
        if not 0 < len(blob_id) <= 128:
            raise ProtocolError("chunk header names no valid blob id")
        if not 0 <= index < count or count > max(1, size):
            raise ProtocolError(f"blob {blob_id}: chunk {index} of {count} is inconsistent")
        topic = self._scope(topic) if self._scope else topic
        key = (topic, blob_id)
        if self.pending_bound is not None and self.pending_bound(topic) <= 0:
            raise _Unexpected(f"blob {blob_id}: no blobs are expected on {topic}")
        with self._lock:
            if key in self._consumed:
                return  # a late duplicate of a delivered blob (QoS 1 redelivery)
            if key in self._refused:
                raise PayloadError(f"blob {blob_id} was refused: {self._refused[key]}")
            blob = self._blobs.get(key)
            if blob is None:
                blob = _Blob(count, size, time.monotonic())
            elif (count, size) != (blob.count, blob.size):
                raise ProtocolError(f"blob {blob_id}: chunk header disagrees with earlier chunks")
            if blob.has(index):
                return  # a duplicate chunk
            if blob.received + len(data) > blob.size:
                raise PayloadError(f"blob {blob_id}: chunks carry more than its {size} bytes")
            cost = len(data) + CHUNK_COST + (BLOB_COST if key not in self._blobs else 0)
            try:
                if size > self.max_blob_bytes:
                    raise PayloadError(
                        f"blob {blob_id} declares {size} bytes, over the limit of "
                        f"{self.max_blob_bytes}"
                    )
                self._make_room(cost, keep=key)
            except PayloadError as exc:  # it will never be whole: its message need not wait
                self._refuse(key, str(exc))
                raise
            blob.add(index, data, cost)
            self._held += cost
            self._held_by[topic] += cost
            self._chunks += 1
            self._chunks_by[topic] += 1
            self._blobs[key] = blob
            if blob.complete:
                self._release_parked()

    def chunk_bound(self, nbytes: int) -> int:
        """The chunks a byte bound of `nbytes` may hold: its bytes in whole chunks, twice, and
        SPARE_CHUNKS (a sender's chunks are this endpoint's size, the last of each blob
        shorter). A flood of tiny chunks meets this long before its bytes add up."""
        return 2 * -(-nbytes // self.chunk_bytes) + SPARE_CHUNKS

    def _make_room(self, need: int, keep: _BlobKey) -> None:
        """Evict complete blobs nobody claimed yet (the sender's own first, oldest first);
        refuse the chunk if the bounds (bytes with their bookkeeping, and chunks) still do not
        hold."""
        topic = keep[0]
        bound = self.max_pending_bytes if self.pending_bound is None else self.pending_bound(topic)
        total = self.max_total_pending_bytes

        def fits() -> bool:
            return (
                self._held_by[topic] + need <= bound
                and self._held + need <= total
                and self._chunks_by[topic] < self.chunk_bound(bound)
                and self._chunks < self.chunk_bound(total)
            )

        if fits():
            return
        claimed = {
            k
            for m, t, _ in self._parked
            for ref in (r.blob for r in getattr(m, "models", {}).values())
            if (k := self._blob_key(ref, t)) is not None
        }
        by_age = sorted(self._blobs.items(), key=lambda kv: kv[1].started)
        for key, blob in [kv for kv in by_age if kv[0][0] == topic] + by_age:
            if key in self._blobs and key != keep and key not in claimed and blob.complete:
                self._drop(key)
                log.info("evicted unclaimed blob %s to make room", key[1])
                if fits():
                    return
        raise PayloadError(
            f"{need} more bytes pending reassembly would exceed the bound "
            f"({self._held_by[topic]} bytes in {self._chunks_by[topic]} chunks held on {topic}, "
            f"{self._held} in {self._chunks} in all)"
        )

    def _refuse(self, key: _BlobKey, why: str) -> None:
        """Remember that the blob `key` was refused (what it held is dropped): the message that
        names it is handed on at once, marked (`Envelope.refused`)."""
        if key in self._blobs:
            self._drop(key)
        self._refused[key] = why
        while len(self._refused) > _REFUSED_KEPT:
            del self._refused[next(iter(self._refused))]
        self._release_parked()

    def _drop(self, key: _BlobKey) -> None:
        blob = self._blobs.pop(key)
        topic = key[0]
        self._held -= blob.cost
        self._held_by[topic] -= blob.cost
        self._chunks -= blob.chunks
        self._chunks_by[topic] -= blob.chunks
        if not self._held_by[topic]:
            del self._held_by[topic]
        if not self._chunks_by[topic]:
            del self._chunks_by[topic]

    def _on_message(self, topic: str, msg: Message) -> None:
        with self._lock:
            if not self._try_deliver(msg, topic):
                self._parked.append((msg, topic, time.monotonic()))

    def _blob_key(self, ref: BlobRef, topic: str) -> _BlobKey | None:
        if ref.shared:
            return None if self.shared_topic is None else (self.shared_topic, ref.id)
        return (self._scope(topic) if self._scope else topic, ref.id)

    def _try_deliver(self, msg: Message, topic: str) -> bool:
        refs = {m.blob.id: m.blob for m in getattr(msg, "models", {}).values()}
        keys = {}
        refused = {}
        for blob_id, ref in refs.items():
            key = self._blob_key(ref, topic)
            if key is None:
                self._reject("malformed", "a shared blob with no shared topic", topic)
                return True
            if key in self._refused:
                refused[blob_id] = self._refused[key]
                continue
            blob = self._blobs.get(key)
            if blob is None or not blob.complete:
                return False
            keys[blob_id] = key
        ready: dict[str, tuple[BlobRef, _Blob]] = {}
        now = time.monotonic()
        for blob_id, key in keys.items():
            blob = self._blobs[key]
            ready[blob_id] = (refs[blob_id], blob)
            self._drop(key)
            self._consumed.pop(key, None)  # to the end: the dict stays in time order
            self._consumed[key] = now
        self._ready.append(_Ready(msg, topic, ready, refused))
        return True

    def _release_parked(self) -> None:
        self._parked = [(m, t, ts) for m, t, ts in self._parked if not self._try_deliver(m, t)]

    def _expire(self) -> None:
        now = time.monotonic()
        freed = 0
        with self._lock:
            for key, blob in list(self._blobs.items()):
                if now - blob.started > self.blob_timeout_s:
                    self._drop(key)
                    freed += blob.cost
                    if not blob.complete:
                        self.rejections["blob_expired"] += 1
                        self._log.warning(
                            (key[0], "blob_expired"),
                            "blob %s on %s timed out incomplete",
                            key[1],
                            key[0],
                        )
            stale = itertools.takewhile(
                lambda kt: now - kt[1] > self.blob_timeout_s, self._consumed.items()
            )
            for key in [k for k, _ in stale]:
                del self._consumed[key]
            kept = []
            for m, topic, t in self._parked:
                if now - t > self.blob_timeout_s:
                    self.rejections["blobs_missing"] += 1
                    self._log.warning(
                        (topic, "blobs_missing"),
                        "%s message on %s dropped: its blobs never arrived",
                        m.kind,
                        topic,
                    )
                else:
                    kept.append((m, topic, t))
            self._parked = kept
        if freed >= _RELEASE_BYTES:  # glibc keeps freed heap pages unless asked (32 MiB here)
            release_free_memory()


class _Unexpected(PayloadError):
    """Chunks on a topic where no blob is expected (a sender that is not registered)."""


def model_bytes(spec: ArchSpec) -> int:
    """The bytes of a model of `spec` on the wire (float32 weights; the header is extra)."""
    return sum(t.numel() * t.element_size() for t in reference_shapes(spec).values())


def pack_models(
    models: Mapping[str, WireModel],
    *,
    fp16: bool = False,
    max_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    shared: bool = False,
) -> tuple[dict[str, ModelRef], dict[str, bytes]]:
    """Encode models as blobs and the ModelRefs a message carries for them (`shared`: the
    blobs travel on the broadcast topic, for many messages at once)."""
    refs: dict[str, ModelRef] = {}
    blobs: dict[str, bytes] = {}
    for name, m in models.items():
        data = encode_weights(m.weights, fp16=fp16, max_bytes=max_bytes)
        blob_id = unique_id()
        blobs[blob_id] = data
        refs[name] = ModelRef(
            spec=m.spec,
            blob=BlobRef(id=blob_id, sha256=sha256_hex(data), size=len(data), shared=shared),
        )
    return refs, blobs


def unpack_models(
    refs: Mapping[str, ModelRef],
    blobs: Mapping[str, Buffer],
    *,
    max_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    partial: frozenset[str] = frozenset(),
    max_abs: float = math.inf,
) -> dict[str, WireModel]:
    """Decode and validate models: finite values no larger than `max_abs` in magnitude, names
    and shapes that fit their ArchSpec.

    Models named in `partial` may carry a subset of their architecture's tensors (a shared
    backbone).
    """
    out: dict[str, WireModel] = {}
    for name, ref in refs.items():
        if ref.blob.id not in blobs:
            raise ValueError(f"model {name!r}: its blob {ref.blob.id} did not arrive")
        weights = decode_weights(blobs[ref.blob.id], max_bytes=max_bytes)
        check_weights(
            weights,
            reference_shapes(ref.spec),
            what=name,
            partial=name in partial,
            max_abs=max_abs,
        )
        out[name] = WireModel(ref.spec, weights)
    return out


def reference_shapes(spec: ArchSpec) -> Mapping[str, torch.Tensor]:
    """The state dict an ArchSpec implies, as meta tensors (names and shapes, no memory).

    Raises the zoo's errors for an unknown family or an impossible shape, so it also serves
    to check that a spec received from the network can be built, without building it.
    """
    return _reference_shapes(spec.to_json())


@functools.lru_cache(maxsize=64)
def _reference_shapes(spec_json: str) -> Mapping[str, torch.Tensor]:
    with torch.device("meta"):  # shapes only: no memory, no draws from the global RNG
        model = build(ArchSpec.from_json(spec_json))
    return dict(model.state_dict())


# -- retained publications: models anyone may read later, with no one answering ------------------
def publish_retained(
    endpoint: Endpoint,
    topic: str,
    models: Mapping[str, WireModel],
    manifest: Callable[[dict[str, ModelRef]], Message],
    *,
    previous_chunks: int = 0,
) -> int:
    """Publish `models` retained on `topic`: chunks on `topic/i` (each retained), then the
    manifest `manifest(refs)` on `topic` itself, so a reader that subscribes later gets them all.
    Chunk topics left over from a longer previous publication (`previous_chunks`) are cleared.
    Returns the number of chunk topics this publication uses."""
    refs, blobs = pack_models(models, max_bytes=endpoint.max_blob_bytes)
    deliveries = endpoint.publish_blobs(topic, blobs, retain=True, chunk_topics=True)
    count = len(deliveries)
    for i in range(count, previous_chunks):
        deliveries.append(endpoint.transport.publish(f"{topic}/{i}", b"", retain=True))
    frame = endpoint.frame(topic, manifest(refs))
    deliveries.append(endpoint.transport.publish(topic, frame, retain=True))
    endpoint.wait(deliveries)
    return count


def read_retained(
    transport: Transport,
    topic: str,
    accept: Callable[[Message], bool],
    *,
    timeout: float,
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    keyring: Keyring | None = None,
) -> tuple[Message, dict[str, WireModel]] | None:
    """The first publication on `topic` whose manifest `accept`s (signed by the topic's writer,
    with a `keyring`), with its models decoded and checked, or None after `timeout` s."""
    reader = Endpoint(
        transport,
        [topic, f"{topic}/+"],
        max_blob_bytes=max_blob_bytes,
        scope=lambda _topic: topic,  # the chunks belong to the publication
        keyring=keyring,
    ).open()
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            env = reader.receive(timeout=left)
            if env is None:
                break
            msg = env.message
            if env.topic != topic or not accept(msg):
                continue
            refs: dict[str, ModelRef] = getattr(msg, "models", {})
            try:
                return msg, unpack_models(refs, env.blobs, max_bytes=max_blob_bytes)
            except (ValueError, KeyError) as exc:
                log.warning("an unusable publication on %s: %s", topic, exc)
        return None
    finally:
        reader.close()
