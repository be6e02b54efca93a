"""MQTT transport over paho-mqtt 2.x: the same contract as the in-memory one, over a real broker.

- MQTT 5 by default; 3.1.1 when the broker refuses v5 (amqtt does). QoS 1 everywhere.
- Persistent sessions: `clean_start=False` with a session expiry (v5), `clean_session=False`
  (3.1.1), so a client that drops and reconnects receives what was queued for it meanwhile.
- Reconnects on its own with exponential backoff and jitter, and re-subscribes after each
  connect. A will (`set_will`) marks the client offline when the connection dies.
- paho's in-flight window is raised (default 100, paho's is 20) for chunk streams.
- Broker URLs `mqtt://host:port` and `mqtts://host:port` (TLS, the server's certificate verified
  by default), optionally with `user@` or `user:password@` (the password better comes from
  `BrokerSettings.password`/`password_file`, which settings fill from the environment).
- MQTT 5 reason codes on PUBACK surface from `Delivery.wait()` as typed errors (135 →
  `NotAuthorized`); 16 "no matching subscribers" counts as success. Payloads over the limit are
  refused before publishing, and inbound ones over it are dropped (the broker is also told the
  maximum packet size we accept).
- paho's network thread (ours: one per transport) only hands payloads on: it calls the
  subscribers' callbacks, which only enqueue (an `Endpoint` checks and decodes on its consumer's
  thread) and must not block.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edge_sdk.topics import topic_matches
from edge_sdk.transport.base import (
    Callback,
    ConnectError,
    Delivery,
    DeliveryTimeout,
    NotAuthorized,
    PublishRejected,
    Transport,
    TransportError,
    TransportStats,
    WillPayload,
)
from edge_sdk.transport.settings import BrokerAddress, BrokerSettings, parse_broker_url

__all__ = ["BrokerAddress", "BrokerSettings", "MqttTransport", "parse_broker_url"]

log = logging.getLogger(__name__)

_UNSUPPORTED_PROTOCOL = 132  # CONNACK reason: the broker does not speak MQTT 5
_AUTH_FAILURES = {134, 135}  # bad user name or password, not authorized (v5 and mapped v3 codes)
_NOT_AUTHORIZED = 135
_CONNACK_GRACE_S = 5.0  # how long a broker that took the connection has to answer it
_PROTOCOLS: dict[tuple[str, int], str] = {}  # what each broker address answered to MQTT 5


class _JitterClient(mqtt.Client):
    """paho's client, whose reconnect backoff gets ±50% jitter per attempt (paho's has none),
    so a fleet that lost its broker does not come back in lockstep."""

    backoff_min = 0.5
    backoff_max = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backoff = 0.0
        self.stop_waiting = threading.Event()

    def _reconnect_wait(self) -> None:  # called by paho's loop between reconnect attempts
        self.backoff = min(self.backoff * 2, self.backoff_max) if self.backoff else self.backoff_min
        self.stop_waiting.wait(self.backoff * random.uniform(0.5, 1.5))


class MqttTransport(Transport):
    """One MQTT connection with its own network thread. `client_id` names the broker session:
    reuse it to resume a session (and what was queued in it), keep it unique per participant."""

    def __init__(self, broker: BrokerSettings | str, client_id: str) -> None:
        self.settings = broker if isinstance(broker, BrokerSettings) else BrokerSettings(url=broker)
        if self.settings.url is None:
            raise ValueError("no broker URL: set --broker mqtt://host:port (or broker.url)")
        self.address = parse_broker_url(self.settings.url)
        self.client_id = client_id
        self.max_payload_bytes = self.settings.max_payload_bytes
        self.stats = TransportStats()
        self.protocol_version = "3.1.1" if self.settings.protocol == "3.1.1" else "5"
        self._subs: dict[str, Callback] = {}
        self._lock = threading.Lock()  # subscriptions and ack bookkeeping; never held into paho
        self._pending: dict[int, Delivery] = {}
        self._early: dict[int, tuple[int, str] | None] = {}  # acks that beat their registration
        self._subacks: dict[int, threading.Event] = {}
        self._early_subacks: set[int] = set()
        self._will: tuple[str, WillPayload, bool] | None = None
        self._connected = threading.Event()
        self._refused: ConnectError | None = None
        self._ever_connected = False
        self._numbered = False  # the next connection already has its number
        self._fallback = threading.Event()
        self._running = False  # paho's network thread is up
        self._closed = False
        self._client = self._new_client()

    # -- paho client -------------------------------------------------------------------------
    def _new_client(self, *, probe: bool = False) -> _JitterClient:
        v5 = probe or self.protocol_version == "5"
        client = _JitterClient(
            CallbackAPIVersion.VERSION2,
            client_id=f"{self.client_id}-probe" if probe else self.client_id,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else False,
        )
        client.backoff_min = self.settings.reconnect_min_s
        client.backoff_max = self.settings.reconnect_max_s
        client.max_inflight_messages_set(self.settings.max_inflight)
        client.max_queued_messages_set(0)  # unlimited: QoS 1 messages queue while offline
        user = self.settings.username or self.address.username
        if user is not None and not probe:  # the probe stays bare: amqtt chokes otherwise
            client.username_pw_set(user, self.settings.resolved_password())
        if self.address.tls:
            s = self.settings
            client.tls_set(
                ca_certs=str(s.ca_file) if s.ca_file else None,
                certfile=str(s.cert_file) if s.cert_file else None,
                keyfile=str(s.key_file) if s.key_file else None,
                cert_reqs=ssl.CERT_REQUIRED,
            )
        if probe:
            return client
        self._apply_will(client)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_suback
        client.on_unsubscribe = self._on_suback
        return client

    def _open_socket(self) -> None:
        """TCP (+TLS) connect and send CONNECT; the CONNACK arrives on the network thread."""
        props = None
        if self.protocol_version == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.settings.session_expiry_s
            props.MaximumPacketSize = self.max_payload_bytes + 64 * 1024  # + topic and headers
        self._client.connect(
            self.address.host,
            self.address.port,
            keepalive=self.settings.keepalive_s,
            clean_start=False if self.protocol_version == "5" else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
            properties=props,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def set_will(self, topic: str, payload: WillPayload, *, retain: bool = False) -> None:
        self._will = (topic, payload, retain)
        self._apply_will(self._client)
        if self._running:
            log.warning("%s: the new will applies from the next connection", self.client_id)

    def _apply_will(self, client: mqtt.Client) -> None:
        """Give paho the will of the connection about to be made (numbered `connection`)."""
        if self._will is None:
            return
        topic, payload, retain = self._will
        data = payload(self.connection) if callable(payload) else bytes(payload)
        self._check_size(data)
        client.will_set(topic, data, qos=1, retain=retain)

    def _next_connection(self) -> None:
        """Number the next connection (once per lost one) and give it its own will."""
        if self._ever_connected and not self._numbered:
            self.connection += 1
            self._numbered = True
            self._apply_will(self._client)

    def connect(self, timeout: float | None = None) -> MqttTransport:
        """Connect and wait for the broker's CONNACK; retries with backoff until `timeout`
        (default `settings.connect_timeout_s`). Raises `ConnectError` when the broker stays
        unreachable, refuses us (bad credentials) or fails TLS verification."""
        if self._closed:
            raise ConnectError("transport is closed")
        if self._running:
            return self
        self._next_connection()
        limit = self.settings.connect_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = self.settings.reconnect_min_s
        if self.settings.protocol == "auto" and not self._ever_connected:
            version = self._probe_protocol(deadline, delay)
            if version != self.protocol_version:
                log.info("%s: the broker does not speak MQTT 5; using 3.1.1", self.client_id)
                self.protocol_version = version
                self._client = self._new_client()
        while True:
            self._refused = None
            self._fallback.clear()
            self._open_until(deadline, delay)
            # A broker reached just before the deadline still gets its time to answer.
            answer_by = max(deadline, time.monotonic() + _CONNACK_GRACE_S)
            self._client.loop_start()
            self._running = True
            while not self._connected.wait(0.02):
                if self._refused is not None or self._fallback.is_set():
                    break
                if time.monotonic() > answer_by:
                    self._halt()
                    raise ConnectError(
                        f"{self.client_id}: no CONNACK from {self.url_for_logs} within {limit} s"
                    )
            if self._connected.is_set():
                return self
            self._halt()
            if self._refused is not None:
                raise self._refused
            # The broker refused MQTT 5 (amqtt): the same session, over 3.1.1.
            log.info("%s: the broker refused MQTT 5; using 3.1.1", self.client_id)
            self.protocol_version = "3.1.1"
            self._client = self._new_client()

    def _probe_protocol(self, deadline: float, delay: float) -> str:
        """ "5" or "3.1.1": what the broker answers to a bare MQTT 5 CONNECT.

        A throwaway connection (its own client id, no credentials, no session): amqtt answers
        a bare v5 CONNECT with reason 132 but hangs on one that carries a user name or the
        session-expiry property our real CONNECT needs, so ask first. A broker that closes the
        connection without answering (RabbitMQ 3.x's MQTT plugin) speaks 3.1.1 only too. An
        answer is cached per address.
        """
        key = (self.address.host, self.address.port)
        if key in _PROTOCOLS:
            return _PROTOCOLS[key]
        answer: list[int] = []
        probe = self._new_client(probe=True)
        probe.on_connect = lambda c, u, f, reason, p: answer.append(_code(reason))
        self._open_until(deadline, delay, client=probe)
        try:
            end = time.monotonic() + _CONNACK_GRACE_S  # a broker reached has this to answer
            closed = False
            while not answer and time.monotonic() < end:
                closed = probe.loop(0.05) != mqtt.MQTT_ERR_SUCCESS
                if closed:
                    break
            if answer and answer[0] == 0:
                probe.disconnect()
        finally:
            sock = probe.socket()
            if sock is not None:
                sock.close()
        if closed and not answer:  # hung up on MQTT 5 without a word: not cached (a glitch?)
            return "3.1.1"
        version = "3.1.1" if answer and answer[0] == _UNSUPPORTED_PROTOCOL else "5"
        if answer:
            _PROTOCOLS[key] = version
        return version

    def _open_until(self, deadline: float, delay: float, client: mqtt.Client | None = None) -> None:
        while True:
            try:
                if client is None:
                    self._open_socket()
                else:
                    client.connect(self.address.host, self.address.port, keepalive=10)
                return
            except ssl.SSLError as exc:  # certificate problems do not heal by retrying
                raise ConnectError(f"TLS with {self.url_for_logs} failed: {exc}") from exc
            except (OSError, ValueError) as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectError(self._unreachable(exc)) from exc
                # A device may boot before its broker: say so, and keep trying until the limit.
                wait = min(delay * random.uniform(0.5, 1.5), left)
                log.warning(
                    "%s: the broker at %s is not reachable yet (%s); retrying in %.1f s, for "
                    "%.0f s more (broker.connect_timeout_s)",
                    self.client_id,
                    self.url_for_logs,
                    exc,
                    wait,
                    left,
                )
                time.sleep(wait)
                delay = min(delay * 2, self.settings.reconnect_max_s)

    def _unreachable(self, exc: BaseException) -> str:
        """Why no connection was made, and how to get a broker there."""
        a = self.address
        start = (
            f"start one there, e.g. `mosquitto -p {a.port}` (Debian: apt-get install mosquitto)"
            if a.host in ("127.0.0.1", "localhost", "::1")
            else "start it, or check the host name and port"
        )
        return (
            f"{self.client_id}: cannot reach the broker at {self.url_for_logs}: {exc} (it kept "
            "trying for broker.connect_timeout_s). Is an MQTT broker running there? "
            f"{start}; `edgefl demo --keep-broker` runs one to try the SDK against"
        )

    @property
    def url_for_logs(self) -> str:
        """The broker URL without its password."""
        a = self.address
        user = f"{a.username}@" if a.username else ""
        return f"{'mqtts' if a.tls else 'mqtt'}://{user}{a.host}:{a.port}"

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def disconnect(self) -> None:
        """Leave cleanly (no will); the broker keeps the session for `session_expiry_s`."""
        if self._running:
            self._client.disconnect()
            self._halt()

    def abort(self) -> None:
        """Drop the TCP connection without DISCONNECT, as a crash would: the will fires."""
        if self._running:
            sock = self._client.socket()
            self._halt()
            if sock is not None:
                sock.close()

    def close(self) -> None:
        """Leave cleanly and end the session (nothing more is queued for us)."""
        if self._running:
            props = None
            if self.protocol_version == "5":
                props = Properties(PacketTypes.DISCONNECT)
                props.SessionExpiryInterval = 0
            was_connected = self._connected.is_set()
            self._client.disconnect(properties=props)
            # paho's network thread writes the DISCONNECT, then reports it (on_disconnect clears
            # `_connected`); stopping the thread earlier can close the socket before the packet
            # leaves, and the broker then publishes our will although we left cleanly.
            deadline = time.monotonic() + 5.0
            while was_connected and self._connected.is_set() and time.monotonic() < deadline:
                time.sleep(0.005)
            self._halt()
        self._closed = True

    def _halt(self) -> None:
        """Stop paho's network thread (it exits after a DISCONNECT or when told to)."""
        self._client.stop_waiting.set()
        self._client.loop_stop()
        self._client.stop_waiting.clear()
        self._running = False
        self._connected.clear()

    # -- paho callbacks (network thread) ------------------------------------------------------
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        code = _code(reason)
        if code == 0:
            again, self._ever_connected = self._ever_connected, True
            self._numbered = False
            client.backoff = 0.0
            with self._lock:
                filters = list(self._subs)
            if filters:  # re-subscribe: the broker may have lost our session
                client.subscribe([(f, 1) for f in filters])
            self._connected.set()
            log.debug("%s: connected (MQTT %s)", self.client_id, self.protocol_version)
            if again and self.on_reconnect is not None:
                self.on_reconnect()
        elif code == _UNSUPPORTED_PROTOCOL and self.protocol_version == "5":
            if self.settings.protocol == "auto":
                self._fallback.set()
            else:
                self._refused = ConnectError(f"the broker does not speak MQTT 5: {reason}")
        else:
            what = "our credentials" if code in _AUTH_FAILURES or code in (4, 5) else "us"
            self._refused = ConnectError(f"the broker refused {what}: {reason} ({code})")
            log.error("%s: %s", self.client_id, self._refused)

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        was = self._connected.is_set()
        self._connected.clear()
        self._next_connection()  # before paho's automatic reconnect sends its CONNECT
        if was and _code(reason) != 0:
            log.info("%s: connection lost (%s); reconnecting", self.client_id, reason)

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        topic, payload = msg.topic, bytes(msg.payload)
        if len(payload) > self.max_payload_bytes:
            self.stats.dropped_in += 1
            log.warning("%s: dropped a %d-byte payload on %s", self.client_id, len(payload), topic)
            return
        self.stats.messages_in += 1
        self.stats.bytes_in += len(payload)
        with self._lock:
            targets = [cb for f, cb in self._subs.items() if topic_matches(f, topic)]
        for cb in targets:
            try:
                cb(topic, payload)
            except Exception:  # a subscriber's bug must not kill the network thread
                log.exception("%s: subscriber callback failed on %s", self.client_id, topic)

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        # paho calls this with its message lock held: touch only our own bookkeeping.
        code = _code(reason)
        refusal = (code, str(reason)) if code >= 0x80 else None
        with self._lock:
            delivery = self._pending.pop(mid, None)
            if delivery is None:
                self._early[mid] = refusal
                return
        delivery.resolve(_refusal_error(delivery.topic, refusal))

    # -- contract ------------------------------------------------------------------------------
    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> Delivery:
        if self._closed:
            raise ConnectError("transport is closed")
        self._check_size(payload)
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):  # NO_CONN: queued
            raise TransportError(f"publish on {topic!r} failed: {mqtt.error_string(info.rc)}")
        self.stats.messages_out += 1
        self.stats.bytes_out += len(payload)
        delivery = Delivery(topic)
        with self._lock:
            early = info.mid in self._early
            refusal = self._early.pop(info.mid, None)
            if not early:
                self._pending[info.mid] = delivery
        if early:
            delivery.resolve(_refusal_error(topic, refusal))
        return delivery

    def subscribe(self, topic_filter: str, callback: Callback) -> None:
        """Subscribe and, when connected, wait for the SUBACK: what anyone publishes after
        this returns reaches `callback`."""
        if self._closed:
            raise ConnectError("transport is closed")
        with self._lock:
            self._check_overlap(self._subs, topic_filter)
            self._subs[topic_filter] = callback
        if self._connected.is_set():
            rc, mid = self._client.subscribe(topic_filter, qos=1)
            self._await_ack(rc, mid, f"subscribe to {topic_filter!r}")

    def unsubscribe(self, topic_filter: str) -> None:
        with self._lock:
            known = self._subs.pop(topic_filter, None) is not None
        if known and self._connected.is_set():
            rc, mid = self._client.unsubscribe(topic_filter)
            self._await_ack(rc, mid, f"unsubscribe from {topic_filter!r}")

    def _await_ack(self, rc: int, mid: int | None, what: str) -> None:
        if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
            log.info("%s: %s is queued until we reconnect (%s)", self.client_id, what, rc)
            return
        done = threading.Event()
        with self._lock:
            if mid in self._early_subacks:
                self._early_subacks.discard(mid)
                return
            self._subacks[mid] = done
        if not done.wait(self.settings.ack_timeout_s):
            with self._lock:
                self._subacks.pop(mid, None)
            raise DeliveryTimeout(f"{self.client_id}: no acknowledgement to {what}")

    def _on_suback(self, client: Any, userdata: Any, mid: int, *rest: Any) -> None:
        with self._lock:
            done = self._subacks.pop(mid, None)
            if done is None:
                self._early_subacks.add(mid)
        if done is not None:
            done.set()


def _refusal_error(topic: str, refusal: tuple[int, str] | None) -> TransportError | None:
    if refusal is None:
        return None
    code, reason = refusal
    cls = NotAuthorized if code == _NOT_AUTHORIZED else PublishRejected
    return cls(topic, code, reason)


def _code(reason: Any) -> int:
    if isinstance(reason, ReasonCode):
        return int(reason.value)
    return int(reason)
