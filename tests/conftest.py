import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests_helpers

from coordinator.broker import EmbeddedBroker, MosquittoBroker, mosquitto_path
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import MqttTransport

needs_mosquitto = pytest.mark.skipif(
    mosquitto_path() is None, reason="mosquitto is not installed (make test installs it as root)"
)


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[MosquittoBroker]:
    """One real mosquitto for the session: a child process on a free port."""
    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (make test installs it as root)")
    with MosquittoBroker() as broker:
        yield broker


@pytest.fixture(scope="session")
def amqtt_broker() -> Iterator[EmbeddedBroker]:
    """The embedded amqtt broker (MQTT 3.1.1), in this process."""
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(params=["memory", "mosquitto", "amqtt"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_transport(
    broker_kind: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Transport]]:
    """`make(name, will=None)`: a connected transport of the kind under test; ids are unique
    per test, so tests sharing a session broker never see each other's sessions."""
    memory = InMemoryBroker()
    url = None
    if broker_kind == "mosquitto":
        url = request.getfixturevalue("mosquitto").url
    elif broker_kind == "amqtt":
        url = request.getfixturevalue("amqtt_broker").url
    tag = uuid.uuid4().hex[:8]
    made: list[Transport] = []

    def make(name: str, will: tuple[str, bytes] | None = None) -> Transport:
        client_id = f"{name}-{tag}"
        t: Transport = memory.connect(client_id) if url is None else MqttTransport(url, client_id)
        if will is not None:
            t.set_will(*will)
        t.connect(10)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
