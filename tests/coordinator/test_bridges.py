"""The usual edge topology: site mosquittos bridged to a central one (`bridge_config`). The
coordinator connects to the central broker, the clients to the sites; the federation must end
exactly as on one broker."""

from collections.abc import Iterator

import pytest
from tests_helpers import (
    ARCHS,
    FAST_EXPORT,
    FEDERICO,
    deploy,
    simulated_federico,
    simulated_fml_accuracies,
)

from coordinator.broker import MosquittoBroker, bridge_config, mosquitto_path
from coordinator.results_model import Results

pytestmark = pytest.mark.skipif(
    mosquitto_path() is None, reason="mosquitto is not installed (make test installs it as root)"
)


@pytest.fixture(scope="module")
def sites() -> Iterator[tuple[MosquittoBroker, MosquittoBroker, MosquittoBroker]]:
    """A central mosquitto and two site mosquittos bridged to it (child processes)."""
    with MosquittoBroker() as central:
        central_at = f"127.0.0.1:{central.port}"
        with (
            MosquittoBroker(extra_config=bridge_config("site-a", central_at)) as a,
            MosquittoBroker(extra_config=bridge_config("site-b", central_at)) as b,
        ):
            yield central, a, b


def _spread(central, a, b):
    """The coordinator on the central broker; c0 and c2 on site a, c1 on site b."""
    return [central.url, a.url, b.url, a.url]


def test_fml_over_bridged_site_brokers_gives_the_single_broker_accuracies(sites, tmp_path):
    urls = _spread(*sites)
    out, logs = deploy(urls, tmp_path, "bridged-fml", client_flags=FAST_EXPORT, timeout=120)
    results = Results.read(out / "results.json")
    assert [c.arch for c in results.clients] == ARCHS
    assert "round 2/2 ok" in logs[0]
    # One broker (shown equal to the in-process simulation in test_deploy): the same accuracies.
    assert [c.personal_acc for c in results.clients] == simulated_fml_accuracies(rounds=2)


def test_federico_peers_on_different_sites_collaborate_as_on_one_broker(sites, tmp_path):
    # c1 (site b) reads c0's and c2's retained model publications (site a) and sends them
    # gradients: peer topics from client to client, through the central broker.
    out, logs = deploy(
        _spread(*sites),
        tmp_path,
        "bridged-federico",
        FEDERICO,
        client_flags=["--deploy", "any", *FAST_EXPORT],
        timeout=120,
    )
    assert "round 2/2 ok" in logs[0]
    # Every peer model was read (a retained publication that did not cross the bridges would
    # be waited for, then missed).
    assert not [line for log in logs[1:] for line in log.splitlines() if "of version >=" in line]
    # One broker (shown equal to the in-process simulation in test_deploy): the same results.
    results, single = Results.read(out / "results.json"), simulated_federico()
    assert [c.personal_acc for c in results.clients] == [c.personal_acc for c in single.clients]
    assert results.collaboration == single.collaboration
