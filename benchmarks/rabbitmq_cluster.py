"""A RabbitMQ cluster of `n` nodes on this machine, each with its MQTT listener, for the
broker-cluster benchmark (and whoever wants to try the SDK against a cluster).

Debian's `rabbitmq-server` (3.10, `apt-get install rabbitmq-server`; its MQTT plugin speaks 3.1.1
only). Every node runs from /usr/lib/rabbitmq/bin as this user, with its own name, AMQP, MQTT and
distribution ports, data and log folders under one temp dir; one Erlang cookie (`HOME` is the
temp dir) and an epmd of their own (`ERL_EPMD_PORT`, so nothing else on the machine is touched).
Nodes 2..n join node 1 with `rabbitmqctl join_cluster`. `close()` stops every node it started.

    with RabbitCluster(3) as cluster:
        cluster.urls          # ["mqtt://127.0.0.1:PORT", ...], one per node (anonymous: guest)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from coordinator.broker import BrokerStartError, free_port, wait_for_connack

__all__ = ["RABBITMQ_BIN", "RabbitCluster", "rabbitmq_missing"]

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")


def rabbitmq_missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    if not (RABBITMQ_BIN / "rabbitmq-server").is_file():
        return "rabbitmq-server is not installed (apt-get install rabbitmq-server)"
    if not list(Path("/usr/lib/rabbitmq/lib").glob("*/plugins/rabbitmq_mqtt-*")):
        return "rabbitmq-server has no MQTT plugin (rabbitmq_mqtt)"
    return None


class RabbitCluster:
    def __init__(self, n: int = 3) -> None:
        self.n = n
        self._tmp = tempfile.TemporaryDirectory(prefix="edgefl-rabbitmq-")
        self.dir = Path(self._tmp.name)
        self.tag = secrets.token_hex(3)
        self.names = [f"edgefl{self.tag}n{i}@localhost" for i in range(n)]
        self.mqtt_ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "HOME": str(self.dir),
            "ERL_EPMD_PORT": str(free_port()),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
        }
        self.start_s: dict[str, float] = {}

    @property
    def urls(self) -> list[str]:
        return [f"mqtt://127.0.0.1:{p}" for p in self.mqtt_ports]

    def ctl(self, node: int, *args: str, timeout: float = 120) -> str:
        """`rabbitmqctl -n NODE args...`; its output, or BrokerStartError with it."""
        cmd = [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.names[node], *args]
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise BrokerStartError(f"{' '.join(cmd[1:])} failed: {res.stdout}{res.stderr}")
        return res.stdout

    def start(self) -> RabbitCluster:
        why = rabbitmq_missing()
        if why is not None:
            raise BrokerStartError(why)
        cookie = self.dir / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16))
        cookie.chmod(0o600)
        (self.dir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        t0 = time.monotonic()
        for i, name in enumerate(self.names):
            node = self.dir / f"n{i}"
            node.mkdir()
            mqtt_port = free_port()
            self.mqtt_ports.append(mqtt_port)
            (node / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = 127.0.0.1:{free_port()}\n"
                f"mqtt.listeners.tcp.default = 127.0.0.1:{mqtt_port}\n"
                "mqtt.allow_anonymous = true\n"
            )
            env = {
                **self.env,
                "RABBITMQ_NODENAME": name,
                "RABBITMQ_DIST_PORT": str(free_port()),
                "RABBITMQ_CONFIG_FILE": str(node / "rabbitmq.conf"),
                "RABBITMQ_MNESIA_BASE": str(node / "mnesia"),
                "RABBITMQ_LOG_BASE": str(node / "log"),
                "RABBITMQ_PID_FILE": str(node / "pid"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(node / "advanced.config"),
            }
            log = (node / "out.log").open("wb")
            self.procs.append(
                subprocess.Popen(
                    [str(RABBITMQ_BIN / "rabbitmq-server")],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its Erlang children go with it on close()
                )
            )
        try:
            for i in range(self.n):
                # `wait` first waits for the node's pid file, then for the node to be booted.
                pid = str(self.dir / f"n{i}" / "pid")
                self.ctl(i, "wait", pid, "--timeout", "120", timeout=150)
            self.start_s["nodes"] = time.monotonic() - t0
            for i in range(1, self.n):
                self.ctl(i, "stop_app")
                self.ctl(i, "join_cluster", self.names[0])
                self.ctl(i, "start_app")
            for port in self.mqtt_ports:
                wait_for_connack("127.0.0.1", port, timeout=60)
        except Exception as exc:
            logs = "".join(
                f"\n--- node {i}:\n"
                + "".join(p.read_text()[-1500:] for p in (self.dir / f"n{i}").glob("log/*.log"))
                for i in range(self.n)
            )
            self.close()
            raise BrokerStartError(f"the RabbitMQ cluster did not start: {exc}{logs}") from exc
        self.start_s["cluster"] = time.monotonic() - t0
        return self

    def running_nodes(self) -> list[str]:
        """The nodes node 0 sees running in its cluster."""
        out = self.ctl(0, "cluster_status", "--formatter", "json")
        import json

        return sorted(json.loads(out)["running_nodes"])

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                with contextlib.suppress(BrokerStartError, subprocess.TimeoutExpired):
                    self.ctl(i, "stop", timeout=60)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        # epmd, started by the first node on our own port, outlives the nodes: stop it too.
        epmd = shutil.which("epmd") or "/usr/lib/erlang/bin/epmd"
        subprocess.run(
            [epmd, "-port", self.env["ERL_EPMD_PORT"], "-kill"],
            env=self.env,
            capture_output=True,
            timeout=10,
            check=False,
        )
        self.procs = []
        self._tmp.cleanup()

    def __enter__(self) -> RabbitCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
