"""The Coordinator: client registry, round clock with deadlines and quorum, the one round loop.

A round: the strategy picks clients and the models each receives → tasks go out through the
transport → replies are collected until all arrive or the deadline passes → each reply is
validated (round and task id, schema, model names, architectures, shapes, finite values) → if
enough valid replies arrived (quorum) the strategy aggregates, else the round is recorded as
failed and the state is left as it was → evaluation on every client → checkpoint.
After the last round a finalize task goes to every client (fine-tuning, ONNX export) and the
final per-client scores come back with it. Bad messages are logged and dropped; the loop goes on.

Topics carry identity (`edge_sdk.topics`): the coordinator reads every client's own up topic and
takes the sender from the topic, dropping any message whose `sender` field disagrees; it writes
to each client's down topic, publishes models that many tasks share once per phase on the
broadcast topic, and keeps the run's retained status topic current (its will marks it offline).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coordinator.results import ClientResult, RoundRecord, RunResult
from coordinator.strategies import (
    ClientInfo,
    FitReply,
    ServerData,
    Strategy,
    StrategyError,
    strategy_class,
)
from edge_sdk import topics
from edge_sdk.algorithms import BaseAlgorithmConfig, Detail
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, Buffer, WireModel
from edge_sdk.protocol import (
    Archive,
    Capabilities,
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
from edge_sdk.state import StateError, load_state, save_state
from edge_sdk.transport.base import Delivery, Transport, TransportError
from edge_sdk.wire import (
    Endpoint,
    Envelope,
    message_frame,
    pack_models,
    publish_retained,
    reference_shapes,
    unique_id,
    unpack_models,
)
from model_zoo import ArchSpec, ModelZooError

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "CoordinatorStats",
    "Interrupted",
    "RoundConfig",
]

log = logging.getLogger(__name__)


class CoordinatorError(RuntimeError):
    """The run cannot go on (too few clients registered, incompatible federation)."""


class Interrupted(RuntimeError):
    """`stop()` was called (SIGTERM, Ctrl-C): the run paused; its checkpoint resumes it."""


class RoundConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    deadline_s: float = Field(600.0, gt=0)  # per phase of a round
    # The finalize phase (fine-tuning, distillation, ONNX export and its verification) may take
    # longer than a round's phases; None: the same as deadline_s.
    finalize_deadline_s: float | None = Field(None, gt=0)
    quorum: float = Field(1.0, gt=0, le=1)  # fraction of a round's tasks that must reply validly
    # How long the coordinator waits for its clients to register. Devices started by hand, or
    # slow to import torch, take minutes: a daemon waits 10 by default.
    register_timeout_s: float = Field(600.0, gt=0)
    eval_every: int = Field(1, ge=1)  # evaluate on all clients every N rounds (and the last)
    # Start once this many clients registered when `register_timeout_s` passes without all of
    # the expected ones (None: all expected clients are needed).
    min_clients: int | None = Field(None, ge=1)
    # A round that misses quorum runs again (new sampling, the clients start from where they
    # were before it) up to this many times; then it is recorded as failed, state unchanged.
    retries: int = Field(1, ge=0)


@dataclass
class CoordinatorStats:
    """Live counters for operators (the daemon's Prometheus metrics read them)."""

    rounds_completed: int = 0
    rounds_failed: int = 0
    round_seconds: list[float] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)  # messages dropped, by reason


@dataclass
class _Collected:
    models: dict[str, WireModel]
    metrics: dict[str, float]
    n_samples: int
    details: dict[str, Detail] = field(default_factory=dict)


class Coordinator:
    def __init__(
        self,
        transport: Transport,
        *,
        algorithm: str,
        config: BaseAlgorithmConfig,
        rounds: int,
        expected_clients: int,
        clients_per_round: int | None = None,
        allow: Sequence[str] | None = None,
        global_model: str | None = None,
        model_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        round_config: RoundConfig | None = None,
        run_id: str = "default",
        seed: int = 0,
        incarnation: int | None = None,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        share_models: bool = True,
        on_round: Callable[[RoundRecord], None] | None = None,
        checkpoint_path: str | Path | None = None,
        server_data: ServerData | None = None,
    ) -> None:
        """`share_models`: a model several tasks carry crosses the broker once, on the
        broadcast topic (False: a copy rides with each task, as before the broadcast topic).
        `checkpoint_path`: after every round the whole state is written there (atomically);
        a coordinator that finds it resumes at the next round (see `restore`)."""
        if rounds < 1 or expected_clients < 1:
            raise ValueError(
                f"need rounds >= 1 and expected_clients >= 1, got {rounds}, {expected_clients}"
            )
        self.algorithm = algorithm
        self.strategy_cls = strategy_class(algorithm)
        self.config = config
        self.rounds = rounds
        self.allow = {topics.check_id(c, "client id") for c in allow} if allow else None
        self.expected_clients = len(self.allow) if self.allow else expected_clients
        self.clients_per_round = clients_per_round
        self.global_model = global_model
        self.model_kwargs = {k: dict(v) for k, v in (model_kwargs or {}).items()}
        self.rc = round_config or RoundConfig()
        self.run_id = topics.check_id(run_id, "run id")
        self.seed = seed
        # A new number per start: clients that see it change on the status topic re-register.
        self.incarnation = incarnation if incarnation is not None else time.time_ns() // 1_000_000
        self.max_blob_bytes = max_blob_bytes
        self.share_models = share_models
        self.on_round = on_round
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.server_data = server_data
        self.transport = transport
        self.endpoint = Endpoint(
            transport,
            [topics.up_all(run_id)],
            max_blob_bytes=max_blob_bytes,
            # every client may have a model or two in flight at once
            max_total_pending_bytes=2 * max_blob_bytes * max(4, self.expected_clients),
        )
        self.clients: dict[str, ClientInfo] = {}
        self.online: set[str] = set()
        self._epochs: dict[str, int] = {}  # the newest connection each client told us about
        self.strategy: Strategy | None = None
        self.stats = CoordinatorStats()
        self._started = False
        self._round = 0
        self.records: list[RoundRecord] = []
        self._restored: dict[str, Any] | None = None
        self._stop = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Coordinator:
        """Connect and start listening (before clients register); idempotent."""
        if self.endpoint.is_open:
            return self
        self.transport.set_will(
            topics.status(self.run_id), message_frame(self._status("offline")), retain=True
        )
        self.transport.connect()
        self.endpoint.open()
        self._publish_status("registering")
        return self

    def run(self) -> RunResult:
        """Register the clients (or, from a checkpoint, wait for them to come back), run the
        remaining rounds, finalize. Raises `Interrupted` after `stop()`."""
        self.open()
        t0 = time.perf_counter()
        finished = False
        try:
            if self.checkpoint_path is not None and self._restored is None:
                self.restore()
            if self._restored is not None:
                self._await_return()
            else:
                self._await_registrations()
                self._started = True
                self._new_strategy().setup()
            assert self.strategy is not None
            for r in range(len(self.records) + 1, self.rounds + 1):
                rec = self._run_round(r)
                self.records.append(rec)
                self._save_checkpoint()
                if self.on_round is not None:
                    self.on_round(rec)
            finals = self._finalize()
            self._publish_archive()
            finished = True
            spec = self.strategy.global_spec
            return RunResult(
                algorithm=self.algorithm,
                rounds=list(self.records),
                clients=finals,
                wall_seconds=time.perf_counter() - t0,
                global_spec=spec.model_dump() if spec else None,
                bytes_out=self.transport.stats.bytes_out,
                bytes_in=self.transport.stats.bytes_in,
                extra=self.strategy.results(),
            )
        finally:
            if finished:
                self.shutdown()
            else:  # interrupted or failed: the clients wait for a coordinator to come back
                self._publish_status("offline")
                self.endpoint.close()

    def stop(self) -> None:
        """Abandon the current phase and return from `run()` by raising `Interrupted`; the
        last checkpoint holds every completed round (call from a signal handler or a thread)."""
        self._stop.set()

    def _new_strategy(self) -> Strategy:
        self.strategy = self.strategy_cls(
            self.config,
            clients=self.clients,
            global_spec=self._global_spec(),
            rounds=self.rounds,
            clients_per_round=self.clients_per_round,
            seed=self.seed,
            server_data=self.server_data,
        )
        return self.strategy

    # -- checkpoints -----------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        if self.checkpoint_path is None:
            return
        assert self.strategy is not None
        save_state(
            self.checkpoint_path,
            {
                "format": 1,
                "run": self.run_id,
                "algorithm": self.algorithm,
                "config": self.config.model_dump_json(),
                "rounds": self.rounds,
                "seed": self.seed,
                "incarnation": self.incarnation,
                "clients": [
                    {
                        "id": c.id,
                        "spec": c.spec.to_json(),
                        "capabilities": c.capabilities.model_dump_json(),
                    }
                    for c in self.clients.values()
                ],
                "records": [asdict(rec) for rec in self.records],
                "strategy": self.strategy.state_dict(),
            },
        )

    def restore(self) -> bool:
        """Load `checkpoint_path` when it exists: the registry, every completed round and the
        strategy's state (global model, random generator...). True when there was one."""
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return False
        try:
            state = load_state(self.checkpoint_path)
            keys = ("run", "algorithm", "config", "rounds", "seed")
            theirs = tuple(state[k] for k in keys)
        except (StateError, KeyError) as exc:
            raise CoordinatorError(f"cannot resume from {self.checkpoint_path}: {exc}") from exc
        ours = (self.run_id, self.algorithm, self.config.model_dump_json(), self.rounds, self.seed)
        if theirs != ours:
            raise CoordinatorError(
                f"the checkpoint {self.checkpoint_path} was written by a run with another "
                "run id, algorithm, config, round count or seed; start over with --fresh (or "
                "restore the original settings)"
            )
        for c in state["clients"]:
            spec = ArchSpec.from_json(c["spec"])
            caps = Capabilities.model_validate_json(c["capabilities"])
            self.clients[c["id"]] = ClientInfo(c["id"], spec, caps)
        self.records = [RoundRecord(**rec) for rec in state["records"]]
        self.incarnation = max(self.incarnation, int(state["incarnation"]) + 1)
        self._started = True
        self._new_strategy().setup()
        assert self.strategy is not None
        self.strategy.load_state_dict(state["strategy"])
        self._round = len(self.records)
        self._restored = state
        log.info(
            "resumed run %s after round %d (incarnation %d)",
            self.run_id,
            self._round,
            self.incarnation,
        )
        return True

    def _await_return(self) -> None:
        """After a restart: the clients see the new incarnation on the status topic and
        register again; wait for all of them (up to `register_timeout_s`)."""
        self.online.clear()
        self._publish_status("registering")
        deadline = time.monotonic() + self.rc.register_timeout_s
        while set(self.clients) - self.online:
            left = deadline - time.monotonic()
            env = self._receive(left) if left > 0 else None
            if env is None:
                log.warning("resuming without %s", sorted(set(self.clients) - self.online))
                return
            self._dispatch_control(env)

    def _publish_archive(self) -> None:
        """What clients that join after the run need, retained on the archive topic."""
        assert self.strategy is not None
        models = self.strategy.late_joiner_models()
        if not models:
            return
        config = self.config.model_dump(mode="json")
        publish_retained(
            self.endpoint,
            topics.archive(self.run_id),
            models,
            lambda refs: Archive(
                run=self.run_id,
                sender=topics.COORDINATOR,
                algorithm=self.algorithm,
                config=config,
                rounds=self.rounds,
                models=refs,
            ),
        )
        log.info("published %d archived models for late joiners", len(models))

    def shutdown(self, reason: str = "run finished") -> None:
        for cid in self.clients:
            self._send(cid, Shutdown(run=self.run_id, sender=topics.COORDINATOR, reason=reason))
        self._publish_status("finished")
        self.endpoint.close()

    def _status(self, phase: str) -> Status:
        return Status(
            run=self.run_id,
            sender=topics.COORDINATOR,
            incarnation=self.incarnation,
            phase=phase,
            round=self._round,
            rounds=self.rounds,
            algorithm=self.algorithm,
            accepting=not self._started,
        )

    def _publish_status(self, phase: str) -> None:
        try:
            self.endpoint.send(topics.status(self.run_id), self._status(phase), retain=True)
        except TransportError as exc:
            log.error("could not publish the run status (%s): %s", phase, exc)

    # -- registration ----------------------------------------------------------------------
    def _receive(self, timeout: float) -> Envelope | None:
        """The next envelope within `timeout` s; raises `Interrupted` once `stop()` was called."""
        deadline = time.monotonic() + timeout
        while True:
            if self._stop.is_set():
                raise Interrupted(f"stopped during round {self._round}")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            env = self.endpoint.receive(timeout=min(left, 0.25))
            if env is not None:
                return env

    def _await_back(self) -> None:
        """Before a retry, give clients that dropped out (a broker restart, a network blip)
        up to `deadline_s` to come back online."""
        deadline = time.monotonic() + self.rc.deadline_s
        while set(self.clients) - self.online:
            env = self._receive(deadline - time.monotonic())
            if env is None:
                return
            self._dispatch_control(env)

    def _drain(self) -> None:
        """Handle what already arrived between phases (registrations, presence, late replies)."""
        while (env := self.endpoint.receive(timeout=0)) is not None:
            self._dispatch_control(env)

    def _await_registrations(self) -> None:
        deadline = time.monotonic() + self.rc.register_timeout_s
        while len(self.clients) < self.expected_clients:
            env = self._receive(deadline - time.monotonic())
            if env is None:
                enough = (
                    self.rc.min_clients is not None and len(self.clients) >= self.rc.min_clients
                )
                if enough:
                    log.warning(
                        "starting with %d of %d expected clients (min_clients %d)",
                        len(self.clients),
                        self.expected_clients,
                        self.rc.min_clients,
                    )
                    break
                raise CoordinatorError(
                    f"only {len(self.clients)} of {self.expected_clients} clients registered "
                    f"within {self.rc.register_timeout_s:.0f} s (round.register_timeout_s: "
                    "--register-timeout SECONDS waits longer; --min-clients M starts with fewer)"
                )
            self._dispatch_control(env)
        log.info("%d clients registered", len(self.clients))

    def _sender(self, env: Envelope) -> str | None:
        """The client the message's topic names, when its `sender` field agrees; else None."""
        origin = topics.origin_of(env.topic, self.run_id)
        msg = env.message
        if origin is None or origin != msg.sender or msg.run != self.run_id:
            self._reject(
                "sender_mismatch",
                f"a {msg.kind} on {env.topic} claims sender {msg.sender!r} of run {msg.run!r}",
            )
            return None
        return origin

    def _reject(self, reason: str, detail: str) -> None:
        self.stats.rejected[reason] += 1
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
            self.online.add(cid)
        else:
            self.online.discard(cid)
            log.warning("%s went offline", cid)

    def _refusal(self, msg: Register) -> str | None:
        known = msg.sender in self.clients
        if self.allow is not None and msg.sender not in self.allow:
            return "this client id is not on the run's allow-list"
        if self._started and not known:
            return "the run has already started"
        if self._started and msg.spec != self.clients[msg.sender].spec:
            return "a client cannot change its architecture during a run"
        if not known and len(self.clients) >= self.expected_clients:
            return f"the federation is full ({self.expected_clients} clients)"
        if self.algorithm not in msg.capabilities.algorithms:
            return f"client does not support algorithm {self.algorithm!r}"
        if msg.spec.num_classes != msg.capabilities.num_classes:
            return (
                f"the model has {msg.spec.num_classes} classes but the client says its data has "
                f"{msg.capabilities.num_classes}"
            )
        try:  # the coordinator must be able to rebuild what the client runs, within the limit
            shapes = reference_shapes(msg.spec)
        except ModelZooError as exc:
            return str(exc)
        size = sum(t.numel() * t.element_size() for t in shapes.values())
        if size > self.max_blob_bytes:
            return f"the model needs {size} bytes, over the limit of {self.max_blob_bytes}"
        return None

    def _on_register(self, msg: Register) -> None:
        reason = self._refusal(msg)
        if reason is None:
            self.clients[msg.sender] = ClientInfo(msg.sender, msg.spec, msg.capabilities)
            self._on_presence(msg.sender, True, msg.epoch)
            log.info("registered %s (%s, %d train)", msg.sender, msg.spec, msg.capabilities.n_train)
        else:
            log.warning("refused registration of %s: %s", msg.sender, reason)
        self._send(
            msg.sender,
            Registered(
                run=self.run_id, sender=topics.COORDINATOR, accepted=reason is None, reason=reason
            ),
        )

    def _global_spec(self) -> ArchSpec | None:
        infos = list(self.clients.values())
        shapes = {c.spec.input_shape for c in infos}
        if len(shapes) > 1:
            raise CoordinatorError(f"clients disagree on the input shape: {sorted(shapes)}")
        family = self.global_model
        if family is None:  # one architecture everywhere: that is the global one
            distinct = {c.spec.to_json() for c in infos}
            return infos[0].spec if len(distinct) == 1 else None
        return ArchSpec(
            family=family,
            num_classes=max(c.capabilities.num_classes for c in infos),
            input_shape=infos[0].spec.input_shape,
            kwargs=self.model_kwargs.get(family, {}),
        )

    # -- rounds ----------------------------------------------------------------------------
    def _run_round(self, r: int) -> RoundRecord:
        assert self.strategy is not None
        t0 = time.perf_counter()
        self._round = r
        for attempt in range(self.rc.retries + 1):
            if attempt:
                log.warning("round %d: attempt %d of %d", r, attempt + 1, self.rc.retries + 1)
                self._await_back()
            self._drain()  # who is online now: the latest registrations and wills count
            self.strategy.available = set(self.online)
            trained: set[str] = set()
            for step in self.strategy.steps:  # one, or several with a barrier after each
                plan = self.strategy.configure_step(r, step)
                trained |= set(plan)
                replies = self._run_phase(r, "fit", plan, step=step)
                valid = {cid: rep for cid, rep in sorted(replies.items()) if rep is not None}
                counted = self.strategy.quorum_clients(plan)  # whose replies aggregation needs
                got = sum(cid in valid for cid in counted)
                need = max(1, math.ceil(self.rc.quorum * len(counted)))  # never over nobody
                failed = got < need
                if failed:
                    log.error(
                        "round %d%s: %d of %d valid replies, quorum needs %d; state unchanged",
                        r,
                        f" {step}" if step else "",
                        got,
                        len(counted),
                        need,
                    )
                    break
                replies_in = {
                    cid: FitReply(cid, v.models, v.metrics, v.n_samples, v.details)
                    for cid, v in valid.items()
                }
                try:
                    self.strategy.aggregate_step(r, step, replies_in)
                except (StrategyError, ValueError) as exc:  # bad replies cost the round only
                    failed = True
                    log.error("round %d: aggregation refused the replies: %s", r, exc)
                    break
            if not failed:
                break
        personal = glob = None
        per_client: dict[str, tuple[float | None, float | None]] = {}
        if r % self.rc.eval_every == 0 or r == self.rounds:
            scores = self._run_phase(r, "evaluate", self.strategy.configure_evaluate(r))
            personal, glob, per_client = _accuracies(scores)
        seconds = time.perf_counter() - t0
        self.stats.round_seconds.append(seconds)
        if failed:
            self.stats.rounds_failed += 1
        else:
            self.stats.rounds_completed += 1
        return RoundRecord(
            round=r,
            seconds=seconds,
            mean_personal_acc=personal,
            global_acc=glob,
            trained=sorted(trained),
            replied=sorted(valid),
            failed=failed,
            train_metrics=_mean_metrics(valid),
            client_details={cid: v.details for cid, v in valid.items() if v.details},
            client_acc={cid: p for cid, (p, _) in sorted(per_client.items())},
            online=sorted(self.online),
        )

    def _finalize(self) -> list[ClientResult]:
        assert self.strategy is not None
        scores = self._run_phase(self.rounds, "finalize", self.strategy.configure_finalize())
        _, _, per_client = _accuracies(scores)
        out = []
        for cid, info in sorted(self.clients.items()):
            p, g = per_client.get(cid, (None, None))
            reply = scores.get(cid)
            out.append(
                ClientResult(
                    id=cid,
                    arch=info.spec.family,
                    spec=info.spec.model_dump(),
                    n_train=info.capabilities.n_train,
                    personal_acc=p,
                    global_acc=g,
                    error=None if reply else "no valid finalize reply",
                    details=reply.details if reply else {},
                )
            )
        return out

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
        out = {}
        for cid, models in plan.items():
            refs: dict[str, ModelRef] = {}
            own: dict[str, bytes] = {}
            for name, m in models.items():
                key = _model_key(m)
                if key not in packed or not self.share_models:
                    shared = uses[key] > 1 and self.share_models
                    one_ref, one_blob = pack_models(
                        {name: m}, max_bytes=self.max_blob_bytes, shared=shared
                    )
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
                self.endpoint.wait(
                    self.endpoint.publish_blobs(topics.bcast(self.run_id), shared_blobs)
                )
            except TransportError as exc:
                log.error("broadcasting the shared models failed: %s", exc)
        return out

    def _run_phase(
        self, r: int, phase: Phase, plan: Mapping[str, Mapping[str, WireModel]], step: str = ""
    ) -> dict[str, _Collected | None]:
        """Send one task per planned client, collect replies until all or the deadline."""
        gone = sorted(set(plan) - self.online)
        if gone:
            log.warning("round %d %s: %s offline; no task for them", r, phase, gone)
            plan = {cid: models for cid, models in plan.items() if cid in self.online}
        assert self.strategy is not None
        self._publish_status(phase)
        config = self.config.model_dump(mode="json")
        pending: dict[str, str] = {}
        sent: dict[str, list[Delivery]] = {}
        for cid, (refs, blobs) in self._pack(plan).items():
            task = Task(
                run=self.run_id,
                sender=topics.COORDINATOR,
                task_id=f"{phase}{step and '.' + step}-{r}-{cid}-{unique_id(32)}",
                round=r,
                rounds=self.rounds,
                phase=phase,
                algorithm=self.algorithm,
                config=config,
                models=refs,
                step=step,
                params=self.strategy.task_params(r, step, cid) if phase == "fit" else {},
            )
            pending[task.task_id] = cid
            sent[cid] = self._send(cid, task, blobs, wait=False)
        for cid, deliveries in sent.items():  # acks come back while the others are still sent
            try:
                self.endpoint.wait(deliveries)
            except TransportError as exc:
                log.error("the %s task to %s was not delivered: %s", phase, cid, exc)
        results: dict[str, _Collected | None] = {cid: None for cid in plan}
        limit = self.rc.deadline_s
        if phase == "finalize" and self.rc.finalize_deadline_s is not None:
            limit = self.rc.finalize_deadline_s
        deadline = time.monotonic() + limit
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
                if isinstance(msg, Presence) and msg.sender not in self.online:
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
            self.online.add(sender)
            results[owner] = self._validate(owner, phase, msg, env.blobs)
        return results

    def _validate(
        self, cid: str, phase: str, msg: Reply, blobs: Mapping[str, Buffer]
    ) -> _Collected | None:
        assert self.strategy is not None
        if not msg.ok:
            log.error("%s failed its %s task: %s", cid, phase, msg.error)
            return None
        caps = self.clients[cid].capabilities
        try:
            problem = _metrics_problem(msg.metrics, caps.n_test)
            if problem is not None:
                raise ValueError(f"malformed metrics: {problem}")
            if msg.n_samples > caps.n_train:
                raise ValueError(
                    f"n_samples {msg.n_samples} exceeds the {caps.n_train} training samples "
                    "it registered"
                )
            models = unpack_models(
                msg.models,
                blobs,
                max_bytes=self.max_blob_bytes,
                partial=self.strategy.partial_models,
            )
            if phase == "fit":
                expected = self.strategy.expected_models(cid)
                got = {name: m.spec for name, m in models.items()}
                if got != expected:
                    raise ValueError(f"expected models {expected}, got {got}")
        except (ValueError, KeyError) as exc:
            self._reject("invalid_reply", f"{phase} reply from {cid}: {exc}")
            return None
        return _Collected(models, msg.metrics, msg.n_samples, dict(msg.details))

    def _send(
        self, cid: str, msg: Any, blobs: Mapping[str, bytes] | None = None, *, wait: bool = True
    ) -> list[Delivery]:
        try:
            return self.endpoint.send(topics.down(self.run_id, cid), msg, blobs, wait=wait)
        except (TransportError, ValueError) as exc:  # one unreachable client costs its reply
            log.error("could not send %s to %s: %s", msg.kind, cid, exc)
            return []


def _model_key(m: WireModel) -> tuple[str, int]:
    """Identity of a model in a plan: the same weights object under the same architecture."""
    return (m.spec.to_json(), id(m.weights))


def _metrics_problem(metrics: Mapping[str, float], n_test: int) -> str | None:
    """Why a reply's accuracy counts cannot be right, or None: every `X_correct` needs its
    `X_total`, counts are whole and non-negative, correct <= total <= the registered test size."""
    prefixes = {k.rsplit("_", 1)[0] for k in metrics if k.endswith(("_correct", "_total"))}
    for prefix in sorted(prefixes):
        correct, total = metrics.get(f"{prefix}_correct"), metrics.get(f"{prefix}_total")
        if correct is None or total is None:
            return f"{prefix}_correct and {prefix}_total come together"
        if min(correct, total) < 0 or correct != int(correct) or total != int(total):
            return f"{prefix} counts must be whole and non-negative ({correct}, {total})"
        if correct > total:
            return f"{prefix} accuracy above 1 ({correct} of {total})"
        if total > n_test:
            return f"{prefix}_total {total} exceeds the {n_test} test samples it registered"
    return None


def _accuracies(
    scores: Mapping[str, _Collected | None],
) -> tuple[float | None, float | None, dict[str, tuple[float | None, float | None]]]:
    """Mean personalized accuracy over clients, union global accuracy, per-client pairs."""
    per_client: dict[str, tuple[float | None, float | None]] = {}
    g_correct = g_total = 0.0
    for cid, s in scores.items():
        if s is None:
            continue
        m = s.metrics
        p = m["personal_correct"] / m["personal_total"] if m.get("personal_total") else None
        g = m["global_correct"] / m["global_total"] if m.get("global_total") else None
        if "global_total" in m:
            g_correct += m["global_correct"]
            g_total += m["global_total"]
        per_client[cid] = (p, g)
    ps = [p for p, _ in per_client.values() if p is not None]
    return (
        sum(ps) / len(ps) if ps else None,
        g_correct / g_total if g_total else None,
        per_client,
    )


def _mean_metrics(valid: Mapping[str, _Collected]) -> dict[str, float]:
    keys = {k for v in valid.values() for k in v.metrics}
    return {
        k: sum(v.metrics[k] for v in valid.values() if k in v.metrics)
        / sum(1 for v in valid.values() if k in v.metrics)
        for k in sorted(keys)
    }
