"""The public API a developer reads: typed packages, and entry points that name their options."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest
import torch

from edge_sdk.client import EdgeClient
from edge_sdk.client_data import ClientData
from edge_sdk.node import ClientNode
from edge_sdk.transport.mqtt import MqttTransport
from model_zoo import ArchSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["model_zoo", "edge_sdk", "coordinator"])
def test_every_package_ships_py_typed(package):
    assert (ROOT / package / "py.typed").is_file()
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setup["package-data"][package]  # so that wheels carry it


def test_edge_client_has_one_constructor_and_repeats_none_of_the_nodes_parameters():
    # Before: __init__, around(node, transport, ...) and connect(broker, ...) repeated 8 to 17
    # parameters each. Now what stays on the device (id, data, ONNX, state...) is ClientNode's
    # alone, and the client takes a node, a transport or broker, and its own few options.
    init = inspect.signature(EdgeClient.__init__).parameters
    assert list(init)[:3] == ["self", "node", "transport"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(init.values())[3:])
    assert init["node"].annotation == "ClientNode"
    assert init["transport"].annotation == "Transport | str | BrokerSettings"
    node = set(inspect.signature(ClientNode.__init__).parameters) - {"self"}
    assert node & set(init) == set()
    # No second way in: no class or static method builds one.
    makers = [n for n, v in vars(EdgeClient).items() if isinstance(v, classmethod | staticmethod)]
    assert makers == []


def test_a_broker_gives_the_client_its_own_connection_and_a_transport_is_used_as_given(
    mosquitto, caplog
):
    # A broker URL: the client makes its MQTT connection, named after run and client (so a
    # restart resumes the session), warns that it has no keyring, and leaves it when it stops.
    node = ClientNode("c0", SPEC, _data(), run_id="apps")
    own = EdgeClient(node, mosquitto.url)
    assert isinstance(own.transport, MqttTransport)
    assert own.transport.client_id == "edgefl-apps-c0"
    assert "c0: no keyring: its messages go unsigned (open mode)" in caplog.text
    own.open()
    assert own.transport.connected
    own.stop()
    assert not own.transport.connected
    # A transport: used as given; the client leaves it connected for whoever made it.
    given = MqttTransport(mosquitto.url, "edgefl-apps-given")
    client = EdgeClient(ClientNode("c1", SPEC, _data(), run_id="apps"), given)
    assert client.transport is given
    client.open()
    client.stop()
    assert given.connected
    given.close()


SPEC = ArchSpec(family="mlr", input_shape=(1, 8, 8), num_classes=10)


def _data(n=8):
    x, y = torch.zeros(n, 1, 8, 8), torch.arange(n) % 10
    return ClientData(x, y, x[:2], y[:2], x[:2], y[:2], num_classes=10)


def test_the_transport_package_names_the_transports_it_has():
    # Before: "in-memory (simulation, tests) and, later, MQTT", long after MQTT had shipped.
    import edge_sdk.transport as transport
    from edge_sdk.transport.base import Transport
    from edge_sdk.transport.memory import InMemoryTransport
    from edge_sdk.transport.mqtt import MqttTransport

    doc = transport.__doc__ or ""
    assert "later" not in doc
    for cls in (InMemoryTransport, MqttTransport):
        assert issubclass(cls, Transport) and cls.__name__ in doc
