"""How an EdgeClient serves its coordinator: one step per message received (or per quiet
wait), registering and retrying with backoff, following the coordinator's status, running each
task on the node and replying (the base of `edge_sdk.client.EdgeClient`, which owns the
connection and the state read here). Where it stands is one explicit state machine,
`registration` (edge_sdk.registration)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from edge_sdk import topics
from edge_sdk.algorithms import FitResult
from edge_sdk.auth import Keyring
from edge_sdk.codec import Buffer, WireModel
from edge_sdk.model_blobs import pack_models, unpack_models
from edge_sdk.node import ClientNode, NodeTask
from edge_sdk.outcomes import Deployed, TaskOutcome
from edge_sdk.peers import PeerChannel
from edge_sdk.protocol import (
    ModelRef,
    Presence,
    Register,
    Registered,
    Reply,
    Shutdown,
    Status,
    Task,
)
from edge_sdk.registration import Event, Registration, State
from edge_sdk.transport.base import Transport, TransportError
from edge_sdk.wire import DEFAULT_CHUNK_BYTES, Endpoint, Envelope

__all__ = [
    "FINISHED_GRACE_S",
    "IDLE_WAIT_S",
    "INITIAL_PENDING_BYTES",
    "REANNOUNCE_S",
    "REGISTER_RETRY_MAX_S",
    "REGISTER_RETRY_S",
    "Serving",
]

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


class Serving:
    """The serving half of an EdgeClient: `step()` acts on what its endpoint received, and
    `idle_wait()` says how long it may wait for the next message. The client sets the state
    declared here."""

    node: ClientNode
    keyring: Keyring | None
    session: str
    client_id: str
    run_id: str
    fp16_upload: bool
    max_blob_bytes: int
    on_task: Callable[[TaskOutcome], None] | None
    transport: Transport
    endpoint: Endpoint
    peers: PeerChannel
    registration: Registration
    status: Status | None
    tasks_done: int
    errors: list[str]
    last_metrics: dict[str, float]
    last_details: dict[str, Any]
    _up: str
    _down: str
    _status_topic: str
    _stop: threading.Event
    _back: threading.Event
    _back_at: float
    _epoch_base: int
    _seen: deque[str]
    _register_due: float
    _register_every: float
    _last_reply: tuple[str, Reply, dict[str, bytes]] | None

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
            spec=self.node.spec,
            capabilities=self.node.capabilities(),
            epoch=self._epoch(self.transport.connection),
            session=self.session,
            incarnation=incarnation,
        )
        self._try_send(msg)
        self._register_due = _now() + self._register_every * random.uniform(0.5, 1.5)

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
        return self._stop.is_set() or self.registration.done

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
        if event is Event.SHUTDOWN:
            log.info("%s: the run is over (its coordinator's status says so)", self.client_id)
        elif event is Event.NEW_COORDINATOR:  # else an unanswered one is retried on its timer
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
                deployed = Deployed.from_details(reply.details, self.node.exported)
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
