"""A federation behind the broker files `edgefl broker-acl` writes: every participant has its
own user, and no one can speak for anyone else."""

import contextlib

import pytest
from tests_helpers import small_federation

from coordinator.acl import write_broker_files
from coordinator.broker import MosquittoBroker
from coordinator.fleet import NetworkFleet
from coordinator.server import Coordinator, RoundConfig
from edge_sdk import topics
from edge_sdk.algorithms import algorithm_class
from edge_sdk.client import EdgeClient
from edge_sdk.node import ClientNode
from edge_sdk.protocol import Reply
from edge_sdk.transport.base import NotAuthorized
from edge_sdk.transport.mqtt import BrokerSettings, MqttTransport
from edge_sdk.wire import message_frame


@pytest.fixture
def secured(tmp_path):
    files = write_broker_files(tmp_path, ["c0", "c1", "c2", "c9"])
    extra = f"password_file {files['passwd']}\nacl_file {files['acl']}\n"
    with MosquittoBroker(anonymous=False, extra_config=extra) as broker:
        yield broker, files["credentials"]


def _as(broker, credentials, user):
    settings = BrokerSettings(
        url=f"mqtt://{user}@127.0.0.1:{broker.port}", password_file=credentials / user
    )
    return MqttTransport(settings, f"edgefl-acl-{user}")


@contextlib.contextmanager
def _federation(secured, algorithm, **config):
    """A coordinator, clients c0-c2 and the rogue c9, each connected under its own user.

    The federation's data and clients come from the in-memory helper; their transports are
    swapped for MQTT connections under each one's own user."""
    broker, creds = secured
    _, template = small_federation(n=3, rounds=2)
    coordinator = Coordinator(
        NetworkFleet(_as(broker, creds, "coordinator")),
        algorithm=algorithm,
        config=algorithm_class(algorithm).config_cls(**config),
        rounds=2,
        expected_clients=3,
        round_config=RoundConfig(deadline_s=60, register_timeout_s=60),
    ).open()
    clients = [
        EdgeClient(
            ClientNode(c.client_id, c.spec, c.data, seed=i), _as(broker, creds, c.client_id)
        ).start()
        for i, c in enumerate(template)
    ]
    rogue = _as(broker, creds, "c9").connect(10)
    try:
        yield coordinator, clients, rogue
    finally:
        for c in clients:
            c.stop()
            c.transport.close()
        rogue.close()
        coordinator.fleet.transport.close()


def test_a_federation_runs_under_the_acl_and_ignores_an_unregistered_id(secured):
    with _federation(secured, "fedavg", local_epochs=1) as (coordinator, _, rogue):
        # c9 holds valid credentials but is not in this run: its words carry no weight.
        fake = Reply(run="default", sender="c9", task_id="x", round=1, phase="fit", ok=True)
        rogue.publish(topics.up("default", "c9"), message_frame(fake)).wait(10)
        # ... nor can it speak for c0: the broker refuses, and says so.
        with pytest.raises(NotAuthorized):
            rogue.publish(topics.up("default", "c0"), message_frame(fake)).wait(10)
        result = coordinator.run()
    assert [c.id for c in result.clients] == ["c0", "c1", "c2"]
    assert all(r.replied == ["c0", "c1", "c2"] for r in result.rounds)
    assert coordinator.fleet.rejected["unknown_sender"] == 1


def test_peers_under_the_acl_collaborate_and_none_can_forge_another_s_models(secured):
    # FedeRiCo: models and gradients go client to client over peer topics.
    with _federation(secured, "federico", neighbours=2) as (coordinator, clients, rogue):
        # c9 may not replace c0's published model nor send c0 a gradient in c1's name.
        for topic in (
            topics.peer_publication("default", "c0"),
            topics.peer_message("default", "c0", "c1"),
        ):
            with pytest.raises(NotAuthorized):
                rogue.publish(topic, b"forged").wait(10)
        result = coordinator.run()
    assert all(r.replied == ["c0", "c1", "c2"] for r in result.rounds)
    assert all(c.tasks_done >= 5 and not c.errors for c in clients)  # 2 × 2 steps + finalize
    assert all(len(row) == 3 for row in result.extra["collaboration"])


def test_edgefl_keys_issues_private_keys_and_a_roster_and_daemons_refuse_to_start_without(tmp_path):
    from typer.testing import CliRunner

    from coordinator.cli import app
    from edge_sdk.auth import read_roster

    runner = CliRunner()
    res = runner.invoke(app, ["keys", "--clients", "c0,c1", "--out", str(tmp_path / "k")])
    assert res.exit_code == 0, res.output
    keys = sorted(p.name for p in (tmp_path / "k").glob("*.key"))
    assert keys == ["c0.key", "c1.key", "coordinator.key"]
    assert all((tmp_path / "k" / k).stat().st_mode & 0o777 == 0o600 for k in keys)
    assert set(read_roster(tmp_path / "k" / "roster.json")) == {"coordinator", "c0", "c1"}
    # Without keys (and without auth.open), neither daemon starts; each says what to do.
    for command in (["coordinator"], ["client", "--id", "c0", "--index", "0"]):
        res = runner.invoke(app, [*command, "--broker", "mqtt://127.0.0.1:1", "--run-id", "r"])
        assert res.exit_code == 2
        assert "edgefl keys --clients" in res.output and "auth.open=true" in res.output
        # ... and says it first: before, the coordinator printed "checked against None".
        assert "None" not in res.output
        assert res.output.lstrip().startswith("error: no keys"), res.output


def test_edgefl_keys_example_names_a_key_it_wrote(tmp_path):
    # Before, ids dev0,dev1 got an example with c0.key, a file it had not written.
    from typer.testing import CliRunner

    from coordinator.cli import app

    res = CliRunner().invoke(app, ["keys", "--clients", "dev0,dev1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    example = res.output.split("auth.key_file=")[1].split()[0]
    assert example == str(tmp_path / "dev0.key") and (tmp_path / "dev0.key").is_file()
    assert "c0" not in res.output


def test_a_client_without_keyring_stops_at_once_when_its_coordinator_signs():
    # Before, an app that forgot its keyring waited unsigned until its own timeout
    # ("the federation did not end in 15 s"): the coordinator drops unsigned registrations.
    from edge_sdk.auth import Keyring
    from edge_sdk.client import RegistrationRefused

    keys = Keyring.ephemeral([topics.COORDINATOR, "c1", "c2"])  # c0 has none
    _, clients = small_federation(keys=keys)
    c0 = clients[0]
    assert c0.keyring is None
    with pytest.raises(RegistrationRefused, match=r"no keyring.*keyring=Keyring\.load"):
        c0.run(timeout=15)
    assert c0.accepted is False


def test_an_app_that_connects_without_keyring_is_warned(caplog):
    _, clients = small_federation(n=1)
    node = clients[0].node
    app = EdgeClient(node, "mqtt://127.0.0.1:1")
    app.transport.close()
    assert "c0: no keyring: its messages go unsigned (open mode)" in caplog.text


@pytest.mark.parametrize("command", ["keys", "broker-acl"])
@pytest.mark.parametrize("bad", ["..", "."])
def test_ids_that_name_a_directory_are_refused_with_the_rule_and_nothing_is_written(
    tmp_path, command, bad
):
    from typer.testing import CliRunner

    from coordinator.cli import app

    out = tmp_path / "out"
    res = CliRunner().invoke(app, [command, "--clients", f"c0,{bad}", "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert f"client id '{bad}' must be" in res.output and "(not '.' or '..')" in res.output
    assert not out.exists() or not any(out.rglob("*.key"))
