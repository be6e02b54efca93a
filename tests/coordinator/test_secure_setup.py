"""The secure set-up of docs/tutorials/deploy.md, as printed, with real processes.

`edgefl broker-acl` writes the broker's files; a stock mosquitto runs them unchanged (as root it
drops to user `mosquitto` before reading them); the coordinator and three devices connect over
TLS, each as its own broker user and with its own signing key, given through the environment as
the tutorial shows. Meanwhile a participant's valid credentials (c9's: a user of the broker, not of
the run) ask for the coordinator's and c1's MQTT client ids, again and again, and flood their own
topic: nobody is knocked off and the run ends with an undisturbed run's accuracies.
"""

import grp
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import trustme
from tests_helpers import (
    ARCHS,
    DATA,
    EDGEFL,
    ONE_VIEW,
    SETS,
    TRAIN,
    exit_codes,
    simulated_fml_accuracies,
)

from coordinator.acl import BROKER_USER
from coordinator.broker import free_port, mosquitto_path
from edge_sdk import topics
from edge_sdk.transport.base import ConnectError
from edge_sdk.transport.mqtt import BrokerSettings, MqttTransport

ROUNDS = 3

pytestmark = pytest.mark.skipif(
    mosquitto_path() is None or os.geteuid() != 0,
    reason="needs mosquitto, run as root as a system service runs it (make test installs it)",
)


@pytest.fixture
def etc():
    """A directory like /etc/mosquitto: one that user mosquitto may enter (pytest's own temp
    directories are mode 700)."""
    d = Path(tempfile.mkdtemp(prefix="edgefl-etc-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _tls(where):
    """ca.pem, broker.pem and broker.key, the key readable by group mosquitto."""
    where.mkdir()
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(where / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(where / "broker.pem")
    cert.private_key_pem.write_to_path(where / "broker.key")
    shutil.chown(where / "broker.key", group=BROKER_USER)
    os.chmod(where / "broker.key", 0o640)
    return where / "ca.pem"


def _as(user, port, out, ca, client_id):
    settings = BrokerSettings(
        url=f"mqtts://{user}@127.0.0.1:{port}",
        password_file=out / "credentials" / user,
        ca_file=ca,
        reconnect_max_s=1,
    )
    return MqttTransport(settings, client_id)


def test_the_readme_secure_setup_runs_as_printed_and_no_credential_takes_a_session(etc):
    out, port = etc / "edgefl", free_port()
    ca = _tls(etc / "certs")
    tls = ["--port", str(port), "--tls-dir", str(etc / "certs")]
    subprocess.run(
        [EDGEFL, "broker-acl", "--clients", "c0,c1,c2,c9", "--out", str(out), *tls],
        check=True,
        capture_output=True,
    )
    # Owners and modes: mosquitto reads these after dropping root; secrets are their owner's.
    for name in ("passwd", "acl"):
        st = os.stat(out / name)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, grp.getgrnam(BROKER_USER).gr_gid)
    for secret in [*(out / "credentials").iterdir(), *(out / "keys").glob("*.key")]:
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, secret
    broker = subprocess.Popen(
        [mosquitto_path(), "-c", str(out / "mosquitto.conf")],  # the file as written
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: etc / f"{name}.log" for name in ("coordinator", "c0", "c1", "c2")}
    try:
        probe = _as("coordinator", port, out, ca, "probe")
        deadline = time.monotonic() + 30
        while True:  # ready once a real TLS connection with a real password gets in
            try:
                probe.connect(2)
                break
            except ConnectError:
                assert broker.poll() is None, broker.communicate()[1]
                assert time.monotonic() < deadline, "the broker never accepted the coordinator"
                probe = _as("coordinator", port, out, ca, "probe")
        probe.close()
        url = f"127.0.0.1:{port}"
        env = {**os.environ, "EDGEFL_BROKER__CA_FILE": str(ca)}

        def start(name, user, *argv):  # the command line, in parts
            # Each participant's secrets come from files named in its environment, never argv.
            mine = {
                "EDGEFL_BROKER__PASSWORD_FILE": str(out / "credentials" / user),
                "EDGEFL_AUTH__KEY_FILE": str(out / "keys" / f"{user}.key"),
                "EDGEFL_AUTH__ROSTER": str(out / "keys" / "roster.json"),
            }
            with logs[name].open("w") as log:
                command = [x for part in argv for x in part]
                procs[name] = subprocess.Popen(
                    command, env=env | mine, stdout=log, stderr=subprocess.STDOUT
                )

        run = ["--run-id", "shop-floor"]
        start(
            "coordinator",
            "coordinator",
            [EDGEFL, "coordinator", "--broker", f"mqtts://coordinator@{url}", *run, "-v"],
            ["--algorithm", "fml", "--clients", "3", "--rounds", str(ROUNDS)],
            ["--global-model", "mlr", "--out", str(etc / "out"), *TRAIN, *ONE_VIEW, *SETS],
        )
        for i, arch in enumerate(ARCHS):
            me = ["--id", f"c{i}", "--model", arch, "--index", str(i), "--seed", "0", "-v"]
            state = ["--state-dir", str(etc / f"state{i}"), "--threads", "1"]
            start(
                f"c{i}",
                f"c{i}",
                [EDGEFL, "client", "--broker", f"mqtts://c{i}@{url}", *run, *me, *DATA],
                state,
                SETS,
            )
        # c9: valid credentials, not in the run. It asks for others' session ids, and floods.
        intrusions = 0
        flooded = False
        deadline = time.monotonic() + 400
        while procs["coordinator"].poll() is None and time.monotonic() < deadline:
            for victim in ("edgefl-shop-floor-coordinator", "edgefl-shop-floor-c1"):
                intruder = _as("c9", port, out, ca, victim)
                intruder.connect(10)
                if not flooded:
                    up = topics.up("shop-floor", "c9")
                    deliveries = [intruder.publish(up, b"EF1M{flood") for _ in range(10_000)]
                    deliveries[-1].wait(60)
                    flooded = True
                intruder.close()
                intrusions += 1
            time.sleep(0.5)
        codes = exit_codes(procs, deadline)
        dump = "\n".join(f"--- {n}\n{logs[n].read_text()[-3000:]}" for n in logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        broker.terminate()
        broker.wait(10)
    assert codes == dict.fromkeys(procs, 0), dump
    assert intrusions >= 2 and flooded
    # Nobody was knocked off: the coordinator's and c1's connections never dropped.
    for name in ("coordinator", "c1"):
        assert "connection lost" not in logs[name].read_text(), dump
    rounds = [json.loads(x) for x in (etc / "out" / "rounds.jsonl").read_text().splitlines()]
    assert all(r["replied"] == ["c0", "c1", "c2"] and not r["failed"] for r in rounds), dump
    results = json.loads((etc / "out" / "results.json").read_text())
    assert [c["personal_acc"] for c in results["clients"]] == simulated_fml_accuracies(ROUNDS)
