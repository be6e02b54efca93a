"""The shipped example configs stay valid as the config schema evolves."""

from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.fleet import NetworkFleet

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config(path)
    budget = cfg.algorithm_config().model_dump()
    assert (budget.get("local_epochs") or budget.get("local_iterations")) >= 1


def test_pfml_example_carries_the_paper_settings():
    cfg = load_config(EXAMPLES / "pfml_synthetic.toml")
    p = cfg.algorithm_config()
    assert (p.k_steps, p.lam, p.beta, p.lr, p.batch_size) == (3, 20.0, 2.0, 0.01, 200)
    assert p.local_iterations == 10
    assert (cfg.clients, cfg.clients_per_round, cfg.data.partition) == (100, 10, "natural")


def test_the_embedded_device_app_runs_against_a_real_broker(mosquitto, tmp_path):
    import subprocess
    import sys
    import threading

    from coordinator.server import Coordinator, RoundConfig
    from edge_sdk.algorithms import algorithm_class
    from edge_sdk.auth import AuthSettings, Keyring, issue_keys
    from edge_sdk.transport.mqtt import MqttTransport

    keys = issue_keys(tmp_path / "keys", ["phone0", "phone1"])
    mine = AuthSettings(key_file=keys["coordinator"], roster=keys["roster"])
    coordinator = Coordinator(
        NetworkFleet(
            MqttTransport(mosquitto.url, "example-coordinator"),
            keyring=Keyring.load(mine, "coordinator"),
        ),
        algorithm="fml",
        config=algorithm_class("fml").config_cls(local_epochs=2, batch_size=32, lr=0.05),
        rounds=2,
        expected_clients=2,
        global_model="mlr",
        run_id="phones",
        round_config=RoundConfig(register_timeout_s=120, deadline_s=120),
    ).open()
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=coordinator.run()))
    runner.start()
    script = EXAMPLES / "embedded_client.py"
    args = ["--broker", mosquitto.url, "--out", str(tmp_path), "--roster", str(keys["roster"])]

    def key(i):
        return ["--key-file", str(keys[f"phone{i}"])]

    devices = [
        subprocess.Popen(
            [sys.executable, str(script), *args, "--id", f"phone{i}", "--slice", str(i), *key(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [d.communicate(timeout=180)[0] for d in devices]
    finally:
        for d in devices:
            d.kill()
        runner.join(60)
        coordinator.fleet.transport.close()
    assert [d.returncode for d in devices] == [0, 0], "\n".join(logs)
    assert all("predicts" in log and "round 2/2 fit: ok" in log for log in logs)
    assert (tmp_path / "phone0.onnx").is_file() and (tmp_path / "phone1.onnx").is_file()
    assert [c.id for c in result["run"].clients] == ["phone0", "phone1"]


def _readme_block(heading: str) -> str:
    """The first ```python block of README.md after `heading`."""
    text = (EXAMPLES.parent / "README.md").read_text()
    after = text[text.index(heading) :]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_python_snippet_runs_as_written(tmp_path):
    # Before: it predicted on an undefined `images`, normalising them a second time.
    import subprocess
    import sys

    from model_zoo.data import DatasetNotFound, load_dataset

    try:
        load_dataset("fashion_mnist", max_samples=10)
    except DatasetNotFound:
        pytest.skip("Fashion-MNIST is not installed (make test installs it as root)")
    code = _readme_block("## Using the pieces directly")
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "lenet5.onnx").is_file()
    assert res.stdout.strip().splitlines()[-1].startswith("['")  # eight class names
