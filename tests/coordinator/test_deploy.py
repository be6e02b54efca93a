"""Deployment over a real broker: the coordinator daemon and edge clients as separate processes."""

import json
import subprocess
import threading
import urllib.request

import pytest
from tests_helpers import (
    ARCHS,
    EDGEFL,
    FAST_EXPORT,
    FEDERICO,
    deploy,
    raises_exactly,
    simulated_federico,
    tiny_config,
)

from coordinator.broker import free_port
from coordinator.deploy import RoundsLog, run_coordinator
from coordinator.results import RoundRecord
from coordinator.results_model import Results
from coordinator.simulator import simulate
from edge_sdk.auth import AuthSettings, Keyring, issue_keys
from edge_sdk.budget import arch_name
from edge_sdk.inference import OnnxPredictor


def _check_deployment(out, tmp_path, families=ARCHS):
    results = Results.read(out / "results.json")  # a file that validates
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["replied"] == ["c0", "c1", "c2"] for r in rounds)
    assert (out / "report.md").is_file()
    for i, c in enumerate(results.clients):
        predictor = OnnxPredictor(tmp_path / f"state{i}" / f"c{i}.onnx")
        # The model the client deploys, as its reply says: its own architecture (its budget's
        # default) unless `families` is None (a budget that allows any).
        assert arch_name(predictor.spec) == c.details["deployed_arch"]
        assert families is None or c.details["deployed_arch"] == families[i]
    return results


def test_coordinator_and_three_client_processes_run_fml_over_mosquitto(mosquitto, tmp_path):
    # The daemon's own data and model settings (which it does not use) disagree with what its
    # clients run: Fashion-MNIST and lenet5 there, 8×8 digits on mlr, mlp and cnn1 here.
    unused = ["data.dataset=fashion_mnist", 'models=["lenet5"]']
    out, logs = deploy(mosquitto.url, tmp_path, "e2e-mosquitto", coordinator_sets=unused)
    results = _check_deployment(out, tmp_path)
    assert [c.arch for c in results.clients] == ARCHS
    assert results.summary.mean_personal_acc > 0.5
    assert "round 2/2 ok" in logs[0]
    # After the last round it says what the clients are doing (it can take longer).
    assert logs[0].index("round 2/2 ok") < logs[0].index(": the clients finalize (each chooses")
    # ... and how many have (each of a fleet of ten or fewer), the rounds' replies not counted
    said = [line.split(": ", 1)[1] for line in logs[0].splitlines() if "clients finalized" in line]
    assert said == [f"{n} of 3 clients finalized" for n in (1, 2, 3)]
    assert logs[0].index(": the clients finalize (each") < logs[0].index("1 of 3 clients finalized")
    # results.json and the report describe what the clients registered, never those settings.
    assert [(c.dataset, c.device, c.precision) for c in results.clients] == [
        ("digits", "cpu", "float32")
    ] * 3
    assert "data" not in results.config and "models" not in results.config
    assert results.device is not None and results.device.used == "cpu"
    report = (out / "report.md").read_text()
    assert "trained 3 clients for 2 rounds on digits." in report
    assert "| Dataset | digits |" in report and "| Models | mlr, mlp, cnn1 |" in report
    assert "Device: `cpu` (as each client reported when it registered), float32." in report
    for text in (report, (out / "results.json").read_text()):
        assert "fashion_mnist" not in text and "lenet5" not in text
    assert "device: cpu (as each client reported when it registered), float32" in logs[0]
    # Deployed over processes and simulated in one process: the same per-client accuracies.
    cfg = tiny_config(
        algorithm="fml",
        models=ARCHS,
        global_model="mlr",
        clients=3,
        rounds=2,
        local_epochs=2,
        batch_size=32,
        lr=0.1,
        parallel=2,
    )
    simulated = simulate(cfg, progress=False)
    deployed = [c.personal_acc for c in results.clients]
    assert deployed == [c.personal_acc for c in simulated.clients]


def test_the_same_deployment_runs_over_the_embedded_amqtt_broker(amqtt_broker, tmp_path):
    out, _ = deploy(amqtt_broker.url, tmp_path, "e2e-amqtt", client_flags=FAST_EXPORT)
    _check_deployment(out, tmp_path)


def test_federico_clients_as_processes_collaborate_over_mosquitto_and_export_mixtures(
    mosquitto, tmp_path
):
    # Models and gradients go from client to client over peer topics; the coordinator only
    # keeps the round clock, and each client (which may deploy any model) exports what its
    # guard chose: by default the mixture predictor with its fine-tuned model.
    out, logs = deploy(
        mosquitto.url, tmp_path, "e2e-federico", FEDERICO, client_flags=["--deploy", "any"]
    )
    results = _check_deployment(out, tmp_path, families=None)
    # Deployed over processes and simulated in one process: the same results.
    simulated = simulated_federico()
    assert [c.personal_acc for c in results.clients] == [c.personal_acc for c in simulated.clients]
    assert results.collaboration == simulated.collaboration
    assert results.collaboration_clients == ["c0", "c1", "c2"]
    assert results.collaboration is not None and results.collaboration_history is not None
    for row in results.collaboration:
        assert len(row) == 3 and abs(sum(row) - 1) < 1e-4
    assert [h.round for h in results.collaboration_history] == [1, 2]
    assert "round 2/2 ok" in logs[0]


@pytest.mark.parametrize("broker", ["mosquitto", "amqtt_broker"])
def test_fml_over_a_broker_gives_the_in_memory_simulators_accuracies(broker, request):
    url = request.getfixturevalue(broker).url

    def run(**kw):
        cfg = tiny_config(
            algorithm="fml", models=ARCHS, global_model="mlr", clients=3, rounds=2, **kw
        )
        res = simulate(cfg, progress=False)
        return [c.personal_acc for c in res.clients], [r.global_acc for r in res.rounds]

    assert run(**{"broker.url": url}) == run()


def test_the_daemon_logs_rounds_and_serves_prometheus_metrics(mosquitto, tmp_path):
    port = free_port()
    keys = issue_keys(tmp_path / "keys", ["c0", "c1"])
    cfg = tiny_config(
        algorithm="fedavg",
        clients=2,
        rounds=2,
        run_id="metrics",
        out=str(tmp_path),
        metrics_port=port,
        **{
            "broker.url": mosquitto.url,
            "auth.key_file": str(keys["coordinator"]),
            "auth.roster": str(keys["roster"]),
        },
    )
    scraped = []

    def scrape(rec):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            scraped.append(r.read().decode())

    from coordinator.federation import prepare_federation
    from coordinator.simulator import transport_factory
    from edge_sdk.client import EdgeClient
    from edge_sdk.node import ClientNode
    from model_zoo import ArchSpec

    fed = prepare_federation(cfg)
    connect = transport_factory(cfg, "metrics")
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    clients = [
        EdgeClient(
            ClientNode(cid, spec, data, run_id="metrics", seed=i),
            connect(cid),
            keyring=Keyring.load(AuthSettings(key_file=keys[cid], roster=keys["roster"]), cid),
        )
        for i, (cid, data) in enumerate(zip(fed.client_ids, fed.client_data, strict=True))
    ]
    starter = threading.Timer(0.5, lambda: [c.start() for c in clients])
    starter.start()
    try:
        results = run_coordinator(cfg, on_round=scrape)
    finally:
        starter.join()
        for c in clients:
            c.stop()
            c.transport.close()
    first, second = scraped
    assert "edgefl_rounds_completed_total 1.0" in first
    assert "edgefl_rounds_completed_total 2.0" in second
    assert "edgefl_clients_registered 2.0" in second and "edgefl_clients_online 2.0" in second
    assert "edgefl_bytes_out_total" in second and "edgefl_round_seconds_count 2.0" in second
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]
    assert results.summary.mean_personal_acc is not None


def test_rounds_log_lists_the_checkpoints_rounds_once_keeping_lines_the_records_lost(tmp_path):
    # Prepare: the checkpoint's records are compact (a large fleet); rounds.jsonl has every
    # client's line for rounds 1 and 2, round 2 twice, a round after the checkpoint (4) and a
    # line cut short; round 3's line was never written (the coordinator stopped in between).
    def record(r, **kw):
        return RoundRecord(r, 1.0, 0.5, None, ["c0", "c1"], ["c0"], client_acc={"c0": 0.5}, **kw)

    path = tmp_path / "rounds.jsonl"
    log = RoundsLog(path)
    for r in (1, 2, 2, 4):
        log.append(record(r, online=r))
    with path.open("a") as f:
        f.write('{"round": 5, "seconds"')
    before = path.read_text().splitlines()
    records = [record(r).compact() for r in (1, 2, 3)]

    # Execute
    log.keep(records)

    # Assert: 1 and 2 as first written, whole; 3 from its compact record, counts and spread.
    lines = path.read_text().splitlines()
    assert lines[:2] == [before[0], before[1]]
    assert json.loads(lines[0])["client_acc"] == {"c0": 0.5}
    third = json.loads(lines[2])
    assert (third["round"], third["trained"], third["n_trained"], third["n_replied"]) == (
        3,
        [],
        2,
        1,
    )
    assert third["acc_spread"]["n"] == 1 and third["acc_spread"]["p50"] == 0.5
    assert len(lines) == 3


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"algorithm": "fml", "fml.preset": "trusted"}, "fml (preset 'trusted') needs 200"),
        ({"algorithm": "fedme"}, "fedme needs 1000"),
    ],
)
def test_a_coordinator_without_the_unlabeled_file_it_needs_says_so_before_waiting(
    settings, said, tmp_path
):
    from coordinator.config import ConfigError, load_config

    # a broker nobody listens on: the check comes before anything connects or registers
    cfg = load_config(
        None, {**settings, "broker.url": "mqtt://127.0.0.1:1", "out": str(tmp_path)}, None
    )
    with raises_exactly(
        ConfigError,
        f"{said} unlabeled inputs the coordinator holds, and a deployment reads them from a "
        f"file: name a .npy or .safetensors file of inputs in {settings['algorithm']}"
        ".unlabeled_path",
    ):
        run_coordinator(cfg)
    assert not (tmp_path / "rounds.jsonl").exists()


def test_a_password_on_the_command_line_is_refused():
    res = subprocess.run(
        [EDGEFL, "coordinator", "--broker", "mqtt://me:secret@127.0.0.1:1", "--clients", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "EDGEFL_BROKER__PASSWORD" in res.stderr and "secret" not in res.stderr


@pytest.mark.parametrize("where", ["toml", "env", "flag"])
def test_settings_resolve_toml_then_environment_then_flags(where, tmp_path, monkeypatch):
    from coordinator.config import load_config

    toml = tmp_path / "c.toml"
    toml.write_text("rounds = 3\n[fml]\nalpha = 0.1\n")
    if where in ("env", "flag"):
        monkeypatch.setenv("EDGEFL_ROUNDS", "4")
        monkeypatch.setenv("EDGEFL_FML__ALPHA", "0.2")
    flags = {"rounds": 5, "fml.alpha": 0.3} if where == "flag" else {}
    cfg = load_config(toml, flags)
    expected = {"toml": (3, 0.1), "env": (4, 0.2), "flag": (5, 0.3)}[where]
    assert (cfg.rounds, cfg.fml.alpha) == expected
