"""`edgefl demo`: a federation of real processes over a real broker, its report, and Ctrl-C.

Both tests start real processes (a broker, a coordinator daemon, device processes), kept to two
devices, one or two rounds and scikit-learn's digits so that they stay short.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from coordinator.demo import DemoOptions, run_demo
from coordinator.results_model import Results

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_demo_runs_devices_as_processes_and_writes_the_report(tmp_path: Path) -> None:
    lines: list[str] = []

    # Children this test process had before (a session's broker fixture) are not the demo's.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    plugin = ROOT / "examples" / "plugin" / "edgefl_example_plugin.py"
    child_args = ("--log-level", "INFO", "--log-format", "json", "--plugin", str(plugin))
    results = run_demo(
        DemoOptions(
            rounds=2, clients=2, dataset="digits", out=tmp_path, seed=3, child_args=child_args
        ),
        echo=lines.append,
    )

    text = "\n".join(lines)
    # Each device was its own process, with its own architecture, over the broker.
    pids = [int(p) for p in re.findall(r"c\d \w+ \(pid (\d+)\)", text)]
    assert len(pids) == 2 and os.getpid() not in pids
    assert re.search(r"broker: mqtt://127\.0\.0\.1:\d+ \(", text)
    # Every process had its own signing key; the coordinator checked every message against them.
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [
        "c0.key",
        "c1.key",
        "coordinator.key",
        "roster.json",
    ]
    assert "messages signed and checked" in (tmp_path / "logs" / "coordinator.log").read_text()
    assert [c.arch for c in results.clients] == ["mlr", "mlp"]
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []  # nothing the demo started is left running
    # Live progress: one line per round with every client's accuracy.
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert [ln[:11] for ln in rounds] == ["round  1/2 ", "round  2/2 "]
    assert all("online 2/2" in ln and " c0 " in ln and " c1 " in ln for ln in rounds)
    last = results.rounds[-1].client_acc
    assert f"c1 {100 * last['c1']:5.1f}" in rounds[-1]
    # The baselines, FedAvg+FT too, ran on the same split; the metrics come from them.
    assert all(None not in (c.local_acc, c.fedavg_acc, c.fedavg_ft_acc) for c in results.clients)
    assert results.summary.metrics is not None and "PUI" in results.summary.metrics
    assert "FedAvg+FT" in text.split("client  arch", 1)[1].splitlines()[0]  # its column
    # Each device trained where it registered it did, and the report says so.
    assert [c.device for c in results.clients] == ["cpu", "cpu"]
    assert results.device is not None and results.device.used == "cpu"
    # The ONNX file each device exported scores what the federation measured for that device.
    assert results.onnx is not None
    for row, client in zip(results.onnx, results.clients, strict=True):
        assert (tmp_path / str(row.file)).is_file() and (row.size_bytes or 0) > 0
        assert row.accuracy == pytest.approx(client.personal_acc, abs=1e-6)
        # The table names the model the device deploys, as its finalize reply said: by
        # default a model of its own architecture.
        assert row.arch == client.details["deployed_arch"]
    # The split is stated, and each device holds a few classes.
    assert results.split is not None
    counts = [c.counts for c in results.split.clients]
    assert all(0 < sum(1 for n in row if n) < 10 for row in counts)
    assert "label_groups" in text and "data: digits" in text
    # The report: Markdown, plots, one page with them embedded, and results.json on disk.
    assert Results.read(tmp_path / "results.json") == results
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3
    assert "## Data per client" in (tmp_path / "report.md").read_text()
    assert re.search(r"wall time: \d+\.\d s", text)
    # One wall time in the report: the summary's is the sum of the steps the setup lists
    # (before, 96.77 s in the summary against "137.3 s in all" in the setup).
    assert results.setup is not None and "in all" not in results.setup["Time per step"]
    steps = [float(v) for v in re.findall(r"(\d+\.\d) s", results.setup["Time per step"])]
    assert len(steps) == 4 and "Wall time" not in results.setup
    assert results.summary.wall_seconds == pytest.approx(sum(steps), abs=0.25)
    # Where the logs are, and every process got the demo's log options and plugins.
    assert f"logs: {tmp_path / 'logs'}/<name>.log, one per process (coordinator, c0, c1)" in text
    for name in ("coordinator", "c0", "c1"):
        log = (tmp_path / "logs" / f"{name}.log").read_text().splitlines()
        records = [json.loads(ln) for ln in log if ln.startswith("{")]
        assert f"plugins loaded: {plugin}" in [r["message"] for r in records], name


def test_demo_sigint_stops_the_broker_and_every_process(tmp_path: Path) -> None:
    flags = ["--clients", "2", "--rounds", "200", "--dataset", "digits", "--out", str(tmp_path)]
    demo = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "demo", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    seen: list[str] = []
    try:
        assert demo.stdout is not None
        # Until every process is started: the clients are still importing torch, the point where
        # a child is easiest to leave behind (and the same loop the demo follows rounds in).
        for line in demo.stdout:
            seen.append(line)
            if line.startswith("waiting for 2 clients"):
                break
            # A demo that never says so would run its 200 rounds: fail at its first instead.
            assert not line.startswith("round "), "".join(seen)
        started = [ln for ln in seen if "pid" in ln]
        pids = [int(p) for ln in started for p in re.findall(r"pid (\d+)", ln)]
        # the broker (mosquitto is a child; the embedded one lives in the demo), a coordinator
        # and two clients
        assert len(pids) >= 3, "".join(seen)
        assert all(_alive(p) for p in pids)

        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        demo.kill()

    assert demo.returncode == 130, "".join(seen) + rest
    assert "interrupted: every process the demo started has been stopped" in rest
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
