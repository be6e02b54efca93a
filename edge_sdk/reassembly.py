"""Reassembly: an endpoint's chunks joined into blobs, and its messages held until their blobs
are whole (the base of `edge_sdk.wire.Endpoint`, which sets the bounds it reads).

Blobs are scoped to the topic they arrived on: a message can only use blobs sent on its own topic,
or, for a `BlobRef` marked `shared`, on the endpoint's shared topic (the run's broadcast topic,
which only the coordinator may write). So one peer cannot pre-empt another's blob by guessing its
id. Memory is bounded by the bytes actually received (not by what chunk headers claim), and
incomplete or unclaimed blobs expire on a timer (one thread for every open endpoint).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.codec import PayloadError
from edge_sdk.malloc import release_free_memory
from edge_sdk.protocol import BlobRef, Message, ProtocolError
from edge_sdk.ratelog import RateLimitedLog

__all__ = ["BLOB_COST", "CHUNK_COST", "SPARE_CHUNKS", "Ready", "Reassembly", "UnexpectedBlob"]

log = logging.getLogger(__name__)

# What reassembly holds is counted with its bookkeeping, measured with tracemalloc (a flood of
# one-byte chunks cost 300-600 bytes each beside its byte): per chunk held, the frame it keeps
# alive, its view and its index entry; per blob, its record (hash state, buffer, entries).
CHUNK_COST = 512
BLOB_COST = 512
# Chunks a topic may hold beyond what its byte bound needs in whole chunks (small blobs, such as
# a tiny model's, come as one short chunk each).
SPARE_CHUNKS = 256
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
        self._endpoints: weakref.WeakSet[Reassembly] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, endpoint: Reassembly) -> None:
        with self._lock:
            self._endpoints.add(endpoint)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgefl-expiry", daemon=True)
                self._thread.start()

    def forget(self, endpoint: Reassembly) -> None:
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


JANITOR = _Janitor()  # (edge_sdk.wire.Endpoint.open() and close())


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
class Ready:
    """A message whose blobs are all here; checked against their checksums and handed out by
    `receive()`."""

    message: Message
    topic: str
    blobs: dict[str, tuple[BlobRef, _Blob]]
    refused: dict[str, str] = field(default_factory=dict)


class Reassembly(ABC):
    """What an endpoint holds between a blob's first chunk and the delivery of the message that
    names it: blobs in reassembly, messages waiting for their blobs, and those made whole.

    The endpoint that builds on it sets the bounds read here (and may resize them at any time,
    under `_lock`) and counts and logs what is dropped (`_reject`).
    """

    chunk_bytes: int
    max_blob_bytes: int
    max_pending_bytes: int
    max_total_pending_bytes: int
    blob_timeout_s: float
    pending_bound: Callable[[str], int] | None
    shared_topic: str | None
    rejections: Counter[str]
    _scope: Callable[[str], str] | None
    _log: RateLimitedLog

    def __init__(self) -> None:
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
        self._ready: deque[Ready] = deque()  # the messages made whole, in order

    @abstractmethod
    def _reject(self, reason: str, detail: str, topic: str, *, stranger: bool = False) -> None:
        """Count and log a dropped frame (the endpoint's)."""

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
            raise UnexpectedBlob(f"blob {blob_id}: no blobs are expected on {topic}")
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
        self._ready.append(Ready(msg, topic, ready, refused))
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


class UnexpectedBlob(PayloadError):
    """Chunks on a topic where no blob is expected (a sender that is not registered)."""
