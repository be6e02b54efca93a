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

    url: str | None = Field(
        None,
        description="the MQTT broker, mqtt[s]://[user@]host[:port] (password: "
        "EDGEFL_BROKER__PASSWORD); none: no broker (simulate: in memory)",
    )
    username: str | None = Field(None, description="the broker user (else the url's)")
    password: SecretStr | None = Field(
        None,
        description="the broker password: only from EDGEFL_BROKER__PASSWORD (or password_file), "
        "never a flag or a config file",
    )
    password_file: Path | None = Field(
        None, description="a file holding the broker password (readable only by you)"
    )
    ca_file: Path | None = Field(
        None,
        description="the CA bundle that signed the broker's certificate; none: the system's",
    )
    cert_file: Path | None = Field(
        None, description="a client certificate, for a broker that asks for one"
    )
    key_file: Path | None = Field(None, description="the client certificate's private key")
    protocol: Literal["auto", "5", "3.1.1"] = Field(
        "auto", description="the MQTT version: auto, 5 or 3.1.1"
    )
    keepalive_s: int = Field(30, ge=5, description="seconds between keepalive pings")
    session_expiry_s: int = Field(
        3600, ge=0, description="seconds the broker keeps this participant's queue while offline"
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds to keep trying to reach the broker, with backoff: a client may "
        "start before its broker (inf: no limit)",
    )
    ack_timeout_s: float = Field(
        120.0,
        gt=0,
        description="seconds to wait for the broker's acknowledgements of one message and its "
        "chunks",
    )
    max_inflight: int = Field(100, ge=1, description="messages sent and not yet acknowledged")
    max_payload_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        description="the largest MQTT payload sent; larger messages go in chunks",
    )
    reconnect_min_s: float = Field(0.5, gt=0, description="the first reconnection's backoff")
    reconnect_max_s: float = Field(30.0, gt=0, description="the longest reconnection backoff")
    # An app that embeds MqttTransport decides for itself.
    tune_malloc: bool = Field(
        True,
        description="the edgefl commands tune glibc's allocator for chunk streams "
        "(edge_sdk.malloc); false: leave the allocator alone",
    )

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
