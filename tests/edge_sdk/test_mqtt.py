"""What only the MQTT transport does: URLs, protocol fallback, typed refusals, TLS, reconnects."""

import contextlib
import itertools
import logging
import socket
import threading
import uuid

import pytest
import trustme
from tests_helpers import eventually

from coordinator.acl import mosquitto_hash, write_broker_files
from coordinator.broker import EmbeddedBroker, MosquittoBroker
from edge_sdk.transport import ConnectError
from edge_sdk.transport.base import NotAuthorized
from edge_sdk.transport.mqtt import BrokerSettings, MqttTransport, parse_broker_url


# -- broker URLs ---------------------------------------------------------------------------
def test_broker_urls_parse_with_defaults_and_credentials():
    a = parse_broker_url("mqtt://broker.example")
    assert (a.tls, a.host, a.port, a.username, a.password) == (
        False,
        "broker.example",
        1883,
        None,
        None,
    )
    b = parse_broker_url("mqtts://dev%40site:s%3Acret@10.0.0.5:9000")
    assert (b.tls, b.host, b.port, b.username, b.password) == (
        True,
        "10.0.0.5",
        9000,
        "dev@site",
        "s:cret",
    )
    assert parse_broker_url("mqtts://h").port == 8883


@pytest.mark.parametrize(
    "url", ["http://h:1883", "mqtt://", "mqtt://h:99999", "mqtt://h/path", "h:1883"]
)
def test_bad_broker_urls_are_refused_with_the_reason(url):
    with pytest.raises(ValueError, match="broker URL"):
        parse_broker_url(url)


def test_the_password_comes_from_settings_or_a_file_before_the_url(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    assert BrokerSettings(url="mqtt://u:in-url@h", password_file=pw).resolved_password() == (
        "from-file"
    )
    assert BrokerSettings(url="mqtt://u:in-url@h", password="env").resolved_password() == "env"
    assert BrokerSettings(url="mqtt://u:in-url@h").resolved_password() == "in-url"


# -- protocol ------------------------------------------------------------------------------
def test_mqtt5_with_mosquitto_and_311_with_amqtt(mosquitto, amqtt_broker):
    five = MqttTransport(mosquitto.url, f"v5-{uuid.uuid4().hex[:6]}").connect(10)
    three = MqttTransport(amqtt_broker.url, f"v3-{uuid.uuid4().hex[:6]}").connect(10)
    try:
        assert five.protocol_version == "5"
        assert three.protocol_version == "3.1.1"
    finally:
        five.close()
        three.close()


class _HangsUpOnMqtt5:
    """A TCP proxy to `port` that closes any connection whose CONNECT asks for MQTT 5 without
    answering it, as RabbitMQ 3.x's MQTT plugin does; 3.1.1 connections pass through."""

    def __init__(self, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            head = conn.recv(64)  # CONNECT: type, length, "\0\4MQTT", protocol level
            if head[8:9] == b"\x05":
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            upstream.sendall(head)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def test_a_broker_that_hangs_up_on_mqtt5_is_spoken_to_in_311(mosquitto):
    proxy = _HangsUpOnMqtt5(mosquitto.port)
    try:
        url = f"mqtt://127.0.0.1:{proxy.port}"
        a = MqttTransport(url, f"old-{uuid.uuid4().hex[:6]}").connect(10)
        b = MqttTransport(url, f"old-{uuid.uuid4().hex[:6]}").connect(10)
        got = threading.Event()
        topic = f"t/{uuid.uuid4().hex[:6]}"
        b.subscribe(topic, lambda t, payload: got.set())
        a.publish(topic, b"x").wait(10)
        assert (a.protocol_version, b.protocol_version) == ("3.1.1", "3.1.1")
        assert got.wait(10)
        a.close()
        b.close()
    finally:
        proxy.server.close()


def test_an_unreachable_broker_fails_connect_with_a_clear_error():
    from coordinator.broker import free_port

    t = MqttTransport(
        BrokerSettings(url=f"mqtt://127.0.0.1:{free_port()}", reconnect_min_s=0.05), "x"
    )
    with pytest.raises(ConnectError, match="cannot reach the broker") as err:
        t.connect(timeout=0.5)
    # ... and says how to get one there (before: the bare socket error).
    port = t.address.port
    assert "Is an MQTT broker running there?" in str(err.value)
    assert f"mosquitto -p {port}" in str(err.value) and "broker.connect_timeout_s" in str(err.value)


def test_a_device_that_boots_before_its_broker_waits_for_it_until_its_limit(monkeypatch, caplog):
    # Prepare: backoff without jitter (0.5, 1, 2 s...); the broker comes up 2 s in, the device
    # allows 3 s. Before, the client gave up at 1.5 s, when its next wait would pass the limit.
    import random

    from coordinator.broker import free_port

    monkeypatch.setattr(random, "uniform", lambda a, b: 1.0)
    # (another test in the same worker may have left the logger's level above WARNING)
    caplog.set_level(logging.WARNING, logger="edge_sdk.transport.mqtt")
    port = free_port()
    broker = EmbeddedBroker(port=port)
    late = threading.Timer(2.0, broker.start)
    late.start()
    t = MqttTransport(BrokerSettings(url=f"mqtt://{broker.USER}@127.0.0.1:{port}"), "early")
    try:
        # Execute
        t.connect(timeout=3.0)

        # Assert: connected, having said what it was waiting for.
        assert t.connected
        assert f"the broker at mqtt://{broker.USER}@127.0.0.1:{port} is not reachable yet" in (
            caplog.text
        )
    finally:
        late.join()
        t.close()
        broker.stop()


# -- ACLs: typed refusals ------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """mosquitto with the files `edgefl broker-acl` writes: clients alice and bob, coordinator."""
    d = tmp_path_factory.mktemp("acl")
    files = write_broker_files(d, ["alice", "bob"])
    extra = f"password_file {files['passwd']}\nacl_file {files['acl']}\n"
    with MosquittoBroker(anonymous=False, extra_config=extra) as broker:
        broker.credentials = files["credentials"]
        yield broker


def _as(broker, user, password=None):
    url = f"mqtt://{user}@127.0.0.1:{broker.port}"
    if password is None:
        settings = BrokerSettings(url=url, password_file=broker.credentials / user)
    else:
        settings = BrokerSettings(url=url, password=password)
    return MqttTransport(settings, f"{user}-{uuid.uuid4().hex[:6]}")


def test_a_publish_the_acl_denies_raises_not_authorized_and_delivers_nothing(secured):
    coord, alice = _as(secured, "coordinator").connect(10), _as(secured, "alice").connect(10)
    got = []
    coord.subscribe("edgefl/r/up/+", lambda t, p: got.append(t))
    try:
        alice.publish("edgefl/r/up/alice", b"mine").wait(10)  # her own up topic: fine
        with pytest.raises(NotAuthorized) as err:
            alice.publish("edgefl/r/up/bob", b"impersonation").wait(10)
        assert err.value.reason_code == 135
        eventually(lambda: got)
        alice.publish("edgefl/r/up/alice", b"again").wait(10)
        eventually(lambda: len(got) == 2)
        assert got == ["edgefl/r/up/alice", "edgefl/r/up/alice"]
    finally:
        coord.close()
        alice.close()


def test_a_wrong_password_is_refused_at_connect(secured):
    with pytest.raises(ConnectError, match="credentials"):
        _as(secured, "alice", password="wrong").connect(10)


def test_a_client_cannot_read_another_clients_down_topic(secured):
    coord, alice, bob = (_as(secured, u).connect(10) for u in ("coordinator", "alice", "bob"))
    snooped, mine = [], []
    bob.subscribe("edgefl/r/down/alice", lambda t, p: snooped.append(p))  # granted, then filtered
    bob.subscribe("edgefl/r/down/bob", lambda t, p: mine.append(p))
    try:
        coord.publish("edgefl/r/down/alice", b"for alice").wait(10)
        coord.publish("edgefl/r/down/bob", b"for bob").wait(10)
        eventually(lambda: mine)
        assert snooped == [] and mine == [b"for bob"]
    finally:
        for t in (coord, alice, bob):
            t.close()


def test_password_hashes_are_what_mosquitto_passwd_writes(tmp_path):
    import base64
    import subprocess

    subprocess.run(["mosquitto_passwd", "-b", "-c", str(tmp_path / "p"), "u", "pw"], check=True)
    theirs = (tmp_path / "p").read_text().strip().split(":", 1)[1]
    salt = base64.b64decode(theirs.split("$")[3])
    assert mosquitto_hash("pw", salt) == theirs


# -- TLS -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(d / "ca.pem")
    cert.private_key_pem.write_to_path(d / "key.pem")
    cert.cert_chain_pems[0].write_to_path(d / "cert.pem")
    from coordinator.broker import free_port

    port, mutual = free_port(), free_port()
    files = f"cafile {d / 'ca.pem'}\ncertfile {d / 'cert.pem'}\nkeyfile {d / 'key.pem'}\n"
    extra = (
        f"listener {port} 127.0.0.1\n{files}"
        f"listener {mutual} 127.0.0.1\n{files}require_certificate true\n"
    )
    for name, issuer in (("alice", ca), ("mallory", trustme.CA())):  # a device's certificate
        issued = issuer.issue_cert(f"{name}@devices")
        issued.private_key_pem.write_to_path(d / f"{name}.key")
        issued.cert_chain_pems[0].write_to_path(d / f"{name}.pem")
    with MosquittoBroker(extra_config=extra) as broker:
        broker.mutual_port, broker.dir = mutual, d
        yield broker, port, d / "ca.pem"


def test_tls_verifies_the_broker_against_the_given_ca(tls_broker):
    _, port, ca = tls_broker
    ok = MqttTransport(BrokerSettings(url=f"mqtts://127.0.0.1:{port}", ca_file=ca), "tls-ok")
    ok.connect(10)
    ok.close()
    other_ca = trustme.CA()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        wrong = Path(tmp) / "other.pem"
        other_ca.cert_pem.write_to_path(wrong)
        bad = MqttTransport(BrokerSettings(url=f"mqtts://127.0.0.1:{port}", ca_file=wrong), "x")
        with pytest.raises(ConnectError, match="TLS"):
            bad.connect(10)


def test_client_certificates_from_the_brokers_ca_are_required_when_it_asks(tls_broker):
    broker, _, ca = tls_broker
    url, d = f"mqtts://127.0.0.1:{broker.mutual_port}", broker.dir

    def device(name=None):
        certs = {"cert_file": d / f"{name}.pem", "key_file": d / f"{name}.key"} if name else {}
        return MqttTransport(BrokerSettings(url=url, ca_file=ca, **certs), f"mtls-{name}")

    device("alice").connect(10).close()  # a certificate the broker's CA signed
    for name in (None, "mallory"):  # none at all, or one from another CA
        with pytest.raises(ConnectError):
            device(name).connect(5)


# -- reconnects ----------------------------------------------------------------------------
def test_clients_reconnect_after_a_broker_restart_and_nothing_is_lost(tmp_path):
    with MosquittoBroker(persistence=True, workdir=tmp_path) as broker:
        fast = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5}
        sub = MqttTransport(BrokerSettings(url=broker.url, **fast), "restart-sub").connect(10)
        pub = MqttTransport(BrokerSettings(url=broker.url, **fast), "restart-pub").connect(10)
        got = []
        sub.subscribe("r/x", lambda t, p: got.append(p))
        pub.publish("r/x", b"before").wait(10)
        eventually(lambda: got == [b"before"])
        broker.restart()
        d = pub.publish("r/x", b"after")  # queued by paho until the connection is back
        d.wait(20)
        eventually(lambda: got == [b"before", b"after"], timeout=20)
        sub.close()
        pub.close()


def test_reconnect_backoff_doubles_up_to_its_cap():
    settings = BrokerSettings(url="mqtt://127.0.0.1", reconnect_min_s=0.25, reconnect_max_s=1.0)
    t = MqttTransport(settings, "backoff")
    client = t._client
    client.stop_waiting.set()  # no real sleeping in this test
    seen = []
    for _ in range(5):
        client._reconnect_wait()
        seen.append(client.backoff)
    assert seen == [0.25, 0.5, 1.0, 1.0, 1.0]


def test_amqtt_serves_a_client_that_connects_while_others_subscribe():
    """amqtt 0.12 awaits inside its loop over the subscription table when a client connects
    (sending it retained messages); a subscribe meanwhile raised "dictionary changed size
    during iteration" and left the new connection dead. EmbeddedBroker guards the table."""
    with EmbeddedBroker() as broker:
        filler = MqttTransport(broker.url, "filler").connect(10)
        for i in range(30):  # retained messages make the connect loop yield at each filter
            filler.subscribe(f"fill/{i}", lambda t, p: None)
            filler.publish(f"fill/{i}", b"r", retain=True).wait(10)
        stop = threading.Event()
        churn = MqttTransport(broker.url, "churn").connect(10)

        def subscribe_forever() -> None:
            for i in itertools.count():
                if stop.is_set():
                    return
                churn.subscribe(f"churn/{i}", lambda t, p: None)

        thread = threading.Thread(target=subscribe_forever)
        thread.start()
        try:
            for k in range(3):
                got: list[bytes] = []
                client = MqttTransport(broker.url, f"late-{k}").connect(10)
                client.subscribe(f"own/{k}", lambda t, p, got=got: got.append(p))  # SUBACK
                filler.publish(f"own/{k}", b"x").wait(10)
                eventually(lambda got=got: got == [b"x"])
                client.close()
        finally:
            stop.set()
            thread.join()
            churn.close()
            filler.close()
