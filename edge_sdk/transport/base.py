"""The Transport contract: publish bytes to a topic, subscribe a callback to a topic filter.

Callbacks run on the transport's own thread (paho's network thread for MQTT, the publisher's
thread in memory): they must only decode and enqueue, never train or block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

__all__ = ["ConnectError", "PayloadTooLarge", "Transport", "TransportError"]

Callback = Callable[[str, bytes], None]


class TransportError(RuntimeError):
    """Base class of transport failures."""


class ConnectError(TransportError):
    """Could not connect, or the connection is closed."""


class PayloadTooLarge(TransportError):
    """A publish over the transport's payload limit (refused before sending)."""


class Transport(ABC):
    max_payload_bytes: int

    @abstractmethod
    def publish(self, topic: str, payload: bytes) -> None: ...

    @abstractmethod
    def subscribe(self, topic_filter: str, callback: Callback) -> None: ...

    @abstractmethod
    def unsubscribe(self, topic_filter: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def _check_size(self, payload: bytes) -> None:
        if len(payload) > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"payload of {len(payload)} bytes is over the limit of {self.max_payload_bytes}"
            )
