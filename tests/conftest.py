import logging
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests_helpers

from coordinator.broker import EmbeddedBroker, MosquittoBroker, mosquitto_path
from edge_sdk import logs
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import MqttTransport

needs_mosquitto = pytest.mark.skipif(
    mosquitto_path() is None, reason="mosquitto is not installed (make test installs it as root)"
)


# Modules whose tests run federations of real processes (a coordinator and clients, each importing
# torch). `make test` runs two pytest workers (pytest-xdist): these tests run one after another on
# one worker while the other worker takes the in-process tests. Two federations at once on 2 cores
# slow each other several-fold (the hostile-broker test: 37 s alone, 162 s beside another), and
# their deadlines are not meant to be measured against that. (The examples' and plugins' single
# runs, with no deadline to meet, share the cores with them on the other worker.)
PROCESS_MODULES = {
    "test_attacks.py",
    "test_bridges.py",
    "test_demo.py",
    "test_deploy.py",
    "test_faults.py",
    "test_fleet_scale.py",
    "test_ranks.py",
    "test_secure_setup.py",
}


# Modules whose tests share a costly module-scoped fixture (a RabbitMQ node, a reference
# federation): each is one unit of work, so that one worker makes the fixture once. Split across
# the two workers, each made it (seen: two RabbitMQ nodes, 11 s each). (test_docs' build is left
# split: its module comes last, where the two workers would otherwise wait on one.)
SHARED_FIXTURE_MODULES = {
    "test_export_cli.py",
    "test_population.py",
    "test_rabbitmq.py",
}


@pytest.hookimpl(optionalhook=True)  # (a GPU machine may have no xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """One unit of work for all of PROCESS_MODULES, one for each of SHARED_FIXTURE_MODULES, one
    per test for the rest. (xdist's own `--dist loadgroup` marks do not take under pytest 9: it
    renames node ids pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            if Path(module).name in PROCESS_MODULES:
                return "processes"
            return module if Path(module).name in SHARED_FIXTURE_MODULES else nodeid

    return ProcessesTogether(config, log)


@pytest.fixture
def scoped_registrations() -> Iterator[None]:
    """Algorithms and strategies a test registers in this process (a plugin it loads in-process,
    a class it defines) are unregistered after it: a later test's run config would otherwise
    carry their sections, which that test's child processes (the demo's) do not know."""
    from coordinator.strategies import base as strategies
    from edge_sdk.algorithms import registry as algorithms

    saved = dict(algorithms._REGISTRY), dict(strategies._REGISTRY)
    try:
        yield
    finally:
        for registry, before in zip(
            (algorithms._REGISTRY, strategies._REGISTRY), saved, strict=True
        ):
            registry.clear()
            registry.update(before)


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


_ROOT_LEVEL = logging.getLogger().level  # as the test process starts


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """After every test, the root logger's level as the process started, without the CLI's
    handler: a command run in this process (typer's CliRunner, in a test or in a module's
    fixture) installs them (`-q`: ERROR), which would otherwise hide later tests' warnings
    from caplog (seen in `make mutation`, whose runs share one process)."""
    yield
    root = logging.getLogger()
    for h in root.handlers[:]:
        if getattr(h, logs._OURS, False):  # (pytest's capturing handlers are pytest's)
            root.removeHandler(h)
            h.close()
    root.setLevel(_ROOT_LEVEL)


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


@pytest.fixture(scope="session")
def real_images() -> dict[str, Any]:
    """Real labelled images, split as published: Fashion-MNIST's train and t10k files when
    installed, else a seeded 80/20 split of scikit-learn's digits (28x28); `name` says which."""
    from model_zoo.data import DatasetNotFound, load_dataset

    try:
        ds = load_dataset("fashion_mnist")
    except DatasetNotFound:
        ds = load_dataset("digits", size=28)
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
        train, test = order[len(ds) // 5 :], order[: len(ds) // 5]
        return {
            "name": "digits",
            "x_train": ds.x[train],
            "y_train": ds.y[train],
            "x_test": ds.x[test],
            "y_test": ds.y[test],
        }
    # The loader pools the 60000 train images first, then the 10000 t10k (test) images.
    return {
        "name": "fashion_mnist",
        "x_train": ds.x[:60000],
        "y_train": ds.y[:60000],
        "x_test": ds.x[60000:],
        "y_test": ds.y[60000:],
    }
