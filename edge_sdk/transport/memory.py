"""In-memory transport: a broker object shared by every endpoint of one process.

Same contract as MQTT (topic filters, bytes payloads, size limit, callbacks that only enqueue),
so the simulator runs exactly the code a deployment runs, minus the network.
"""

from __future__ import annotations

import logging
import threading

from edge_sdk.topics import topic_matches
from edge_sdk.transport.base import Callback, ConnectError, Transport

__all__ = ["InMemoryBroker", "InMemoryTransport"]

log = logging.getLogger(__name__)


class InMemoryBroker:
    """Routes publishes to every matching subscription, in publish order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: list[tuple[InMemoryTransport, str, Callback]] = []

    def connect(self, max_payload_bytes: int = 2 * 1024 * 1024) -> InMemoryTransport:
        return InMemoryTransport(self, max_payload_bytes)

    def _add(self, owner: InMemoryTransport, topic_filter: str, cb: Callback) -> None:
        with self._lock:
            self._subs.append((owner, topic_filter, cb))

    def _remove(self, owner: InMemoryTransport, topic_filter: str | None) -> None:
        with self._lock:
            self._subs = [
                s
                for s in self._subs
                if not (s[0] is owner and (topic_filter is None or s[1] == topic_filter))
            ]

    def _route(self, topic: str, payload: bytes) -> None:
        with self._lock:
            targets = [cb for _, f, cb in self._subs if topic_matches(f, topic)]
        for cb in targets:
            try:
                cb(topic, payload)
            except Exception:  # a subscriber's bug must not break the publisher
                log.exception("subscriber callback failed on topic %s", topic)


class InMemoryTransport(Transport):
    def __init__(self, broker: InMemoryBroker, max_payload_bytes: int) -> None:
        self._broker = broker
        self.max_payload_bytes = max_payload_bytes
        self._closed = False

    def publish(self, topic: str, payload: bytes) -> None:
        if self._closed:
            raise ConnectError("transport is closed")
        self._check_size(payload)
        self._broker._route(topic, bytes(payload))

    def subscribe(self, topic_filter: str, callback: Callback) -> None:
        if self._closed:
            raise ConnectError("transport is closed")
        self._broker._add(self, topic_filter, callback)

    def unsubscribe(self, topic_filter: str) -> None:
        self._broker._remove(self, topic_filter)

    def close(self) -> None:
        self._closed = True
        self._broker._remove(self, None)
