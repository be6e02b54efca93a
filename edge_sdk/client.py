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
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from edge_sdk import topics
from edge_sdk.algorithms import ClientAlgorithm, FitResult
from edge_sdk.auth import Keyring, ReplayGuard
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, Buffer, WireModel
from edge_sdk.ids import unique_id
from edge_sdk.model_blobs import pack_models, unpack_models
from edge_sdk.node import ClientNode, NodeTask
from edge_sdk.peers import PeerChannel
from edge_sdk.protocol import (
    Archive,
    ModelRef,
    Phase,
    Presence,
    Register,
    Registered,
    Reply,
    Shutdown,
    Status,
    Task,
)
from edge_sdk.registration import Event, Registration, State
from edge_sdk.retained import read_retained
from edge_sdk.trainer import ClientData
from edge_sdk.transport.base import Transport, TransportError
from edge_sdk.transport.settings import BrokerSettings
from edge_sdk.wire import DEFAULT_CHUNK_BYTES, Endpoint, Envelope
from model_zoo import ArchSpec

__all__ = ["Deployed", "EdgeClient", "FinalMetrics", "RegistrationRefused", "TaskOutcome"]

log = logging.getLogger(__name__)

# An unanswered registration is sent again after about REGISTER_RETRY_S, then twice as long
# each time up to REGISTER_RETRY_MAX_S, with ±50% jitter: a coordinator admitting thousands of
# devices at once is not flooded with retries (before, every unanswered device registered again
# every 2 s, and again on every status the coordinator published: at 10,000 devices the
# retries outran what the coordinator could answer).
REGISTER_RETRY_S = 2.0
REGISTER_RETRY_MAX_S = 30.0
# How long an idle client waits for a message before looking at its flags again. stop() and a
# reconnection wake it at once; request_stop() (signal-safe: it only sets a flag) within this.
# Every wake-up costs CPU: with 0.2 s, 200 simulated clients spent ~7 % of a round waking.
IDLE_WAIT_S = 1.0
# For this long after a reconnection, every status the coordinator publishes is answered with our
# presence: one sent before the coordinator itself was back on the broker reached no one (a
# broker restarted without persistence keeps no queue for it), and the coordinator publishes its
# status again once it is back. A repeated presence changes nothing on its side.
REANNOUNCE_S = 60.0
_SEEN_TASKS = 256  # task ids remembered to ignore QoS 1 redeliveries
# A "finished" status seen before registering is believed after this long without a newer one:
# the coordinator of a run that goes on publishes its own again as soon as another replaced it
# on the broker (an old run's, replayed on an open broker; coordinator.fleet.network).
FINISHED_GRACE_S = 6.0
# What reassembly may hold per topic before the coordinator's status says how large the run's
# models are (then twice that, plus a chunk): a flood before it costs at most this much.
INITIAL_PENDING_BYTES = 4 * DEFAULT_CHUNK_BYTES


# Why a client without a keyring stops when its coordinator signs (RegistrationRefused).
_UNSIGNED = (
    "this client has no keyring, but the run's coordinator signs its messages and so drops "
    "unsigned ones: its registration would never be answered. Give it its key: "
    "keyring=Keyring.load(AuthSettings(key_file='{id}.key', roster='roster.json'), '{id}') "
    "(files from `edgefl keys`), or run every participant unsigned (auth.open=true)"
)


class RegistrationRefused(RuntimeError):
    """The coordinator refused this client's registration (the reason is the message)."""


@dataclass(frozen=True)
class TaskOutcome:
    """What a client app's per-round callback receives after each task."""

    round: int
    rounds: int
    phase: Phase
    ok: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # After the finalize task: what the client deployed, and why.
    deployed: Deployed | None = None


@dataclass(frozen=True)
class Deployed:
    """What a client deploys after the run, as its finalize reply said: which model (its
    guard's label, e.g. "personal (final, lenet5)", "distilled (final, mlp)"), its architecture
    ("mixture of mlr+mlp" for several models), its parameters and the size of its weights, its
    own architecture's parameters (the budget's yardstick, edge_sdk.budget), why it was chosen
    (a sentence), a better model its budget refused (`outside_budget`), and its ONNX file."""

    choice: str
    arch: str
    params: int
    kib: float
    own_params: int
    reason: str
    outside_budget: str | None = None
    val_acc: float | None = None  # on the client's validation split (where the guard chose)
    onnx_path: Path | None = None  # None when the client exports no ONNX file

    @classmethod
    def from_details(
        cls, details: Mapping[str, Any], onnx_path: Path | None = None
    ) -> Deployed | None:
        """The record in a finalize reply's details; None where they hold none."""
        if "deployed_arch" not in details:
            return None
        val, outside = details.get("guard_val_acc"), details.get("deployed_outside_budget")
        return cls(
            choice=str(details.get("deployed", "")),
            arch=str(details["deployed_arch"]),
            params=int(details["deployed_params"]),
            kib=float(details["deployed_kib"]),
            own_params=int(details["own_params"]),
            reason=str(details.get("deployed_reason", "")),
            outside_budget=None if outside is None else str(outside),
            val_acc=float(val) if isinstance(val, int | float) else None,
            onnx_path=onnx_path,
        )

    def describe(self) -> str:
        where = f", {self.onnx_path}" if self.onnx_path else ""
        return f"{self.choice}: {self.arch}, {self.params:,} parameters ({self.kib:.1f} KiB{where})"


class FinalMetrics(dict[str, float]):
    """What `EdgeClient.run()` returns: the final metrics, a dict as before, and `deployed`,
    what the client deploys (None when the run did not reach its end)."""

    deployed: Deployed | None = None


class EdgeClient:
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
        self._back_at = -math.inf  # when it last came back (see REANNOUNCE_S)
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
    @property
    def accepted(self) -> bool | None:
        """True once a coordinator incarnation accepted this process (and after its shutdown),
        False once refused, None meanwhile (or after joining a finished run late)."""
        reg = self.registration
        if reg.state is State.REFUSED:
            return False
        if reg.state is State.ACCEPTED or (
            reg.state is State.FINISHED and reg.incarnation is not None
        ):
            return True
        return None

    @property
    def refused(self) -> str | None:
        """Why this process was refused (None unless it was)."""
        reg = self.registration
        return reg.reason if reg.state is State.REFUSED else None

    @property
    def finished(self) -> bool:
        """Whether the run is over for this client (its coordinator ended it, or it joined late)."""
        return self.registration.state is State.FINISHED

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

    def _send_registration(self, *, again: bool) -> None:
        """Register with the incarnation the registration names; sent `again` (unanswered), the
        next retry waits twice as long (up to REGISTER_RETRY_MAX_S)."""
        if again:
            self._register_every = min(2 * self._register_every, REGISTER_RETRY_MAX_S)
        else:
            self._register_every = REGISTER_RETRY_S
        incarnation = self.registration.registering
        assert incarnation is not None  # REGISTERING: it names one
        msg = Register(
            run=self.run_id,
            sender=self.client_id,
            spec=self.spec,
            capabilities=self.node.capabilities(),
            epoch=self._epoch(self.transport.connection),
            session=self.session,
            incarnation=incarnation,
        )
        self._try_send(msg)
        self._register_due = _now() + self._register_every * random.uniform(0.5, 1.5)

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

    # -- serving ---------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.step(self.endpoint.receive(timeout=self.idle_wait())):
                return

    def idle_wait(self) -> float:
        """How long the client may wait for a message before `step(None)` is due (a
        registration retry, a connection that came back to announce, or a look at its flags)."""
        if self._back.is_set():
            return 0.0
        wait = IDLE_WAIT_S
        reg = self.registration
        if reg.state is State.REGISTERING:  # a retry is due then
            wait = min(wait, max(0.0, self._register_due - _now()))
        elif reg.state is State.DOUBTING and reg.since is not None:  # the doubt ends then
            wait = min(wait, max(0.0, reg.since + FINISHED_GRACE_S - _now()))
        return wait

    def step(self, env: Envelope | None) -> bool:
        """Handle one received envelope, or (None) nothing within `idle_wait()`: announce a
        connection that came back, retry the registration, act on the message. True once the
        client is done (the run finished, or its registration was refused): stop serving it."""
        if self.registration.done:
            return True
        if self._back.is_set():  # our will may have marked us offline meanwhile
            self._back.clear()
            self._try_send(self._presence(self.transport.connection, online=True))
        if self._believe_finished():
            return True
        if env is None:
            # Until the coordinator answers, say hello again, less and less often.
            reg = self.registration
            if reg.state is State.REGISTERING and _now() >= self._register_due:
                reg.fire(Event.RETRY)
                self._send_registration(again=True)
            return self._stop.is_set()
        self._save_replay_record()  # before acting on it: a new process will not again
        msg = env.message
        handlers: dict[type, Callable[[Any, Mapping[str, Buffer]], bool]] = {
            Shutdown: self._on_shutdown,
            Registered: self._on_registered,
            Task: self._on_task,
        }
        if msg.run != self.run_id or msg.sender != topics.COORDINATOR:
            log.warning("%s: ignoring %s from %s/%s", self.client_id, msg.kind, msg.run, msg.sender)
        elif env.topic == self._status_topic:
            if isinstance(msg, Status):
                self._on_status(msg)
        elif env.topic != self._down:
            log.warning("%s: ignoring a %s message on %s", self.client_id, msg.kind, env.topic)
        elif type(msg) in handlers:
            if handlers[type(msg)](msg, env.blobs):
                return True  # the run is over
        else:
            log.warning("%s: ignoring unexpected %s message", self.client_id, msg.kind)
        return self._stop.is_set()

    def _believe_finished(self) -> bool:
        """Whether a "finished" status seen before registering has stood for FINISHED_GRACE_S
        (then registration is refused: the run is over, and `run()` says so)."""
        reg = self.registration
        if reg.state is not State.DOUBTING or _now() - (reg.since or 0.0) < FINISHED_GRACE_S:
            return False
        reg.fire(Event.GRACE_OVER)
        log.error("%s: registration refused: %s", self.client_id, self.refused)
        self._stop.set()
        return True

    def _save_replay_record(self) -> None:
        try:
            self.endpoint.replay.save()
        except OSError as exc:
            log.error("%s: could not save the replay record: %s", self.client_id, exc)

    def _on_shutdown(self, msg: Shutdown, _blobs: Mapping[str, Buffer]) -> bool:
        if not self.registration.fire(Event.SHUTDOWN, incarnation=msg.incarnation):
            return False  # not from the incarnation that accepted us (logged)
        log.info("%s: shutdown: %s", self.client_id, msg.reason)
        return True

    def _on_registered(self, msg: Registered, _blobs: Mapping[str, Buffer]) -> bool:
        if msg.session != self.session:  # an answer to another process of this id
            log.info("%s: ignoring an answer meant for another process", self.client_id)
            return False
        reg = self.registration
        if not msg.accepted:  # (an answer for another incarnation is logged and ignored)
            if not reg.fire(Event.REFUSE, incarnation=msg.incarnation, reason=msg.reason):
                return False
            log.error("%s: registration refused: %s", self.client_id, self.refused)
            return True  # nothing more to do here: run() raises RegistrationRefused
        was = reg.state
        if reg.fire(Event.ACCEPT, incarnation=msg.incarnation):
            if was is not State.ACCEPTED:
                log.info("%s: registered", self.client_id)
            self.peers.bind(msg.incarnation)
        return False

    def _on_task(self, msg: Task, blobs: Mapping[str, Buffer]) -> bool:
        why = self._stale(msg)
        if why is not None:
            log.info("%s: ignoring task %s: %s", self.client_id, msg.task_id, why)
        elif msg.task_id in self._seen:
            last = self._last_reply
            if last is not None and last[0] == msg.task_id:  # its reply may have been lost
                log.info("%s: task %s again: sending its reply again", self.client_id, msg.task_id)
                self._try_send(last[1], last[2])
            else:
                log.info("%s: ignoring a redelivered task %s", self.client_id, msg.task_id)
        else:
            self._seen.append(msg.task_id)
            self._handle(msg, blobs)
        return False

    def _stale(self, task: Task) -> str | None:
        """Why a task must not run here, or None. The coordinator sends every task it is still
        waiting for again once a registration is accepted, so nothing is lost by waiting."""
        if self.registration.state is not State.ACCEPTED:
            return "not registered (yet)"
        if task.incarnation != self.registration.incarnation:
            return f"it comes from coordinator incarnation {task.incarnation}, not ours"
        trained = self.node.trained_round
        if task.phase == "fit" and task.round < trained:
            return f"a fit task for round {task.round}, after training round {trained}"
        return None

    def _reconnected(self) -> None:
        self._back_at = _now()
        self._back.set()
        self.endpoint.interrupt()

    def _on_status(self, status: Status) -> None:
        previous = self.status
        if previous is not None and status.incarnation < previous.incarnation:
            log.info("%s: ignoring the status of an earlier coordinator", self.client_id)
            return
        self.status = status
        reg = self.registration
        if self.keyring is None and topics.COORDINATOR in self.endpoint.signed_writers:
            # A coordinator that signs drops unsigned registrations: waiting would never end.
            reg.fire(Event.UNSIGNED, reason=_UNSIGNED.format(id=self.client_id))
            log.error("%s: %s", self.client_id, self.refused)
            self._stop.set()
            return
        if status.model_bytes:  # room for a task's models (and a chunk) per topic, no more
            bound = max(INITIAL_PENDING_BYTES, 2 * status.model_bytes + DEFAULT_CHUNK_BYTES)
            if bound > self.endpoint.max_pending_bytes:
                self.endpoint.set_limits(max_pending_bytes=bound)
        if previous is not None and previous.incarnation != status.incarnation:
            log.info("%s: the coordinator restarted; registering again", self.client_id)
        # A "finished" status before any acceptance may be an old run's, replayed: DOUBTING
        # until a newer status says so (see edge_sdk.registration).
        event = reg.status_event(status.incarnation, status.phase == "finished")
        if not reg.fire(event, incarnation=status.incarnation, now=_now()):
            return
        if event is Event.NEW_COORDINATOR:  # else an unanswered one is retried on its timer
            self._send_registration(again=False)
        elif reg.state is State.ACCEPTED and _now() - self._back_at < REANNOUNCE_S:
            self._try_send(self._presence(self.transport.connection, online=True))

    def _handle(self, task: Task, blobs: Mapping[str, Buffer]) -> None:
        out_blobs: dict[str, bytes] = {}
        try:
            result = self.run_task(task, blobs)
            refs, out_blobs = pack_models(
                result.models, fp16=self.fp16_upload, max_bytes=self.max_blob_bytes
            )
            reply = _reply_for(task, self.client_id, result, refs, session=self.session)
            self.last_details = dict(result.details)
        except Exception as exc:  # the client reports and keeps serving
            log.exception("%s: task %s (%s) failed", self.client_id, task.task_id, task.phase)
            error = f"{type(exc).__name__}: {exc}"[:2000]
            self.errors.append(error)
            out_blobs = {}
            reply = _failed_reply(task, self.client_id, error, session=self.session)
        if not reply.ok and reply.error and reply.error not in self.errors:
            self.errors.append(reply.error)
        out_blobs = out_blobs if reply.ok else {}
        self._last_reply = (task.task_id, reply, out_blobs)
        try:
            self._send(reply, out_blobs)
        except TransportError as exc:
            log.error("%s: could not send the reply to %s: %s", self.client_id, task.task_id, exc)
        self.tasks_done += 1
        deployed = None
        if reply.ok:
            self.last_metrics = dict(reply.metrics)
            if task.phase == "finalize":
                deployed = Deployed.from_details(reply.details, self.exported)
        if self.on_task is not None:
            outcome = TaskOutcome(
                task.round,
                task.rounds,
                task.phase,
                reply.ok,
                dict(reply.metrics),
                reply.error,
                deployed,
            )
            try:
                self.on_task(outcome)
            except Exception:  # the app's callback must not stop the client
                log.exception("%s: on_task callback failed", self.client_id)

    def run_task(self, task: Task, blobs: Mapping[str, Buffer]) -> FitResult:
        """Decode the task's models and run the phase on the node (which persists and, after
        the last phase, exports)."""
        algo = self.node.algorithm_for(task.algorithm, task.config)
        models = unpack_models(
            task.models, blobs, max_bytes=self.max_blob_bytes, partial=algo.partial_models
        )
        return self.node.run(_node_task(task, models))

    def _send(self, msg: Any, blobs: dict[str, bytes] | None = None) -> None:
        self.endpoint.send(self._up, msg, blobs)

    def _epoch(self, connection: int) -> int:
        return self._epoch_base + connection

    def _presence(self, connection: int, *, online: bool, leaving: bool = False) -> Presence:
        """Online or not, for connection number `connection` (its will says offline)."""
        return Presence(
            run=self.run_id,
            sender=self.client_id,
            online=online,
            epoch=self._epoch(connection),
            session=self.session,
            leaving=leaving,
        )

    def _try_send(self, msg: Any, blobs: dict[str, bytes] | None = None) -> None:
        """Send a message; a transport failure is logged (the serving loop goes on)."""
        try:
            self._send(msg, blobs)
        except TransportError as exc:
            log.warning("%s: could not send %s: %s", self.client_id, msg.kind, exc)

    # -- export ----------------------------------------------------------------------------
    def export_onnx(self, path: str | Path | None = None) -> Path:
        """Export the personalized model to ONNX (verified against PyTorch)."""
        return self.node.export_onnx(path)


_now = time.monotonic


def _node_task(task: Task, models: Mapping[str, WireModel]) -> NodeTask:
    """The node's view of a task message whose models were decoded."""
    return NodeTask(
        round=task.round,
        rounds=task.rounds,
        phase=task.phase,
        algorithm=task.algorithm,
        config=task.config,
        models=models,
        step=task.step,
        params=task.params,
        kept_round=task.kept_round,
    )


def _reply_for(
    task: Task,
    sender: str,
    result: FitResult,
    refs: Mapping[str, ModelRef] | None = None,
    *,
    session: str = "",
) -> Reply:
    """The reply to `task` carrying `result` (its models as `refs`), checked as the coordinator
    will check it: a result that does not validate (a NaN metric...) becomes an error reply."""
    outcome: dict[str, Any] = {
        "ok": True,
        "n_samples": result.n_samples,
        "metrics": result.metrics,
        "details": result.details,
        "models": dict(refs or {}),
    }
    try:
        return Reply.model_validate(_reply_base(task, sender, session) | outcome)
    except ValidationError as exc:  # e.g. a NaN metric: say so instead of dying
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        error = f"the reply does not validate: {where}: {first.get('msg')}"
        log.error("%s: task %s: %s", sender, task.task_id, error)
        return _failed_reply(task, sender, error, session=session)


def _failed_reply(task: Task, sender: str, error: str, *, session: str = "") -> Reply:
    base = _reply_base(task, sender, session)
    return Reply.model_validate(base | {"ok": False, "error": error})


def _reply_base(task: Task, sender: str, session: str) -> dict[str, Any]:
    return {
        "run": task.run,
        "sender": sender,
        "task_id": task.task_id,
        "round": task.round,
        "phase": task.phase,
        "session": session,
        "incarnation": task.incarnation,
    }
