"""Plugins: a user's own models, datasets, partitions and algorithms, named from every command.

What a plugin registers lives in process-wide registries, so every test that loads one runs the
command in its own process (a real `python -m coordinator ...`), as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests_helpers import key_flags
from typer.testing import CliRunner

from coordinator.cli import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugin" / "edgefl_example_plugin.py"
runner = CliRunner()


def _edgefl(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: int = 240):
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=os.environ | (env or {}),
        timeout=timeout,
    )


_FAMILY = """
from torch import nn
from model_zoo import register

@register("{name}")
def build(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
"""
_DATASET = """
import torch
from model_zoo.data import Dataset, register_dataset

@register_dataset("{name}", needs_root=False)
def load(**kwargs):
    return Dataset("{name}", torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]), ["a", "b"], (2,), None)
"""
_SCHEME = """
import numpy as np
from model_zoo.data import register_scheme

@register_scheme("{name}")
def scheme(labels, num_clients, rng, groups):
    return list(np.array_split(np.arange(len(labels)), num_clients)), {{}}
"""


def test_plugins_from_the_flag_the_environment_and_entry_points_all_register(tmp_path: Path):
    # Prepare: three plugins, one per way of naming them, each registering something else.
    for folder, module, code in [
        ("a", "plugin_by_flag", _FAMILY.format(name="flag_family")),
        ("b", "plugin_by_env", _DATASET.format(name="env_dataset")),
        ("c", "plugin_by_entry_point", _SCHEME.format(name="ep_scheme")),
    ]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{module}.py").write_text(code)
    dist = tmp_path / "c" / "edgefl_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: edgefl-test-plugin\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text("[edgefl.plugins]\nmine = plugin_by_entry_point\n")
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "b"), str(tmp_path / "c"), str(ROOT)]),
        "EDGEFL_PLUGINS": "plugin_by_env",
    }

    # Execute
    res = _edgefl("zoo", "--plugin", str(tmp_path / "a" / "plugin_by_flag.py"), env=env)

    # Assert
    assert res.returncode == 0, res.stderr
    rows = dict(line.split(":", 1) for line in res.stdout.splitlines())
    assert "flag_family" in rows["families"].split(", ") or "flag_family" in rows["families"]
    assert "env_dataset" in rows["datasets"]
    assert "ep_scheme" in rows["partitions"]
    assert rows["plugins"].strip() == (
        f"{tmp_path / 'a' / 'plugin_by_flag.py'}, plugin_by_env, mine (plugin_by_entry_point)"
    )


def test_a_plugin_that_cannot_load_is_a_clear_error(tmp_path: Path):
    res = runner.invoke(app, ["zoo", "--plugin", "no_such_module_zq"])
    assert res.exit_code == 2
    assert "plugin 'no_such_module_zq': no module named 'no_such_module_zq'" in res.output
    broken = tmp_path / "broken_plugin_zq.py"
    broken.write_text("raise RuntimeError('boom')\n")
    res = runner.invoke(app, ["zoo", "--plugin", str(broken)])
    assert res.exit_code == 2
    assert f"plugin '{broken}' failed while loading: RuntimeError: boom" in res.output
    res = runner.invoke(app, ["zoo", "--plugin", str(tmp_path / "missing.py")])
    assert res.exit_code == 2 and "no such file" in res.output


def test_simulate_runs_the_example_plugins_model_data_partition_and_algorithm(tmp_path: Path):
    # FedAvgM with no momentum and a server step of 1 is FedAvg: both runs must agree.
    res = _edgefl(
        "simulate",
        "--plugin",
        str(EXAMPLE),
        "--dataset",
        "stripes",
        "--partition",
        "label_blocks",
        "--models",
        "tiny_cnn",
        "--algorithm",
        "fedavgm",
        "--baselines",
        "fedavg",
        "--clients",
        "3",
        "--rounds",
        "2",
        "--local-epochs",
        "1",
        "--lr",
        "0.1",
        "--batch-size",
        "16",
        "--set",
        "fedavgm.server_momentum=0",
        "--set",
        'data.options={"n_samples": 300}',
        "-o",
        str(tmp_path),
        "-q",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["algorithm"] == "fedavgm"
    assert results["config"]["data"]["dataset"] == "stripes"
    assert results["config"]["data"]["partition"] == "label_blocks"
    assert {c["arch"] for c in results["clients"]} == {"tiny_cnn"}
    for c in results["clients"]:
        assert c["personal_acc"] == c["fedavg_acc"], c


def test_the_example_plugin_over_mqtt_coordinator_client_and_export(mosquitto, tmp_path):
    # Prepare: a coordinator and a device, each its own process, each loading the plugin its
    # own way (environment variable; flag).
    common = ["--broker", mosquitto.url, "--run-id", "plugin-e2e", "--set", "device=cpu"]
    keys = key_flags(tmp_path / "keys", ["c1"])
    coord = [
        "coordinator",
        *common,
        *keys["coordinator"],
        "--algorithm",
        "fedavgm",
        "--clients",
        "1",
        "--rounds",
        "2",
        "--local-epochs",
        "1",
        "--lr",
        "0.1",
        "--batch-size",
        "16",
        "--global-model",
        "tiny_cnn",
        "--out",
        str(tmp_path / "out"),
        "--register-timeout",
        "120",
    ]
    device = [
        "client",
        "--plugin",
        str(EXAMPLE),
        *common,
        "--dataset",
        "stripes",
        "--partition",
        "iid",
        "--clients",
        "2",
        "--model",
        "tiny_cnn",
        "--index",
        "1",
        "--threads",
        "1",
        "--state-dir",
        str(tmp_path / "d1"),
        *keys["c1"],
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "coordinator", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=os.environ | env,
        )
        for args, env in [(coord, {"EDGEFL_PLUGINS": str(EXAMPLE)}), (device, {})]
    ]

    # Execute (the device first: when it fails, the coordinator would wait for it in vain)
    try:
        device_log = procs[1].communicate(timeout=240)[0]
        if procs[1].returncode:
            procs[0].kill()
        coordinator_log = procs[0].communicate(timeout=60)[0]
    finally:
        for p in procs:
            p.kill()

    # Assert: the run used the plugin's algorithm, model and data over the broker.
    assert [p.returncode for p in procs] == [0, 0], coordinator_log + "\n\n" + device_log
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["algorithm"] == "fedavgm"
    assert [(c["id"], c["arch"]) for c in results["clients"]] == [("c1", "tiny_cnn")]
    assert "c1: done; personalized model:" in device_log
    assert "(deployed: " in device_log  # which model its guard chose, and its architecture
    assert (tmp_path / "d1" / "c1.run.toml").is_file()  # what `edgefl export` rebuilds from

    # And the device's state exports to int8 (the plugin's model, the client's own data).
    res = _edgefl(
        "export", str(tmp_path / "d1"), "--format", "int8-dynamic", "--plugin", str(EXAMPLE)
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "c1 (tiny_cnn):" in res.stdout
    assert (tmp_path / "d1" / "c1.int8-dynamic.onnx").is_file()
