"""Transports, behind one contract (`Transport`): in-memory (`InMemoryTransport`: simulation,
tests) and MQTT (`edge_sdk.transport.mqtt.MqttTransport`, over any MQTT 3.1.1/5 broker; imported
from its module, so that this package loads no paho)."""

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
