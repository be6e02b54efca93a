"""`edgefl coordinator` and `edgefl client` as a user starting them by hand meets them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.cli import app

runner = CliRunner()


def test_a_client_without_its_identity_refuses_to_start(tmp_path: Path, monkeypatch):
    # Before: it silently became c0, created ./edgefl-state and waited forever; two collided.
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["client", "--broker", "mqtt://127.0.0.1:9", "--id", "phone1"])
    assert res.exit_code == 2
    assert "which client is this? pass --index I" in res.output
    assert list(tmp_path.iterdir()) == []  # no state directory made


def test_the_coordinator_waits_long_enough_for_devices_started_by_hand():
    from coordinator.server import RoundConfig

    assert RoundConfig().register_timeout_s >= 600  # the README's demo took 65 s to register


def test_a_coordinator_whose_clients_do_not_come_says_how_to_wait_longer(mosquitto, tmp_path):
    run = f"lonely-{uuid.uuid4().hex[:6]}"
    res = runner.invoke(
        app,
        [
            "coordinator",
            "--broker",
            mosquitto.url,
            "--run-id",
            run,
            "--clients",
            "2",
            "--register-timeout",
            "1",
            "--out",
            str(tmp_path),
            "--set",
            "auth.open=true",  # no keys needed: no client will come
        ],
    )
    assert res.exit_code == 2, res.output
    assert f"coordinator {run}: waiting up to 1 s for 2 clients on {mosquitto.url}" in res.output
    assert f"coordinator {run}: logs: stderr (text, WARNING and above" in res.output
    assert (
        "only 0 of 2 clients registered within 1 s (round.register_timeout_s: "
        "--register-timeout SECONDS waits longer; --min-clients M starts with fewer)"
    ) in res.output


@pytest.mark.parametrize("bad", [["--threads", "0"], ["--index", "-1"]])
def test_client_numbers_are_checked(bad):
    res = runner.invoke(app, ["client", *bad, "--broker", "mqtt://127.0.0.1:9"])
    assert res.exit_code == 2
    assert "greater than or equal to" in res.output
