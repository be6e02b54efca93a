"""Framing on top of a Transport: messages plus chunked, checksummed blobs.

Every payload on an inbox topic is a frame: `EF1M` + message JSON, or `EF1C` + a 4-byte header
length + header JSON (blob id, chunk index, chunk count, blob size) + chunk bytes. A sender
publishes a message's blobs in ~1 MB chunks first and the message last; the receiver reassembles
blobs (tolerating duplicates and any order, with bounded memory and a timeout) and hands a message
to its consumer only once every blob it references has arrived and matched its sha256.

The transport callback (`_on_payload`) only parses and enqueues: it never trains or blocks.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from edge_sdk.codec import (
    DEFAULT_MAX_BLOB_BYTES,
    PayloadError,
    WireModel,
    check_weights,
    decode_weights,
    encode_weights,
    sha256_hex,
)
from edge_sdk.protocol import BlobRef, Message, ModelRef, ProtocolError, decode, encode
from edge_sdk.transport.base import Transport
from model_zoo import ArchSpec, build

__all__ = ["Endpoint", "Envelope", "pack_models", "reference_shapes", "unpack_models"]

log = logging.getLogger(__name__)

_MSG = b"EF1M"
_CHUNK = b"EF1C"
DEFAULT_CHUNK_BYTES = 1024 * 1024


@dataclass
class Envelope:
    """A received message with the blobs it references, verified."""

    message: Message
    blobs: dict[str, bytes] = field(default_factory=dict)


@dataclass
class _Partial:
    count: int
    size: int
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)


class Endpoint:
    """One participant's mailbox on a transport: send messages with blobs, receive envelopes."""

    def __init__(
        self,
        transport: Transport,
        inbox: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_pending_bytes: int | None = None,
        blob_timeout_s: float = 120.0,
    ) -> None:
        self.transport = transport
        self.inbox = inbox
        self.chunk_bytes = min(chunk_bytes, transport.max_payload_bytes - 512)
        self.max_blob_bytes = max_blob_bytes
        self.max_pending_bytes = max_pending_bytes or 4 * max_blob_bytes
        self.blob_timeout_s = blob_timeout_s
        self.rejected = 0  # frames dropped as malformed/oversized; logged, never fatal
        self._lock = threading.Lock()
        self._partials: dict[str, _Partial] = {}
        self._complete: dict[str, tuple[bytes, float]] = {}
        self._consumed: dict[str, float] = {}  # recently delivered blob ids: late duplicates
        self._parked: list[tuple[Message, float]] = []
        self._queue: queue.Queue[Envelope] = queue.Queue()
        self._open = False

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Endpoint:
        if not self._open:
            self.transport.subscribe(self.inbox, self._on_payload)
            self._open = True
        return self

    def close(self) -> None:
        if self._open:
            self.transport.unsubscribe(self.inbox)
            self._open = False

    # -- sending ---------------------------------------------------------------------------
    def send(self, topic: str, message: Message, blobs: Mapping[str, bytes] | None = None) -> None:
        """Publish every blob as chunks, then the message that references them."""
        for blob_id, data in (blobs or {}).items():
            count = max(1, -(-len(data) // self.chunk_bytes))
            for i in range(count):
                header = json.dumps(
                    {"blob": blob_id, "index": i, "count": count, "size": len(data)}
                ).encode()
                piece = data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]
                self.transport.publish(
                    topic, _CHUNK + len(header).to_bytes(4, "big") + header + piece
                )
        self.transport.publish(topic, _MSG + encode(message))

    # -- receiving -------------------------------------------------------------------------
    def receive(self, timeout: float | None = None) -> Envelope | None:
        """Next complete envelope, or None after `timeout` seconds."""
        self._expire()
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _on_payload(self, topic: str, payload: bytes) -> None:
        try:
            if payload.startswith(_CHUNK):
                self._on_chunk(payload)
            elif payload.startswith(_MSG):
                self._on_message(decode(payload[len(_MSG) :]))
            else:
                raise ProtocolError("unknown frame type")
        except (ProtocolError, PayloadError, ValueError) as exc:
            self.rejected += 1
            log.warning("%s: dropped a frame on %s: %s", self.inbox, topic, exc)

    def _on_chunk(self, payload: bytes) -> None:
        n = int.from_bytes(payload[4:8], "big")
        try:
            header = json.loads(payload[8 : 8 + n])
            blob_id, index = str(header["blob"]), int(header["index"])
            count, size = int(header["count"]), int(header["size"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad chunk header: {exc}") from exc
        data = payload[8 + n :]
        if size > self.max_blob_bytes:
            raise PayloadError(f"blob {blob_id} of {size} bytes is over {self.max_blob_bytes}")
        if not 0 <= index < count or count > max(1, size):
            raise ProtocolError(f"blob {blob_id}: chunk {index} of {count} is inconsistent")
        with self._lock:
            if blob_id in self._complete or blob_id in self._consumed:
                return  # a duplicate of a finished blob (QoS 1 redelivery)
            part = self._partials.get(blob_id)
            if part is None:
                pending = sum(p.size for p in self._partials.values())
                if pending + size > self.max_pending_bytes:
                    raise PayloadError(f"blob {blob_id}: too many bytes pending reassembly")
                part = self._partials[blob_id] = _Partial(count, size, time.monotonic())
            if (count, size) != (part.count, part.size):
                raise ProtocolError(f"blob {blob_id}: chunk header disagrees with earlier chunks")
            part.parts.setdefault(index, data)
            if len(part.parts) < part.count:
                return
            del self._partials[blob_id]
            blob = b"".join(part.parts[i] for i in range(part.count))
            if len(blob) != part.size:
                raise PayloadError(f"blob {blob_id}: reassembled {len(blob)} of {part.size} bytes")
            self._complete[blob_id] = (blob, time.monotonic())
            self._release_parked()

    def _on_message(self, msg: Message) -> None:
        with self._lock:
            if not self._try_deliver(msg):
                self._parked.append((msg, time.monotonic()))

    def _try_deliver(self, msg: Message) -> bool:
        refs = {m.blob.id: m.blob for m in getattr(msg, "models", {}).values()}.values()
        if any(r.id not in self._complete for r in refs):
            return False
        blobs = {}
        now = time.monotonic()
        for r in refs:
            data, _ = self._complete.pop(r.id)
            self._consumed[r.id] = now
            if len(data) != r.size or sha256_hex(data) != r.sha256:
                self.rejected += 1
                log.warning("%s: blob %s failed its checksum; message dropped", self.inbox, r.id)
                return True
            blobs[r.id] = data
        self._queue.put(Envelope(msg, blobs))
        return True

    def _release_parked(self) -> None:
        self._parked = [(m, t) for m, t in self._parked if not self._try_deliver(m)]

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for blob_id, part in list(self._partials.items()):
                if now - part.started > self.blob_timeout_s:
                    del self._partials[blob_id]
                    log.warning("%s: blob %s timed out incomplete", self.inbox, blob_id)
            for blob_id, (_, t) in list(self._complete.items()):
                if now - t > self.blob_timeout_s:
                    del self._complete[blob_id]
            for blob_id, t in list(self._consumed.items()):
                if now - t > self.blob_timeout_s:
                    del self._consumed[blob_id]
            kept = []
            for m, t in self._parked:
                if now - t > self.blob_timeout_s:
                    log.warning(
                        "%s: %s message dropped: its blobs never arrived", self.inbox, m.kind
                    )
                else:
                    kept.append((m, t))
            self._parked = kept


def pack_models(
    models: Mapping[str, WireModel], *, fp16: bool = False, max_bytes: int = DEFAULT_MAX_BLOB_BYTES
) -> tuple[dict[str, ModelRef], dict[str, bytes]]:
    """Encode models as blobs and the ModelRefs a message carries for them."""
    refs: dict[str, ModelRef] = {}
    blobs: dict[str, bytes] = {}
    for name, m in models.items():
        data = encode_weights(m.weights, fp16=fp16, max_bytes=max_bytes)
        blob_id = uuid.uuid4().hex
        blobs[blob_id] = data
        refs[name] = ModelRef(
            spec=m.spec, blob=BlobRef(id=blob_id, sha256=sha256_hex(data), size=len(data))
        )
    return refs, blobs


def unpack_models(
    refs: Mapping[str, ModelRef],
    blobs: Mapping[str, bytes],
    *,
    max_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    partial: frozenset[str] = frozenset(),
) -> dict[str, WireModel]:
    """Decode and validate models: finite values, names and shapes that fit their ArchSpec.

    Models named in `partial` may carry a subset of their architecture's tensors (a shared
    backbone).
    """
    out: dict[str, WireModel] = {}
    for name, ref in refs.items():
        weights = decode_weights(blobs[ref.blob.id], max_bytes=max_bytes)
        check_weights(weights, reference_shapes(ref.spec), what=name, partial=name in partial)
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
