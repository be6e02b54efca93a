"""Transports: in-memory (simulation, tests) and, later, MQTT, behind one contract."""

from edge_sdk.transport.base import ConnectError, PayloadTooLarge, Transport, TransportError
from edge_sdk.transport.memory import InMemoryBroker, InMemoryTransport

__all__ = [
    "ConnectError",
    "InMemoryBroker",
    "InMemoryTransport",
    "PayloadTooLarge",
    "Transport",
    "TransportError",
]
