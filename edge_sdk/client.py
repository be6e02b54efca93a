"""EdgeClient: the runtime a client app embeds — a transport, a serve loop and registration
around one `ClientNode` (edge_sdk.node), which owns the algorithm, its persistence and export.

It connects through a Transport, registers its ArchSpec and capabilities, then serves tasks on
its own worker thread: decode and validate the models, run the task on its node, reply with the
models it produced. A task it cannot run gets an error reply; the client logs it and keeps
serving. The network callback only enqueues (see `edge_sdk.wire`).

It listens on its own down topic, the run's broadcast topic (models many tasks share) and the
coordinator's retained status topic; it publishes only on its own up topic (see
`edge_sdk.topics`). Its will announces it offline if the connection dies; a client that stops
says so before it leaves.

With a `keyring` (edge_sdk.auth) it signs everything it sends and obeys only what the run's
coordinator signed. It registers with the coordinator incarnation the status topic names, as one
process (its `session`): a task is run only once that registration was accepted, and a
registration refused (the run started without it, another architecture, a newer process of the
same id took over) ends `run()` with `RegistrationRefused`. A task delivered again (the
coordinator re-sends outstanding tasks after a reconnection) gets its reply again. Tasks, answers
and shutdowns count only from the incarnation it registered with, so nothing recorded in an
earlier run (same run id, same keys) counts in this one; a "finished" status seen before it
registered ends it only when no newer status follows within FINISHED_GRACE_S. Where it stands
is one explicit state machine, `registration` (edge_sdk.registration: WAITING, REGISTERING,
DOUBTING, ACCEPTED, REFUSED, FINISHED, and the table of moves between them).

With a `state_dir` it persists its whole algorithm state (atomically) after every task that
changed it, and a restarted client (same id, same run) continues from there; its record of the
signed messages it has seen (`ReplayGuard`) lives there too. A fit task for a
round it already trained (the coordinator restarted, or retried the round) starts from the state
it had before that round, so a repeated round trains exactly what the first attempt trained.

    node = ClientNode("phone7", spec, data, run_id="fl-1")  # the app's training core
    client = EdgeClient(node, "mqtt://broker:1883", keyring=keyring)  # ... on the network
    client.run()             # blocks until the federation ends; or start() ... stop()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge_sdk import topics
from edge_sdk.algorithms import ClientAlgorithm, FitResult
from edge_sdk.auth import Keyring, ReplayGuard
from edge_sdk.client_data import ClientData
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES
from edge_sdk.ids import unique_id
from edge_sdk.node import ClientNode
from edge_sdk.outcomes import Deployed, FinalMetrics, RegistrationRefused, TaskOutcome
from edge_sdk.peers import PeerChannel
from edge_sdk.protocol import Archive, Reply, Status
from edge_sdk.registration import Event, Registration, State
from edge_sdk.retained import read_retained
from edge_sdk.serving import INITIAL_PENDING_BYTES, REGISTER_RETRY_S, Serving
from edge_sdk.transport.base import Transport
from edge_sdk.transport.settings import BrokerSettings
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec

# (the app's outcomes, edge_sdk.outcomes, are imported from here too)
__all__ = ["Deployed", "EdgeClient", "FinalMetrics", "RegistrationRefused", "TaskOutcome"]

log = logging.getLogger(__name__)

_SEEN_TASKS = 256  # task ids remembered to ignore QoS 1 redeliveries


class EdgeClient(Serving):
    """One client: a `ClientNode` (its id, architecture, private data, and the algorithm state it
    accumulates; where it exports, persists and what it may deploy are the node's arguments)
    served over a transport: the runtime a client app embeds, which owns the connection.

    `transport`: a `Transport`, used as given (whoever made it closes it); or a broker, as a URL
    or a `BrokerSettings`: the client then makes its own `MqttTransport`, named after the run and
    the client (a restarted client resumes its MQTT session and receives what was queued for it
    meanwhile), and leaves it when it stops.
    `keyring`: signs what the client sends and checks what its coordinator signed (edge_sdk.auth;
    None: open mode, which a client connecting to a broker is warned about).
    `on_task`: called on the worker thread after every task (a per-round progress hook).
    `fp16_upload`: send models as float16. `max_blob_bytes`: the largest model it sends or
    accepts. After the run, `deployed` says what it deployed and why.

        node = ClientNode("phone7", spec, data, run_id="fl-1", onnx_path="phone7.onnx")
        client = EdgeClient(node, "mqtt://broker:1883", keyring=keyring)
    """

    def __init__(
        self,
        node: ClientNode,
        transport: Transport | str | BrokerSettings,
        *,
        keyring: Keyring | None = None,
        on_task: Callable[[TaskOutcome], None] | None = None,
        fp16_upload: bool = False,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    ) -> None:
        if keyring is not None and keyring.me != node.client_id:
            raise ValueError(f"{node.client_id}: the keyring given is {keyring.me!r}'s")
        owns_transport = False  # a Transport given: whoever made it closes it
        if isinstance(transport, str | BrokerSettings):  # a broker: a connection of its own
            from edge_sdk.transport.mqtt import MqttTransport  # (loads paho: only when asked)

            if keyring is None:
                log.warning(
                    "%s: no keyring: its messages go unsigned (open mode), and a coordinator "
                    "that checks signatures drops them; pass keyring=Keyring.load(...) "
                    "(edge_sdk.auth)",
                    node.client_id,
                )
            # Named after the run and the client: a restarted client resumes the session (and
            # receives what was queued for it while it was away).
            transport = MqttTransport(transport, f"edgefl-{node.run_id}-{node.client_id}")
            owns_transport = True
        self.node = node
        self.keyring = keyring
        self.session = unique_id(64)  # this process, as the coordinator tells them apart
        self.client_id, self.run_id = node.client_id, node.run_id
        self.fp16_upload = fp16_upload
        self.max_blob_bytes = max_blob_bytes
        self.on_task = on_task
        self.transport = transport
        self._owns_transport = owns_transport
        run_id, client_id = self.run_id, self.client_id
        self._up = topics.up(run_id, client_id)
        self._down = topics.down(run_id, client_id)
        self._status_topic = topics.status(run_id)
        state = node.state_path
        self.endpoint = Endpoint(
            transport,
            [self._down, topics.bcast(run_id), self._status_topic],
            shared_topic=topics.bcast(run_id),
            max_blob_bytes=max_blob_bytes,
            max_pending_bytes=INITIAL_PENDING_BYTES,
            keyring=keyring,
            replay=ReplayGuard(state.with_suffix(".replay.json") if state else None),
        )
        self.peers = PeerChannel(
            transport, run_id, client_id, max_blob_bytes=max_blob_bytes, keyring=keyring
        )
        node.peers = self.peers
        self._stop = threading.Event()
        self._back = threading.Event()  # the connection came back: say we are online
        self._back_at = -math.inf  # when it last came back (see serving.REANNOUNCE_S)
        self._epoch_base = time.time_ns() // 1_000_000 * 1000  # a restart starts higher
        self._thread: threading.Thread | None = None
        self._seen: deque[str] = deque(maxlen=_SEEN_TASKS)
        self._register_due = 0.0  # when an unanswered registration is sent again (monotonic)
        self._register_every = REGISTER_RETRY_S  # ... after this long (doubling)
        self._last_reply: tuple[str, Reply, dict[str, bytes]] | None = None  # sent again if asked
        # Where this process stands with the coordinator (edge_sdk.registration).
        self.registration = Registration(self.client_id)
        self.status: Status | None = None  # the coordinator's last retained status
        self.tasks_done = 0
        self.errors: list[str] = []
        self.last_metrics: dict[str, float] = {}
        self.last_details: dict[str, Any] = {}  # of the last task's reply (finalize: the guard's)

    # The registration, as apps and tests read it.
    # What the node holds, for apps and tests that read it from the client.
    @property
    def spec(self) -> ArchSpec:
        return self.node.spec

    @property
    def data(self) -> ClientData:
        return self.node.data

    @property
    def device(self) -> torch.device:
        return self.node.device

    @property
    def algorithm(self) -> ClientAlgorithm | None:
        return self.node.algorithm

    @property
    def exported(self) -> Path | None:
        return self.node.exported

    @property
    def deployed(self) -> Deployed | None:
        """What this client deploys, once the run has ended (None before)."""
        if not self.finished:
            return None
        return Deployed.from_details(self.last_details, self.exported)

    @property
    def state_path(self) -> Path | None:
        return self.node.state_path

    @property
    def resumed_after(self) -> int | None:
        return self.node.resumed_after

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> EdgeClient:
        """Connect, subscribe, register, and serve tasks on a worker thread until the run ends."""
        self.open()
        self._thread = threading.Thread(
            target=self._serve, name=f"edgefl-client-{self.client_id}", daemon=True
        )
        self._thread.start()
        return self

    def open(self) -> EdgeClient:
        """Connect and subscribe, without a serving thread: whoever opens the client serves it,
        calling `step()` with what its endpoint receives (`start()` does both, on a thread of
        its own; the fleet benchmark serves thousands of clients from one thread this way)."""
        if self.node.algorithm is None:
            self.node.restore()
        self.transport.set_will(
            self._up, lambda n: self.endpoint.frame(self._up, self._presence(n, online=False))
        )
        self.transport.on_reconnect = self._reconnected
        self.transport.connect()
        self.endpoint.open()
        self.peers.open()
        self._stop.clear()
        return self

    def run(self, timeout: float | None = None) -> FinalMetrics:
        """Start (if needed) and block until the federation ends. Returns the final metrics (a
        dict) whose `deployed` says which model the client deploys (its architecture, size and
        ONNX file) and why. Raises `RegistrationRefused` when the coordinator refused this
        process."""
        if self._thread is None:
            self.start()
        try:
            if not self.wait(timeout):
                raise TimeoutError(f"{self.client_id}: the federation did not end in {timeout} s")
        finally:
            self.stop()
        if self.refused is not None:
            raise RegistrationRefused(f"{self.client_id}: registration refused: {self.refused}")
        final = FinalMetrics(self.last_metrics)
        final.deployed = self.deployed
        return final

    def join_late(self, timeout: float = 60.0) -> FitResult:
        """Personalize from a finished run's archive, without taking part in it: what the
        coordinator left retained on the archive topic (PersFL: its last global models, thesis
        section 7.1) goes through the algorithm's finalize phase, as it would for a participant,
        and the result is exported to `onnx_path` when one is set."""
        self.transport.connect()
        got = read_retained(
            self.transport,
            topics.archive(self.run_id),
            lambda msg: isinstance(msg, Archive) and msg.sender == topics.COORDINATOR,
            timeout=timeout,
            max_blob_bytes=self.max_blob_bytes,
            keyring=self.keyring,
        )
        if got is None:
            raise TimeoutError(
                f"{self.client_id}: run {self.run_id!r} has published no archive in {timeout} s "
                "(it is not finished, or its algorithm keeps none: PersFL does; or the broker "
                "did not deliver the retained archive: it must deliver retained messages to "
                "wildcard subscriptions and, in a cluster, from every node, which RabbitMQ's "
                "MQTT plugin does not: use mosquitto, EMQX or VerneMQ)"
            )
        archive, models = got
        assert isinstance(archive, Archive)
        result = self.node.join_late(archive.algorithm, archive.config, archive.rounds, models)
        self.registration.fire(Event.JOINED_LATE)
        self.last_metrics = dict(result.metrics)
        self.last_details = dict(result.details)
        return result

    def request_stop(self) -> None:
        """Stop after the task in progress (safe from a signal handler); `run()` then returns."""
        self._stop.set()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop serving (after the task in progress). A client that owns its transport leaves
        the broker cleanly, so no will fires: for good once the run finished, otherwise keeping
        its session, so what the coordinator sends meanwhile waits for its restart."""
        self._stop.set()
        self.endpoint.interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.registration.state is State.ACCEPTED and self.endpoint.is_open:
            # Leaving for now: say so, so that the coordinator stops waiting for our replies.
            self._try_send(self._presence(self.transport.connection, online=False, leaving=True))
        self.endpoint.close()
        self.peers.close()
        self._save_replay_record()
        if self._owns_transport:
            if self.finished:
                self.transport.close()
            else:
                self.transport.disconnect()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the client has shut down; True when it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- export ----------------------------------------------------------------------------
    def export_onnx(self, path: str | Path | None = None) -> Path:
        """Export the personalized model to ONNX (verified against PyTorch)."""
        return self.node.export_onnx(path)
