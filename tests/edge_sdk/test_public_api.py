"""The public API a developer reads: typed packages, and entry points that name their options."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest

from edge_sdk.client import EdgeClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["model_zoo", "edge_sdk", "coordinator"])
def test_every_package_ships_py_typed(package):
    assert (ROOT / package / "py.typed").is_file()
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setup["package-data"][package]  # so that wheels carry it


def test_edge_client_connect_names_every_option_it_passes_on():
    # Before: connect(broker: Any, ..., **kwargs: Any) hid its options from readers and checkers.
    connect = inspect.signature(EdgeClient.connect).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in connect.values())
    init = inspect.signature(EdgeClient.__init__).parameters
    own = {"self", "transport", "owns_transport", "compute_gate", "cohort"}  # set by connect
    offered = {n: p for n, p in init.items() if n not in own}
    assert set(offered) | {"broker"} == set(connect)
    for name, p in offered.items():
        assert connect[name].default == p.default, name
        assert connect[name].annotation == p.annotation, name
    assert connect["broker"].annotation == "str | BrokerSettings"


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
