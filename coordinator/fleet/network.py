"""NetworkFleet: the clients over a transport (MQTT in a deployment, in-memory in tests).

Topics carry identity (`edge_sdk.topics`): the fleet reads every client's own up topic and takes
the sender from the topic, dropping any message whose `sender` field disagrees; it writes to each
client's down topic, publishes models that many tasks share once per phase on the broadcast topic,
and keeps the run's retained status topic current (its will marks it offline). Registrations,
presence (wills, reconnections) and stray replies are handled whenever the fleet listens, between
phases too. Bad messages are logged, counted and dropped; the run goes on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping

from coordinator.fleet.base import (
    CoordinatorError,
    Fleet,
    PhaseRequest,
    RunInfo,
    Validator,
    refusal,
)
from coordinator.strategies import ClientInfo, FitReply
from edge_sdk import topics
from edge_sdk.codec import Buffer, WireModel
from edge_sdk.protocol import (
    Archive,
    ModelRef,
    Presence,
    Register,
    Registered,
    Reply,
    Shutdown,
    Status,
    Task,
)
from edge_sdk.transport.base import Delivery, Transport, TransportError
from edge_sdk.wire import (
    Endpoint,
    Envelope,
    message_frame,
    pack_models,
    publish_retained,
    unique_id,
    unpack_models,
)

__all__ = ["NetworkFleet"]

log = logging.getLogger(__name__)


class NetworkFleet(Fleet):
    """Clients that register, train and reply over `transport`.

    `share_models`: a model several tasks carry crosses the broker once, on the broadcast topic
    (False: a copy rides with each task, for ACLs that cannot let clients read that topic).
    """

    def __init__(self, transport: Transport, *, share_models: bool = True) -> None:
        super().__init__()
        self.transport = transport
        self.share_models = share_models
        self.endpoint: Endpoint | None = None
        self._online: set[str] = set()
        self._epochs: dict[str, int] = {}  # the newest connection each client told us about
        self._round = 0

    @property
    def _endpoint(self) -> Endpoint:
        if self.endpoint is None:
            raise RuntimeError("the fleet is not open")
        return self.endpoint

    # -- lifecycle -------------------------------------------------------------------------
    def open(self, run: RunInfo) -> None:
        if self.endpoint is not None and self.endpoint.is_open:
            return
        self._run = run
        self.endpoint = Endpoint(
            self.transport,
            [topics.up_all(run.run_id)],
            max_blob_bytes=run.max_blob_bytes,
            # every client may have a model or two in flight at once
            max_total_pending_bytes=2 * run.max_blob_bytes * max(4, run.expected_clients),
        )
        self.transport.set_will(
            topics.status(run.run_id), message_frame(self._status("offline")), retain=True
        )
        self.transport.connect()
        self.endpoint.open()
        self._publish_status("registering")

    def gather(self, timeout_s: float, min_clients: int | None) -> None:
        deadline = time.monotonic() + timeout_s
        expected = self.run.expected_clients
        while len(self.clients) < expected:
            env = self._receive(deadline - time.monotonic())
            if env is None:
                if min_clients is not None and len(self.clients) >= min_clients:
                    log.warning(
                        "starting with %d of %d expected clients (min_clients %d)",
                        len(self.clients),
                        expected,
                        min_clients,
                    )
                    break
                raise CoordinatorError(
                    f"only {len(self.clients)} of {expected} clients registered "
                    f"within {timeout_s:.0f} s"
                )
            self._dispatch_control(env)
        self.started = True
        log.info("%d clients registered", len(self.clients))

    def rejoin(self, run: RunInfo, timeout_s: float) -> None:
        """The clients see the new incarnation on the status topic and register again."""
        self._run = run
        self.started = True
        self._online.clear()
        self._publish_status("registering")
        deadline = time.monotonic() + timeout_s
        while set(self.clients) - self._online:
            left = deadline - time.monotonic()
            env = self._receive(left) if left > 0 else None
            if env is None:
                log.warning("resuming without %s", sorted(set(self.clients) - self._online))
                return
            self._dispatch_control(env)

    def online(self) -> set[str]:
        self._drain()  # the latest registrations and wills count
        return set(self._online)

    def await_back(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while set(self.clients) - self._online:
            env = self._receive(deadline - time.monotonic())
            if env is None:
                return
            self._dispatch_control(env)

    def publish_archive(self, models: Mapping[str, WireModel]) -> None:
        run = self.run
        publish_retained(
            self._endpoint,
            topics.archive(run.run_id),
            models,
            lambda refs: Archive(
                run=run.run_id,
                sender=topics.COORDINATOR,
                algorithm=run.algorithm,
                config=run.config,
                rounds=run.rounds,
                models=refs,
            ),
        )
        log.info("published %d archived models for late joiners", len(models))

    def finish(self, reason: str) -> None:
        for cid in self.clients:
            self._send(cid, Shutdown(run=self.run.run_id, sender=topics.COORDINATOR, reason=reason))
        self._publish_status("finished")
        self._endpoint.close()

    def pause(self) -> None:
        if self.endpoint is None:
            return
        self._publish_status("offline")
        self.endpoint.close()

    def rejections(self) -> Counter[str]:
        endpoint = self.endpoint.rejections if self.endpoint is not None else Counter()
        return self.rejected + endpoint

    @property
    def bytes_out(self) -> int:
        return self.transport.stats.bytes_out

    @property
    def bytes_in(self) -> int:
        return self.transport.stats.bytes_in

    # -- phases ----------------------------------------------------------------------------
    def run_phase(self, request: PhaseRequest, validate: Validator) -> dict[str, FitReply | None]:
        """Send one task per planned client, collect replies until all or the deadline."""
        run, r, phase, step = self.run, request.round, request.phase, request.step
        self._round = r
        self._publish_status(phase)
        pending: dict[str, str] = {}
        sent: dict[str, list[Delivery]] = {}
        for cid, (refs, blobs) in self._pack(request.plan).items():
            task = Task(
                run=run.run_id,
                sender=topics.COORDINATOR,
                task_id=f"{phase}{step and '.' + step}-{r}-{cid}-{unique_id(32)}",
                round=r,
                rounds=run.rounds,
                phase=phase,
                algorithm=run.algorithm,
                config=run.config,
                models=refs,
                step=step,
                params=dict(request.params.get(cid, {})),
            )
            pending[task.task_id] = cid
            sent[cid] = self._send(cid, task, blobs, wait=False)
        for cid, deliveries in sent.items():  # acks come back while the others are still sent
            try:
                self._endpoint.wait(deliveries)
            except TransportError as exc:
                log.error("the %s task to %s was not delivered: %s", phase, cid, exc)
        results: dict[str, FitReply | None] = {cid: None for cid in request.plan}
        deadline = time.monotonic() + request.deadline_s
        while pending:
            env = self._receive(deadline - time.monotonic())
            if env is None:
                log.warning(
                    "round %d %s: deadline passed; no reply from %s",
                    r,
                    phase,
                    sorted(pending.values()),
                )
                break
            msg = env.message
            if not isinstance(msg, Reply) or msg.task_id not in pending or msg.round != r:
                self._dispatch_control(env)  # registrations, presence, stray replies
                if isinstance(msg, Presence) and msg.sender not in self._online:
                    gone = [t for t, c in pending.items() if c == msg.sender]
                    for t in gone:  # stop waiting for it
                        del pending[t]
                        log.warning("round %d %s: %s went offline", r, phase, msg.sender)
                continue
            owner, sender = pending[msg.task_id], self._sender(env)
            if sender != owner:  # someone else's task id: dropped by _sender or here
                if sender is not None:
                    self._reject("stale_reply", f"reply {msg.task_id} from {sender}")
                continue
            del pending[msg.task_id]
            self._online.add(sender)
            results[owner] = self._accept(owner, request, msg, env.blobs, validate)
        return results

    def _accept(
        self,
        cid: str,
        request: PhaseRequest,
        msg: Reply,
        blobs: Mapping[str, Buffer],
        validate: Validator,
    ) -> FitReply | None:
        if not msg.ok:
            log.error("%s failed its %s task: %s", cid, request.phase, msg.error)
            return None
        try:
            models = unpack_models(
                msg.models, blobs, max_bytes=self.run.max_blob_bytes, partial=request.partial
            )
            reply = FitReply(cid, models, dict(msg.metrics), msg.n_samples, dict(msg.details))
            validate(cid, reply)
        except (ValueError, KeyError) as exc:
            self._reject("invalid_reply", f"{request.phase} reply from {cid}: {exc}")
            return None
        return reply

    def _pack(
        self, plan: Mapping[str, Mapping[str, WireModel]]
    ) -> dict[str, tuple[dict[str, ModelRef], dict[str, bytes]]]:
        """Encode each distinct model once. A model that several tasks carry goes once to the
        broadcast topic (its refs marked shared); the others ride with their own task."""
        uses: Counter[tuple[str, int]] = Counter()
        for models in plan.values():
            uses.update({_model_key(m) for m in models.values()})
        packed: dict[tuple[str, int], tuple[ModelRef, bytes]] = {}
        shared_blobs: dict[str, bytes] = {}
        max_bytes = self.run.max_blob_bytes
        out = {}
        for cid, models in plan.items():
            refs: dict[str, ModelRef] = {}
            own: dict[str, bytes] = {}
            for name, m in models.items():
                key = _model_key(m)
                if key not in packed or not self.share_models:
                    shared = uses[key] > 1 and self.share_models
                    one_ref, one_blob = pack_models({name: m}, max_bytes=max_bytes, shared=shared)
                    ref = one_ref[name]
                    packed[key] = (ref, one_blob[ref.blob.id])
                    if shared:
                        shared_blobs[ref.blob.id] = one_blob[ref.blob.id]
                ref, data = packed[key]
                refs[name] = ref
                if not ref.blob.shared:
                    own[ref.blob.id] = data
            out[cid] = (refs, own)
        if shared_blobs:
            try:
                self._endpoint.wait(
                    self._endpoint.publish_blobs(topics.bcast(self.run.run_id), shared_blobs)
                )
            except TransportError as exc:
                log.error("broadcasting the shared models failed: %s", exc)
        return out

    # -- messages --------------------------------------------------------------------------
    def _status(self, phase: str) -> Status:
        run = self.run
        return Status(
            run=run.run_id,
            sender=topics.COORDINATOR,
            incarnation=run.incarnation,
            phase=phase,
            round=self._round,
            rounds=run.rounds,
            algorithm=run.algorithm,
            accepting=not self.started,
        )

    def _publish_status(self, phase: str) -> None:
        try:
            self._endpoint.send(topics.status(self.run.run_id), self._status(phase), retain=True)
        except TransportError as exc:
            log.error("could not publish the run status (%s): %s", phase, exc)

    def _receive(self, timeout: float) -> Envelope | None:
        """The next envelope within `timeout` s; raises `Interrupted` once `stop()` was called."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_stop(self._round)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            env = self._endpoint.receive(timeout=min(left, 0.25))
            if env is not None:
                return env

    def _drain(self) -> None:
        """Handle what already arrived between phases (registrations, presence, late replies)."""
        if self.endpoint is None:
            return
        while (env := self.endpoint.receive(timeout=0)) is not None:
            self._dispatch_control(env)

    def _sender(self, env: Envelope) -> str | None:
        """The client the message's topic names, when its `sender` field agrees; else None."""
        run_id = self.run.run_id
        origin = topics.origin_of(env.topic, run_id)
        msg = env.message
        if origin is None or origin != msg.sender or msg.run != run_id:
            self._reject(
                "sender_mismatch",
                f"a {msg.kind} on {env.topic} claims sender {msg.sender!r} of run {msg.run!r}",
            )
            return None
        return origin

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        log.warning("dropped (%s): %s", reason, detail)

    def _dispatch_control(self, env: Envelope) -> None:
        cid = self._sender(env)
        if cid is None:
            return
        msg = env.message
        if isinstance(msg, Register):
            self._on_register(msg)
        elif isinstance(msg, Presence):
            self._on_presence(cid, msg.online, msg.epoch)
        elif cid not in self.clients:
            self._reject("unknown_sender", f"a {msg.kind} from unregistered {cid!r}")
        elif isinstance(msg, Reply):  # its task's phase is over (or it never had one)
            self._reject("stale_reply", f"reply {msg.task_id} from {cid}")
        else:
            log.info("ignoring %s from %s outside its phase", msg.kind, cid)

    def _on_presence(self, cid: str, online: bool, epoch: int) -> None:
        if epoch < self._epochs.get(cid, -1):
            log.info("%s: ignoring news about an older connection (%d)", cid, epoch)
            return
        self._epochs[cid] = epoch
        if online:
            self._online.add(cid)
        else:
            self._online.discard(cid)
            log.warning("%s went offline", cid)

    def _on_register(self, msg: Register) -> None:
        reason = refusal(
            msg.sender,
            msg.spec,
            msg.capabilities,
            run=self.run,
            clients=self.clients,
            started=self.started,
        )
        if reason is None:
            self.clients[msg.sender] = ClientInfo(msg.sender, msg.spec, msg.capabilities)
            self._on_presence(msg.sender, True, msg.epoch)
            log.info("registered %s (%s, %d train)", msg.sender, msg.spec, msg.capabilities.n_train)
        else:
            log.warning("refused registration of %s: %s", msg.sender, reason)
        self._send(
            msg.sender,
            Registered(
                run=self.run.run_id,
                sender=topics.COORDINATOR,
                accepted=reason is None,
                reason=reason,
            ),
        )

    def _send(
        self,
        cid: str,
        msg: Task | Registered | Shutdown,
        blobs: Mapping[str, bytes] | None = None,
        *,
        wait: bool = True,
    ) -> list[Delivery]:
        try:
            return self._endpoint.send(topics.down(self.run.run_id, cid), msg, blobs, wait=wait)
        except (TransportError, ValueError) as exc:  # one unreachable client costs its reply
            log.error("could not send %s to %s: %s", msg.kind, cid, exc)
            return []


def _model_key(m: WireModel) -> tuple[str, int]:
    """Identity of a model in a plan: the same weights object under the same architecture."""
    return (m.spec.to_json(), id(m.weights))
