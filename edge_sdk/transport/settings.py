"""How to reach a broker (`BrokerSettings`, broker URLs), without loading paho: the run config
and the command line's help read these settings, and only a transport that connects needs the
MQTT client (`edge_sdk.transport.mqtt`, which re-exports them)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from edge_sdk.transport.base import ConnectError

__all__ = ["BrokerAddress", "BrokerSettings", "parse_broker_url"]


class BrokerSettings(BaseModel):
    """How to reach and talk to a broker. Secrets: `password` (from the environment, e.g.
    EDGEFL_BROKER__PASSWORD) or `password_file`; never put them on a command line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = None  # mqtt[s]://[user@]host[:port]; None: no broker (simulate in memory)
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    ca_file: Path | None = None  # CA bundle that signed the broker's certificate (default: system)
    cert_file: Path | None = None  # client certificate, when the broker asks for one
    key_file: Path | None = None
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    keepalive_s: int = Field(30, ge=5)
    session_expiry_s: int = Field(3600, ge=0)  # how long the broker keeps our queue while offline
    connect_timeout_s: float = Field(30.0, gt=0)
    ack_timeout_s: float = Field(120.0, gt=0)  # waiting for PUBACKs of one message and its blobs
    max_inflight: int = Field(100, ge=1)
    max_payload_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    reconnect_min_s: float = Field(0.5, gt=0)
    reconnect_max_s: float = Field(30.0, gt=0)
    # The edgefl commands tune glibc's allocator for chunk streams (edge_sdk.malloc); an app
    # that embeds MqttTransport decides for itself. False: leave the allocator alone.
    tune_malloc: bool = True

    def resolved_password(self) -> str | None:
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is not None:
            try:
                return self.password_file.read_text().rstrip("\r\n")
            except OSError as exc:
                raise ConnectError(f"cannot read the broker password file: {exc}") from exc
        return parse_broker_url(self.url).password if self.url else None


class BrokerAddress(BaseModel):
    model_config = ConfigDict(frozen=True)

    tls: bool
    host: str
    port: int
    username: str | None = None
    password: str | None = None


def parse_broker_url(url: str) -> BrokerAddress:
    """`mqtt[s]://[user[:password]@]host[:port]` → address (ports default to 1883 / 8883)."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise ValueError(f"broker URL {url!r} must start with mqtt:// or mqtts://")
    if not parts.hostname:
        raise ValueError(f"broker URL {url!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"broker URL {url!r} must be mqtt[s]://[user[:password]@]host[:port]")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError as exc:
        raise ValueError(f"broker URL {url!r}: {exc}") from exc
    return BrokerAddress(
        tls=tls,
        host=parts.hostname,
        port=port,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )
