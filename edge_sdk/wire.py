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

Blobs are scoped to the topic they arrived on, and what reassembly holds is bounded and expires
(`edge_sdk.reassembly`, the endpoint's base).

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

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from edge_sdk.auth import SIGNATURE_BYTES, Keyring, ReplayGuard
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, PayloadError
from edge_sdk.protocol import (
    Message,
    ProtocolError,
    ProtocolVersionError,
    decode,
    encode,
)
from edge_sdk.ratelog import RateLimitedLog
from edge_sdk.reassembly import CHUNK_COST, JANITOR, Ready, Reassembly, UnexpectedBlob
from edge_sdk.topics import writer_of
from edge_sdk.transport.base import Delivery, Transport

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Endpoint",
    "Envelope",
    "message_frame",
]

log = logging.getLogger(__name__)

_MSG = b"EF1M"
_SIGNED = b"EF1S"
_CHUNK = b"EF1C"
DEFAULT_CHUNK_BYTES = 1024 * 1024
# What a frame waiting in the inbox costs beside its payload (its bytes object, the tuple and the
# queue's slot hold ~150 bytes; counted generously, like a chunk held).
FRAME_COST = CHUNK_COST
# The inbox holds at least this much by default, whatever reassembly's bounds (a few frames of
# the largest payload an MQTT transport takes, and many small ones), in all and per topic.
MIN_QUEUED_BYTES = 16 * DEFAULT_CHUNK_BYTES
MIN_TOPIC_QUEUED_BYTES = 4 * DEFAULT_CHUNK_BYTES


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


class Endpoint(Reassembly):
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
        super().__init__()
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
        # Frames as the transport delivered them, for the consumer's thread (None: interrupt()),
        # and what they hold (bytes with FRAME_COST each).
        self._inbox: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()
        self._queued = 0
        self._queued_by: Counter[str] = Counter()  # ... per topic
        self._max_queued_bytes = max_queued_bytes
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
            JANITOR.watch(self)
        return self

    def close(self) -> None:
        if self._open:
            for flt in self.subscriptions:
                self.transport.unsubscribe(flt)
            self._open = False
            JANITOR.forget(self)

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

    def _verify(self, ready: Ready) -> Envelope | None:
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
        except UnexpectedBlob as exc:
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
