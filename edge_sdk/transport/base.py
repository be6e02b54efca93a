"""The Transport contract: publish bytes to a topic, subscribe a callback to a topic filter.

Semantics every implementation keeps (the contract tests in tests/edge_sdk/ check them against
the in-memory transport, a real mosquitto and the embedded amqtt broker):
- QoS 1, in order per topic. One transport's filters never overlap (brokers disagree on whether
  a topic matching two of them arrives once or twice). `subscribe` returns once the broker
  acknowledged it. Subscriptions survive reconnects (persistent session), and what was published
  to a subscription while its transport was disconnected arrives after `connect()`.
- `publish(..., retain=True)` keeps the last payload of a topic for later subscribers; an empty
  retained payload clears it.
- `publish` refuses payloads over `max_payload_bytes` before sending anything (`PayloadTooLarge`)
  and returns a `Delivery`: `wait()` raises the broker's refusal as a typed error (MQTT 5 reason
  135 → `NotAuthorized`).
- A will (`set_will`) is published by the broker when the connection drops without a clean
  disconnect (`abort()` drops it on purpose, as a crash would).
- Callbacks run on the transport's own thread (paho's network thread for MQTT, the publisher's
  thread in memory): they must only enqueue, never check, decode, train or block (`Endpoint`
  queues the raw frame; its consumer's thread does the rest).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edge_sdk.topics import filters_overlap

__all__ = [
    "ConnectError",
    "Delivery",
    "DeliveryTimeout",
    "NotAuthorized",
    "PayloadTooLarge",
    "PublishRejected",
    "Transport",
    "TransportError",
    "TransportStats",
]

Callback = Callable[[str, bytes], None]
# A will's payload, or a function of the connection number that makes it (so a receiver can
# tell the will of an old connection from news about the current one).
WillPayload = bytes | Callable[[int], bytes]


class TransportError(RuntimeError):
    """Base class of transport failures."""


class ConnectError(TransportError):
    """Could not connect, or the connection is closed."""


class PayloadTooLarge(TransportError):
    """A publish over the transport's payload limit (refused before sending)."""


class PublishRejected(TransportError):
    """The broker refused a publish (an MQTT 5 reason code >= 0x80)."""

    def __init__(self, topic: str, reason_code: int, reason: str) -> None:
        super().__init__(f"the broker refused a publish on {topic!r}: {reason} ({reason_code})")
        self.topic = topic
        self.reason_code = reason_code
        self.reason = reason


class NotAuthorized(PublishRejected):
    """MQTT 5 reason 135: the broker's ACL does not let this user publish on that topic."""


class DeliveryTimeout(TransportError):
    """No acknowledgement within the time allowed (the message may still be delivered later)."""


class Delivery:
    """The broker's answer to one publish, filled in from the transport's thread."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self._done = threading.Event()
        self._error: TransportError | None = None

    def resolve(self, error: TransportError | None = None) -> None:
        self._error = error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until acknowledged; raise the broker's refusal or `DeliveryTimeout`."""
        if not self._done.wait(timeout):
            raise DeliveryTimeout(
                f"no acknowledgement for a publish on {self.topic!r} in {timeout} s"
            )
        if self._error is not None:
            raise self._error


@dataclass
class TransportStats:
    """Traffic counters (payload bytes; what Prometheus and the transport benchmark read)."""

    messages_out: int = 0
    bytes_out: int = 0
    messages_in: int = 0
    bytes_in: int = 0
    dropped_in: int = 0  # inbound payloads refused (over the size limit)


class Transport(ABC):
    max_payload_bytes: int
    stats: TransportStats
    # Called (on the transport's thread: only flag or enqueue) after a connection came back.
    on_reconnect: Callable[[], None] | None = None
    # 0 for the first connection, one more for each new one (after a drop or a disconnect).
    connection: int = 0

    def connect(self, timeout: float | None = None) -> Transport:
        """Open the connection (idempotent); in memory there is nothing to open."""
        return self

    def set_will(self, topic: str, payload: WillPayload, *, retain: bool = False) -> None:  # noqa: B027
        """What the broker publishes if a connection drops uncleanly (set before connect); a
        callable payload is called with each connection's number."""

    @abstractmethod
    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> Delivery: ...

    @abstractmethod
    def subscribe(self, topic_filter: str, callback: Callback) -> None: ...

    @abstractmethod
    def unsubscribe(self, topic_filter: str) -> None: ...

    @abstractmethod
    def disconnect(self) -> None:
        """Leave cleanly (no will); the session and subscriptions stay for a later connect()."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the connection without a clean disconnect, as a crash would: the will fires."""

    @abstractmethod
    def close(self) -> None:
        """Leave cleanly for good; the transport cannot be used afterwards."""

    @staticmethod
    def _check_overlap(existing: Iterable[str], topic_filter: str) -> None:
        for other in existing:
            if other != topic_filter and filters_overlap(other, topic_filter):
                raise ValueError(
                    f"filter {topic_filter!r} overlaps {other!r} on the same transport; "
                    "subscribe to disjoint filters (or use a second transport)"
                )

    def _check_size(self, payload: bytes) -> None:
        if len(payload) > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"payload of {len(payload)} bytes is over the limit of {self.max_payload_bytes}"
            )
