"""Brokers the SDK can start for you: mosquitto as a child process, or amqtt in this process.

Production points the SDK at any MQTT 3.1.1/5 broker by URL. These two exist for the demo, the
tests and the benchmarks: `MosquittoBroker` (Debian's `mosquitto`, MQTT 5, ACLs, persistence)
and `EmbeddedBroker` (amqtt, pure Python, MQTT 3.1.1 only, when mosquitto is not installed).
Both bind 127.0.0.1 on a free port and are ready only once a real CONNACK came back.
`bridge_config` writes the section that bridges a site mosquitto to a central broker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

__all__ = [
    "BrokerStartError",
    "EmbeddedBroker",
    "MosquittoBroker",
    "bridge_config",
    "free_port",
    "mosquitto_path",
    "start_broker",
    "wait_for_connack",
]

log = logging.getLogger(__name__)


class BrokerStartError(RuntimeError):
    """The broker did not start (not installed, bad config, no free port)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mosquitto_path() -> str | None:
    """The mosquitto binary (PATH, then Debian's /usr/sbin), or None when not installed."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


def bridge_config(
    name: str,
    central: str,
    topics: str | Sequence[str] = "edgefl/#",
    *,
    username: str | None = None,
    password: str | None = None,
    cafile: str | Path | None = None,
) -> str:
    """The `connection` section that bridges a site mosquitto to the `central` broker
    ("host:port"), for the site broker's config (`MosquittoBroker(extra_config=...)` appends it).

    Each topic pattern (default: every run's, `edgefl/#`) is carried both ways at QoS 1. The
    bridge speaks MQTT 5, whose subscription options keep a message's retained flag as published
    (so the status, archive and peer publications stay retained on every site: a reader that
    subscribes later still gets them) and keep a site's own messages from coming back to it.
    Its session on the central broker is persistent, so what is published while the link is down
    is delivered when it comes back. A client's will is a message like any other: the site
    broker publishes it and the bridge forwards it. `username`/`password` log the bridge into
    the central broker; `cafile` makes the link TLS.
    """
    lines = [
        f"connection {name}",
        f"address {central}",
        "bridge_protocol_version mqttv50",
        "cleansession false",
        "restart_timeout 1 10",
    ]
    lines += [f"topic {t} both 1" for t in ([topics] if isinstance(topics, str) else topics)]
    if username is not None:
        lines.append(f"remote_username {username}")
        if password is not None:
            lines.append(f"remote_password {password}")
    if cafile is not None:
        lines.append(f"bridge_cafile {cafile}")
    return "\n".join(lines) + "\n"


def wait_for_connack(host: str, port: int, timeout: float = 10.0) -> None:
    """Block until a broker at host:port answers CONNECT with a CONNACK (any answer: it is
    up and speaking MQTT; an open TCP port alone is not enough)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        answered: list[object] = []
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        client.on_connect = lambda c, u, f, reason, p, out=answered: out.append(reason)
        try:
            client.connect(host, port, keepalive=10)
            start = time.monotonic()
            while not answered and time.monotonic() - start < 2:
                if client.loop(0.05) != mqtt.MQTT_ERR_SUCCESS:
                    break
            if answered:
                client.disconnect()
                return
        except OSError as exc:
            last = exc
        finally:
            sock = client.socket()
            if sock is not None:
                sock.close()
        time.sleep(0.02)
    raise BrokerStartError(f"no CONNACK from {host}:{port} within {timeout} s ({last})")


class MosquittoBroker:
    """mosquitto as a child process on 127.0.0.1 (a free port unless `port` is given).

    `extra_config` lines are appended to the generated config (password_file, acl_file,
    TLS listeners...). With `persistence=True` queued and retained messages survive `restart()`.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_config: str = "",
        persistence: bool = False,
        workdir: str | Path | None = None,
        anonymous: bool = True,
    ) -> None:
        exe = mosquitto_path()
        if exe is None:
            raise BrokerStartError("mosquitto is not installed (apt-get install mosquitto)")
        self.exe = exe
        self.port = port
        self.extra_config = extra_config
        self.persistence = persistence
        self.anonymous = anonymous
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="edgefl-mosquitto-")
        self.workdir = Path(workdir) if workdir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def _write_config(self) -> Path:
        lines = [
            f"listener {self.port} 127.0.0.1",
            f"allow_anonymous {'true' if self.anonymous else 'false'}",
            "user root" if os.geteuid() == 0 else "",  # keep access to our temp files
            "max_inflight_messages 100",
            "max_queued_messages 100000",
            "max_queued_bytes 0",
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {self.workdir}/",
            "autosave_interval 1",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            self.extra_config,
        ]
        path = self.workdir / "mosquitto.conf"
        path.write_text("\n".join(line for line in lines if line) + "\n")
        return path

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        fixed = self.port is not None
        for _ in range(1 if fixed else 5):  # another process may grab a free port first
            if not fixed:
                self.port = free_port()
            conf = self._write_config()
            self.proc = subprocess.Popen(
                [self.exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            try:
                self._wait_ready(timeout)
                return self
            except BrokerStartError as exc:
                err = self._reap()
                if "Address already in use" not in err and self.proc is not None:
                    raise BrokerStartError(f"mosquitto did not start: {exc}; {err}") from exc
        raise BrokerStartError(f"mosquitto found no free port (last tried {self.port})")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None and self.port is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerStartError(f"mosquitto exited with {self.proc.returncode}")
            try:
                wait_for_connack("127.0.0.1", self.port, timeout=0.5)
                return
            except BrokerStartError:
                continue
        raise BrokerStartError(f"mosquitto on port {self.port} not ready within {timeout} s")

    def _reap(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate(timeout=10)
        text = (err or b"").decode(errors="replace")
        if self.log_path.exists():
            text += self.log_path.read_text(errors="replace")[-2000:]
        self.proc = None
        return text

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not go (persistence is saved on SIGTERM)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop and start again on the same port (what a broker upgrade or crash looks like)."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SnapshotDict(dict[str, Any]):
    """A dict whose iteration walks a snapshot of its keys and items.

    amqtt 0.12 awaits inside loops over its subscription table (`_handle_client_session`,
    `_run_broadcast`); a subscribe or a session ending meanwhile changed the table under the
    loop, raising "dictionary changed size during iteration" and leaving that connection dead.
    """

    def __iter__(self) -> Iterator[str]:
        return iter(list(dict.keys(self)))

    def items(self) -> Any:
        return list(dict.items(self))


class EmbeddedBroker:
    """amqtt's MQTT 3.1.1 broker on its own asyncio loop in a daemon thread of this process.

    Clients must send a user name (any; no password): `url` includes one.
    """

    USER = "edgefl"

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.USER}@127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        from amqtt.broker import Broker  # optional at import time: only the demo and tests use it

        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="amqtt", daemon=True)
        self._thread.start()
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
            "timeout_disconnect_delay": 0,
            "session_expiry_interval": 3600,
            # amqtt keeps no offline queue for anonymous sessions: ask for a user name (any;
            # `url` carries one) so persistent sessions work as on any other broker.
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False}
            },
        }

        async def start() -> Any:
            broker = Broker(config, loop=loop)
            broker._subscriptions = _SnapshotDict()
            await broker.start()
            return broker

        try:
            self._broker = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout)
        except Exception as exc:
            self.stop()
            raise BrokerStartError(f"amqtt did not start: {exc}") from exc
        server = self._broker._servers["default"].instance  # the real port when bound to 0
        self.port = int(server.sockets[0].getsockname()[1])
        wait_for_connack("127.0.0.1", self.port, timeout)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._broker is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), loop).result(10)
            except Exception:
                log.debug("amqtt shutdown failed", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()
        self._loop = self._thread = self._broker = None

    close = stop

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_broker(prefer: str = "mosquitto") -> MosquittoBroker | EmbeddedBroker:
    """mosquitto when installed (and preferred), else the embedded amqtt broker; started."""
    if prefer == "mosquitto" and mosquitto_path() is not None:
        return MosquittoBroker().start()
    return EmbeddedBroker().start()
