"""In-memory transport: a broker object shared by every endpoint of one process.

Same contract as MQTT (topic filters, bytes payloads, size limit, retained messages, persistent
sessions, wills, callbacks that only enqueue), so the simulator runs exactly the code a
deployment runs, minus the network.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field

from edge_sdk.topics import topic_matches
from edge_sdk.transport.base import (
    Callback,
    ConnectError,
    Delivery,
    Transport,
    TransportStats,
    WillPayload,
)

__all__ = ["InMemoryBroker", "InMemoryTransport"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 2 * 1024 * 1024
_MAX_ROUTES = 4096  # topics whose routes are kept (a federation uses a few per client)


@dataclass
class _Session:
    """What the broker keeps for one client id, connected or not (a persistent session)."""

    transport: InMemoryTransport
    subs: dict[str, Callback] = field(default_factory=dict)
    connected: bool = True
    backlog: list[tuple[str, bytes, str]] = field(default_factory=list)  # queued while offline
    lock: threading.RLock = field(default_factory=threading.RLock)  # delivery order per session


class InMemoryBroker:
    """Routes publishes to every matching subscription, in publish order; keeps retained
    messages and the subscriptions (and queued messages) of disconnected sessions.

    Which (session, filter) pairs a topic reaches is computed once per topic and kept until the
    subscriptions change, so a publish does not match every session's filters: 0.09 against
    1.3 ms per publish with 100 sessions of 3 subscriptions each (measured on 2 shared cores).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._retained: dict[str, bytes] = {}
        self._ids = itertools.count()
        self._targets: dict[str, list[tuple[_Session, str]]] = {}  # topic -> who it reaches
        self._version = 0  # bumped whenever a subscription or session comes or goes

    def connect(
        self, client_id: str | None = None, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD
    ) -> InMemoryTransport:
        """A transport for `client_id`, resuming its session when one exists."""
        if client_id is None:
            client_id = f"anon-{next(self._ids)}"
        transport = InMemoryTransport(self, client_id, max_payload_bytes)
        with self._lock:
            old = self._sessions.get(client_id)
            if old is not None:  # a newer connection takes over the session (as MQTT does)
                old.transport._taken_over = True
                old.transport = transport
                old.connected = False
            else:
                self._sessions[client_id] = _Session(transport, connected=False)
                self._changed()
        transport.connect()
        return transport

    # -- called by transports ----------------------------------------------------------------
    def _changed(self) -> None:
        """Forget the routes (call with `_lock` held)."""
        self._targets.clear()
        self._version += 1

    def _session(self, t: InMemoryTransport) -> _Session:
        with self._lock:
            s = self._sessions.get(t.client_id)
        if s is None or s.transport is not t:
            raise ConnectError(f"{t.client_id}: the session is closed or was taken over")
        return s

    def _set_connected(self, t: InMemoryTransport, connected: bool) -> None:
        s = self._session(t)
        with s.lock:
            s.connected = connected
            if connected:
                backlog, s.backlog = s.backlog, []
                for topic, payload, flt in backlog:
                    cb = s.subs.get(flt)
                    if cb is not None:
                        self._deliver(s, topic, payload, cb)

    def _drop(self, t: InMemoryTransport) -> None:
        with self._lock:
            s = self._sessions.get(t.client_id)
            if s is not None and s.transport is t:
                del self._sessions[t.client_id]
                self._changed()

    def _subscribe(self, t: InMemoryTransport, flt: str, cb: Callback) -> None:
        s = self._session(t)
        with self._lock:
            retained = [(k, v) for k, v in self._retained.items() if topic_matches(flt, k)]
        with s.lock:
            t._check_overlap(s.subs, flt)
            s.subs[flt] = cb
            with self._lock:
                self._changed()
            for topic, payload in retained:
                if s.connected:
                    self._deliver(s, topic, payload, cb)
                else:
                    s.backlog.append((topic, payload, flt))

    def _unsubscribe(self, t: InMemoryTransport, flt: str) -> None:
        s = self._session(t)
        with s.lock:
            s.subs.pop(flt, None)
            with self._lock:
                self._changed()

    def _route(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = payload
                else:
                    self._retained.pop(topic, None)
            targets = self._targets.get(topic)
            version = self._version
            sessions = list(self._sessions.values()) if targets is None else []
        if targets is None:
            targets = []
            for s in sessions:
                with s.lock:
                    targets += [(s, flt) for flt in s.subs if topic_matches(flt, topic)]
            with self._lock:
                if version == self._version:  # nothing changed meanwhile: keep the route
                    if len(self._targets) >= _MAX_ROUTES:  # arbitrary topics: stay bounded
                        self._targets.clear()
                    self._targets[topic] = targets
        for s, flt in targets:
            with s.lock:
                cb = s.subs.get(flt)
                if cb is None:  # unsubscribed since the route was computed
                    continue
                if s.connected:
                    self._deliver(s, topic, payload, cb)
                else:
                    s.backlog.append((topic, payload, flt))

    @staticmethod
    def _deliver(s: _Session, topic: str, payload: bytes, cb: Callback) -> None:
        t = s.transport
        if len(payload) > t.max_payload_bytes:
            t.stats.dropped_in += 1
            log.warning("%s: dropped a %d-byte payload on %s", t.client_id, len(payload), topic)
            return
        t.stats.messages_in += 1
        t.stats.bytes_in += len(payload)
        try:
            cb(topic, payload)
        except Exception:  # a subscriber's bug must not break the publisher
            log.exception("subscriber callback failed on topic %s", topic)


class InMemoryTransport(Transport):
    def __init__(self, broker: InMemoryBroker, client_id: str, max_payload_bytes: int) -> None:
        self._broker = broker
        self.client_id = client_id
        self.max_payload_bytes = max_payload_bytes
        self.stats = TransportStats()
        self._closed = False
        self._taken_over = False
        self._ever_connected = False
        self._will: tuple[str, WillPayload, bool] | None = None

    def connect(self, timeout: float | None = None) -> InMemoryTransport:
        self._check_open()
        if self._ever_connected:
            self.connection += 1
        self._broker._set_connected(self, True)
        if self._ever_connected and self.on_reconnect is not None:
            self.on_reconnect()
        self._ever_connected = True
        return self

    def set_will(self, topic: str, payload: WillPayload, *, retain: bool = False) -> None:
        self._will = (topic, payload, retain)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> Delivery:
        self._check_open()
        self._check_size(payload)
        self.stats.messages_out += 1
        self.stats.bytes_out += len(payload)
        self._broker._route(topic, bytes(payload), retain)
        done = Delivery(topic)
        done.resolve()
        return done

    def subscribe(self, topic_filter: str, callback: Callback) -> None:
        self._check_open()
        self._broker._subscribe(self, topic_filter, callback)

    def unsubscribe(self, topic_filter: str) -> None:
        if not self._closed:
            self._broker._unsubscribe(self, topic_filter)

    def disconnect(self) -> None:
        if not self._closed:
            self._broker._set_connected(self, False)

    def abort(self) -> None:
        if self._closed:
            return
        self._broker._set_connected(self, False)
        if self._will is not None:
            topic, payload, retain = self._will
            data = payload(self.connection) if callable(payload) else bytes(payload)
            self._broker._route(topic, data, retain)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._broker._drop(self)

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectError("transport is closed")
        if self._taken_over:
            raise ConnectError(f"{self.client_id}: another connection took over this session")
