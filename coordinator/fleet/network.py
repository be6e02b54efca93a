"""NetworkFleet: the clients over a transport (MQTT in a deployment, in-memory in tests).

Topics carry identity (`edge_sdk.topics`): the fleet reads every client's own up topic and takes
the sender from the topic, dropping any message whose `sender` field disagrees; it writes to each
client's down topic, publishes models that many tasks share once per phase on the broadcast topic,
and keeps the run's retained status topic current (its will marks it offline). With a `keyring`
(edge_sdk.auth) everything it sends is signed and only messages signed by the client that owns the
topic count, so neither an open broker nor another client's credentials can forge one.

Membership (`coordinator.fleet.members`): one process (session) per client id counts, the one
whose registration for this incarnation was accepted last; offline is known from wills and
goodbyes at once. A phase waits for the tasks of clients that are present (online, or dropped
less than the run's `reconnect_grace_s` ago): a reply that is not signed by the registered
process costs nothing (the task stays open for it until the deadline; in open mode, where anyone
may have sent it, so does a reply that does not validate), a client that stays away past its
grace is not waited for, and one that comes back (reconnected, restarted, or the broker lost
what was queued) is sent its task again. Bad messages are counted and dropped, their log lines
limited to one per sender and reason per minute; the run goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping

from coordinator.fleet.base import (
    BrokerUnfit,
    CoordinatorError,
    PhaseRequest,
    RunInfo,
    Validator,
)
from coordinator.fleet.members import Members
from coordinator.fleet.packing import pack_plan, renew
from coordinator.fleet.status import STATUS_AGAIN_S, STATUS_REFRESH_S, RunStatus
from coordinator.strategies import FitReply
from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.codec import WireModel
from edge_sdk.ids import unique_id
from edge_sdk.model_blobs import model_bytes, unpack_models
from edge_sdk.peers import RetainedNotDelivered
from edge_sdk.protocol import Archive, Register, Registered, Reply, Shutdown, Task
from edge_sdk.ratelog import RateLimitedLog
from edge_sdk.retained import publish_retained
from edge_sdk.transport.base import Delivery, Transport, TransportError
from edge_sdk.wire import Endpoint, Envelope

__all__ = ["NetworkFleet"]

log = logging.getLogger(__name__)

RESEND_BATCH_S = 0.5  # clients that came back within this share one re-broadcast of the models


class NetworkFleet(RunStatus):
    """Clients that register, train and reply over `transport`.

    `share_models`: a model several tasks carry crosses the broker once, on the broadcast topic
    (False: a copy rides with each task, for ACLs that cannot let clients read that topic).
    `keyring`: the coordinator's keys (None: open mode, nothing signed or checked).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        share_models: bool = True,
        keyring: Keyring | None = None,
    ) -> None:
        super().__init__()
        if keyring is not None and keyring.me != topics.COORDINATOR:
            raise ValueError(f"the coordinator's keyring is {keyring.me!r}'s")
        self.transport = transport
        self.share_models = share_models
        self.keyring = keyring
        self.endpoint: Endpoint | None = None
        self._round = 0
        self._phase = "registering"
        self._log = RateLimitedLog(log)
        self.members = Members(self.clients, self._reject, self._answer)
        self._model_bytes = 0  # the largest a message of this run carries (models, bytes)
        self._reconnected = threading.Event()
        # The phase in progress: each waiting client's task (and own blobs), the shared blobs,
        # the clients due to be sent their task again.
        self._tasks: dict[str, tuple[Task, dict[str, bytes]]] = {}
        self._shared: dict[str, bytes] = {}
        self._due: set[str] = set()
        self._due_since = 0.0
        self._status_at = -float("inf")  # when the status was last published (monotonic)
        self._status_frame = b""  # ... and the frame that published it
        self._status_replaced = threading.Event()  # the broker holds another one now

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
        self.members.open(run)
        self.endpoint = Endpoint(
            self.transport,
            [topics.up_all(run.run_id)],
            max_blob_bytes=run.max_blob_bytes,
            keyring=self.keyring,
            pending_bound=self._pending_bound,
        )
        self._resize()
        status = topics.status(run.run_id)
        self.transport.set_will(
            status, self.endpoint.frame(status, self._status("offline")), retain=True
        )
        self.transport.on_reconnect = self._on_reconnect
        self.transport.connect()
        self.endpoint.open()
        self.transport.subscribe(status, self._on_status_echo)
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
                    f"within {timeout_s:.0f} s (round.register_timeout_s: "
                    "--register-timeout SECONDS waits longer; --min-clients M starts with fewer)"
                )
            self._dispatch(env)
        self.started = True
        self.members.started = True
        log.info("%d clients registered", len(self.clients))

    def rejoin(self, run: RunInfo, timeout_s: float) -> None:
        """The clients see the new incarnation on the status topic and register again."""
        self._run = run
        self.started = True
        self.members.open(run, started=True)
        self._resize()
        self._publish_status("registering")
        deadline = time.monotonic() + timeout_s
        while set(self.clients) - self.members.online:
            left = deadline - time.monotonic()
            env = self._receive(left) if left > 0 else None
            if env is None:
                log.warning("resuming without %s", sorted(set(self.clients) - self.members.online))
                return
            self._dispatch(env)

    def online(self) -> set[str]:
        self._drain()  # the latest registrations and wills count
        return self.members.present()

    def known_online(self) -> set[str]:
        return self.members.present()

    def await_back(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while set(self.clients) - self.members.online:
            env = self._receive(deadline - time.monotonic())
            if env is None:
                return
            self._dispatch(env)

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
        run = self.run
        bye = Shutdown(
            run=run.run_id, sender=topics.COORDINATOR, reason=reason, incarnation=run.incarnation
        )
        sent = [d for cid in self.clients for d in self._send(cid, bye, wait=False)]
        self._wait(sent, "shutdown")  # acks come back while the others are still sent
        self._publish_status("finished")
        self._close()

    def pause(self) -> None:
        if self.endpoint is None:
            return
        self._publish_status("offline")
        self._close()

    def _close(self) -> None:
        self.transport.unsubscribe(topics.status(self.run.run_id))
        self._endpoint.close()

    def rejections(self) -> Counter[str]:
        endpoint = self.endpoint.rejections if self.endpoint is not None else Counter()
        dropped = self.transport.stats.dropped_in  # payloads over the transport's limit
        return self.rejected + endpoint + Counter({"oversized_payload": dropped} if dropped else {})

    @property
    def bytes_out(self) -> int:
        return self.transport.stats.bytes_out

    @property
    def bytes_in(self) -> int:
        return self.transport.stats.bytes_in

    # -- phases ----------------------------------------------------------------------------
    def run_phase(self, request: PhaseRequest, validate: Validator) -> dict[str, FitReply | None]:
        """Send one task per planned client; collect valid replies until every client still
        online replied, or the deadline."""
        run, r, phase, step = self.run, request.round, request.phase, request.step
        self._round, self._phase = r, phase
        packed, self._shared = pack_plan(
            request.plan, share=self.share_models, max_bytes=run.max_blob_bytes
        )
        for refs, _ in packed.values():  # what replies may hold, and what the status announces
            self._grow(sum(ref.blob.size for ref in refs.values()))
        self._publish_status(phase)
        self._publish_shared()
        self._tasks = {}
        for cid, (refs, blobs) in packed.items():
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
                incarnation=run.incarnation,
                kept_round=request.kept_round,
            )
            self._tasks[cid] = (task, blobs)
        owner = {task.task_id: cid for cid, (task, _) in self._tasks.items()}
        self._deliver(list(self._tasks))
        results: dict[str, FitReply | None] = {cid: None for cid in request.plan}
        unfit: dict[str, str] = {}  # clients that found the broker lacking, and what they said
        deadline = time.monotonic() + request.deadline_s
        try:
            while self._waiting():
                until = min(deadline, self.members.grace_ends(self._tasks, time.monotonic()))
                env = self._receive(until - time.monotonic())
                if env is None:
                    if time.monotonic() < deadline:
                        continue  # a dropped client's grace ran out: it is waited for no more
                    log.warning(
                        "round %d %s: deadline passed; no reply from %s",
                        r,
                        phase,
                        sorted(self._tasks),
                    )
                    break
                msg = env.message
                to = owner.get(msg.task_id) if isinstance(msg, Reply) else None
                if (
                    to is None
                    or not isinstance(msg, Reply)
                    or msg.round != r
                    or msg.incarnation != run.incarnation
                ):
                    self._dispatch(env)  # registrations, presence, stray replies
                    continue
                if to not in self._tasks:  # answered already: a copy (QoS 1 or a re-send)
                    log.debug("a second reply to %s from %s", msg.task_id, to)
                    continue
                if not self._from_registered(env, to):
                    continue  # counted; the task stays open for the registered process
                if not msg.ok:
                    log.error("%s failed its %s task: %s", to, phase, msg.error)
                    if (msg.error or "").startswith(f"{RetainedNotDelivered.__name__}:"):
                        unfit[to] = msg.error or ""
                    self._ended(to)
                    continue
                reply = self._accept(to, request, msg, env, validate)
                # Unsigned (open mode), an invalid reply may be anyone's: the task stays open
                # for the genuine one. Signed by the registered process, it is that answer.
                if reply is not None or self.keyring is not None:
                    results[to] = reply
                    self._ended(to)
            gone = sorted(set(self._tasks) - self.members.online)
            if gone:
                log.warning("round %d %s: no reply from %s: offline", r, phase, gone)
            if 2 * len(unfit) > len(request.plan):  # not one client's word: most of them
                first = unfit[min(unfit)]
                raise BrokerUnfit(
                    f"{len(unfit)} of {len(request.plan)} clients found that the broker does "
                    f"not deliver what this run needs, so no round can succeed: {first}"
                )
        finally:
            self._tasks, self._shared, self._due = {}, {}, set()
        return results

    def _ended(self, cid: str) -> None:
        """`cid`'s task of the phase is answered: no longer waited for, and counted."""
        del self._tasks[cid]
        if self.finished is not None:
            self.finished(1)

    def _waiting(self) -> bool:
        """Whether a task is still open for a client that is present (the first one found
        usually is: this runs once per message, so it must not walk every client)."""
        now = time.monotonic()
        return any(self.members.is_present(cid, now) for cid in self._tasks)

    def _from_registered(self, env: Envelope, cid: str) -> bool:
        """Whether a reply to `cid`'s task came from `cid`'s registered process."""
        sender = self._sender(env)
        if sender is None:
            return False  # counted as a sender mismatch
        msg = env.message
        assert isinstance(msg, Reply)
        if sender != cid:
            self._reject("stale_reply", f"{sender} answered {cid}'s task {msg.task_id}", sender)
            return False
        if not self.members.is_registered(cid, msg.session):
            self._reject("wrong_session", f"a reply from another process of {cid}", cid)
            self.members.tell_superseded(cid, msg.session)
            return False
        return True

    def _accept(
        self,
        cid: str,
        request: PhaseRequest,
        msg: Reply,
        env: Envelope,
        validate: Validator,
    ) -> FitReply | None:
        try:
            if env.refused:  # e.g. a blob declaring 10**12 bytes: it fails its task at once
                raise ValueError("its models were refused: " + "; ".join(env.refused.values()))
            models = unpack_models(
                msg.models,
                env.blobs,
                max_bytes=self.run.max_blob_bytes,
                partial=request.partial,
                max_abs=self.run.max_abs,
            )
            reply = FitReply(cid, models, dict(msg.metrics), msg.n_samples, dict(msg.details))
            validate(cid, reply)
        except (ValueError, KeyError) as exc:
            self._reject("invalid_reply", f"{request.phase} reply from {cid}: {exc}", cid)
            return None
        return reply

    def _publish_shared(self) -> None:
        if not self._shared:
            return
        try:
            bcast = topics.bcast(self.run.run_id)
            self._endpoint.wait(self._endpoint.publish_blobs(bcast, self._shared))
        except TransportError as exc:
            log.error("broadcasting the shared models failed: %s", exc)

    def _deliver(self, cids: list[str]) -> None:
        """Send these clients their tasks (acks come back while the others are still sent)."""
        sent = [d for cid in cids for d in self._send(cid, *self._tasks[cid], wait=False)]
        self._wait(sent, f"{self._phase} task")

    def _wait(self, deliveries: list[Delivery], what: str) -> None:
        """Wait for the broker's acks of `deliveries`; a refused one is logged, by topic."""
        deadline = time.monotonic() + self._endpoint.ack_timeout_s
        for d in deliveries:
            try:
                d.wait(max(0.0, deadline - time.monotonic()))
            except TransportError as exc:
                log.error("the %s on %s was not delivered: %s", what, d.topic, exc)

    def _come_back(self, cid: str) -> None:
        """`cid` has a new connection or process: it may have missed its task."""
        if cid in self._tasks:
            if not self._due:
                self._due_since = time.monotonic()
            self._due.add(cid)

    def _resend_due(self) -> None:
        """After our own reconnection, republish the status (a new broker may have none) and
        send every open task again; send their tasks again to the clients that came back (and,
        once for all of those within `RESEND_BATCH_S`, the shared models: a restarted process or
        a broker that lost its queues has none)."""
        if self._reconnected.is_set():
            self._reconnected.clear()
            self._publish_status(self._phase)
            for cid in self._tasks:
                self._come_back(cid)
        if not self._due or time.monotonic() - self._due_since < RESEND_BATCH_S:
            return
        due = sorted(self._due & set(self._tasks) & self.members.online)
        self._due.clear()
        if due:
            log.info("round %d %s: sending %s their tasks again", self._round, self._phase, due)
            self._renew(due)
            self._deliver(due)

    def _renew(self, cids: list[str]) -> None:
        """These tasks' blobs under new ids (`packing.renew`), the shared ones published again."""
        again = renew(self._tasks, cids, self._shared)
        if again:
            try:
                bcast = topics.bcast(self.run.run_id)
                self._endpoint.wait(self._endpoint.publish_blobs(bcast, again))
            except TransportError as exc:
                log.error("broadcasting the shared models again failed: %s", exc)

    # -- messages --------------------------------------------------------------------------
    def _on_reconnect(self) -> None:  # the transport's thread: only flag and wake
        self._reconnected.set()
        if self.endpoint is not None:
            self.endpoint.interrupt()

    def _receive(self, timeout: float) -> Envelope | None:
        """The next envelope within `timeout` s; raises `Interrupted` once `stop()` was called.
        Meanwhile, what a reconnection calls for is done (see `_resend_due`)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_stop(self._round)
            self._resend_due()
            since = time.monotonic() - self._status_at
            if since >= STATUS_REFRESH_S or (
                since >= STATUS_AGAIN_S and self._status_replaced.is_set()
            ):
                if self._status_replaced.is_set():
                    self._status_replaced.clear()
                    log.info("the retained status was replaced; publishing ours again")
                self._publish_status(self._phase)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            env = self._endpoint.receive(timeout=min(left, 0.1 if self._due else 0.25))
            if env is not None:
                return env

    def _drain(self) -> None:
        """Handle what already arrived between phases (registrations, presence, late replies)."""
        if self.endpoint is None:
            return
        while (env := self.endpoint.receive(timeout=0)) is not None:
            self._dispatch(env)

    def _sender(self, env: Envelope) -> str | None:
        """The client the message's topic names, when its `sender` field agrees; else None."""
        run_id = self.run.run_id
        origin = topics.origin_of(env.topic, run_id)
        msg = env.message
        if origin is None or origin != msg.sender or msg.run != run_id:
            self._reject(
                "sender_mismatch",
                f"a {msg.kind} on {env.topic} claims sender {msg.sender!r} of run {msg.run!r}",
                env.topic,
            )
            return None
        return origin

    def _reject(self, reason: str, detail: str, who: str) -> None:
        self.rejected[reason] += 1
        self._log.warning((who, reason), "dropped (%s): %s", reason, detail)

    def _dispatch(self, env: Envelope) -> None:
        """A message outside the replies of the phase: registration, presence, stray replies.
        A client that came back (a new connection or process) is sent its task again."""
        cid = self._sender(env)
        if cid is None:
            return
        if self.members.handle(cid, env.message):
            self._come_back(cid)
        if isinstance(env.message, Register) and cid in self.clients:
            self._grow(2 * model_bytes(self.clients[cid].spec))  # its own and the global

    def _answer(self, cid: str, answer: Registered) -> None:
        # Not waited for: thousands register at once, and a round trip each made admitting
        # them serial. A lost answer costs the client a registration retry.
        self._send(cid, answer, wait=False)

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
