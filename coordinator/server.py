"""The Coordinator: client registry, round clock with deadlines and quorum, the one round loop.

A round: the strategy picks clients and the models each receives → tasks go out through the
transport → replies are collected until all arrive or the deadline passes → each reply is
validated (round and task id, schema, model names, architectures, shapes, finite values) → if
enough valid replies arrived (quorum) the strategy aggregates, else the round is recorded as
failed and the state is left as it was → checkpoint hook → evaluation on every client.
After the last round a finalize task goes to every client (fine-tuning, ONNX export) and the
final per-client scores come back with it. Bad messages are logged and dropped; the loop goes on.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coordinator.strategies import (
    ClientInfo,
    FitReply,
    Strategy,
    StrategyError,
    strategy_class,
)
from edge_sdk import topics
from edge_sdk.algorithms import BaseAlgorithmConfig
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, WireModel
from edge_sdk.protocol import Phase, Register, Registered, Reply, Shutdown, Task
from edge_sdk.transport.base import Transport
from edge_sdk.wire import Endpoint, pack_models, reference_shapes, unpack_models
from model_zoo import ArchSpec, ModelZooError

__all__ = [
    "ClientResult",
    "Coordinator",
    "CoordinatorError",
    "RoundConfig",
    "RoundRecord",
    "RunResult",
]

log = logging.getLogger(__name__)


class CoordinatorError(RuntimeError):
    """The run cannot go on (too few clients registered, incompatible federation)."""


class RoundConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    deadline_s: float = Field(600.0, gt=0)  # per phase of a round
    quorum: float = Field(1.0, gt=0, le=1)  # fraction of a round's tasks that must reply validly
    register_timeout_s: float = Field(60.0, gt=0)
    eval_every: int = Field(1, ge=1)  # evaluate on all clients every N rounds (and the last)


@dataclass
class RoundRecord:
    round: int
    seconds: float
    mean_personal_acc: float | None
    global_acc: float | None
    trained: list[str]
    replied: list[str]
    failed: bool = False
    train_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ClientResult:
    id: str
    arch: str
    spec: dict[str, Any]
    n_train: int
    personal_acc: float | None
    global_acc: float | None
    error: str | None = None


@dataclass
class RunResult:
    algorithm: str
    rounds: list[RoundRecord]
    clients: list[ClientResult]
    wall_seconds: float
    global_spec: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Collected:
    models: dict[str, WireModel]
    metrics: dict[str, float]
    n_samples: int


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
        global_model: str | None = None,
        model_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        round_config: RoundConfig | None = None,
        run_id: str = "default",
        seed: int = 0,
        export_onnx: bool = False,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        on_round: Callable[[RoundRecord], None] | None = None,
        checkpoint: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        if rounds < 1 or expected_clients < 1:
            raise ValueError(
                f"need rounds >= 1 and expected_clients >= 1, got {rounds}, {expected_clients}"
            )
        self.algorithm = algorithm
        self.strategy_cls = strategy_class(algorithm)
        self.config = config
        self.rounds = rounds
        self.expected_clients = expected_clients
        self.clients_per_round = clients_per_round
        self.global_model = global_model
        self.model_kwargs = {k: dict(v) for k, v in (model_kwargs or {}).items()}
        self.rc = round_config or RoundConfig()
        self.run_id = topics.check_id(run_id, "run id")
        self.seed = seed
        self.export_onnx = export_onnx
        self.max_blob_bytes = max_blob_bytes
        self.on_round = on_round
        self.checkpoint = checkpoint
        self.endpoint = Endpoint(
            transport, topics.coordinator_inbox(run_id), max_blob_bytes=max_blob_bytes
        )
        self.clients: dict[str, ClientInfo] = {}
        self.strategy: Strategy | None = None
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Coordinator:
        """Start listening (before clients register)."""
        self.endpoint.open()
        return self

    def run(self) -> RunResult:
        self.open()
        t0 = time.perf_counter()
        try:
            self._await_registrations()
            self._started = True
            global_spec = self._global_spec()
            self.strategy = self.strategy_cls(
                self.config,
                clients=self.clients,
                global_spec=global_spec,
                rounds=self.rounds,
                clients_per_round=self.clients_per_round,
                seed=self.seed,
            )
            self.strategy.setup()
            records = []
            for r in range(1, self.rounds + 1):
                rec = self._round(r)
                records.append(rec)
                if self.on_round is not None:
                    self.on_round(rec)
            finals = self._finalize()
            return RunResult(
                algorithm=self.algorithm,
                rounds=records,
                clients=finals,
                wall_seconds=time.perf_counter() - t0,
                global_spec=global_spec.model_dump() if global_spec else None,
            )
        finally:
            self.shutdown()

    def shutdown(self, reason: str = "run finished") -> None:
        for cid in self.clients:
            try:
                self._send(cid, Shutdown(run=self.run_id, sender="coordinator", reason=reason))
            except Exception:
                log.exception("could not send shutdown to %s", cid)
        self.endpoint.close()

    # -- registration ----------------------------------------------------------------------
    def _await_registrations(self) -> None:
        deadline = time.monotonic() + self.rc.register_timeout_s
        while len(self.clients) < self.expected_clients:
            env = self.endpoint.receive(timeout=max(0.0, deadline - time.monotonic()))
            if env is None:
                raise CoordinatorError(
                    f"only {len(self.clients)} of {self.expected_clients} clients registered "
                    f"within {self.rc.register_timeout_s:.0f} s"
                )
            self._dispatch_control(env.message)
        log.info("%d clients registered", len(self.clients))

    def _dispatch_control(self, msg: Any) -> None:
        if isinstance(msg, Register):
            self._on_register(msg)
        else:
            log.info("ignoring %s from %s outside its phase", msg.kind, msg.sender)

    def _on_register(self, msg: Register) -> None:
        reason = None
        if msg.run != self.run_id:
            reason = f"run id {msg.run!r} is not this run ({self.run_id!r})"
        elif self._started and msg.sender not in self.clients:
            reason = "the run has already started"
        elif self._started and msg.spec != self.clients[msg.sender].spec:
            reason = "a client cannot change its architecture during a run"
        elif self.algorithm not in msg.capabilities.algorithms:
            reason = f"client does not support algorithm {self.algorithm!r}"
        else:
            try:  # the coordinator must be able to rebuild what the client runs
                reference_shapes(msg.spec)
            except ModelZooError as exc:
                reason = str(exc)
        if reason is None:
            self.clients[msg.sender] = ClientInfo(msg.sender, msg.spec, msg.capabilities)
            log.info("registered %s (%s, %d train)", msg.sender, msg.spec, msg.capabilities.n_train)
        else:
            log.warning("refused registration of %s: %s", msg.sender, reason)
        self._send(
            msg.sender,
            Registered(
                run=self.run_id, sender="coordinator", accepted=reason is None, reason=reason
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
    def _round(self, r: int) -> RoundRecord:
        assert self.strategy is not None
        t0 = time.perf_counter()
        plan = self.strategy.configure_fit(r)
        replies = self._run_phase(r, "fit", plan)
        valid = {cid: rep for cid, rep in sorted(replies.items()) if rep is not None}
        counted = self.strategy.quorum_clients(plan)  # whose replies the aggregation needs
        got = sum(cid in valid for cid in counted)
        need = math.ceil(self.rc.quorum * len(counted))
        failed = got < need
        if failed:
            log.error(
                "round %d: %d of %d valid replies, quorum needs %d; state unchanged",
                r,
                got,
                len(counted),
                need,
            )
        else:
            replies_in = {
                cid: FitReply(cid, v.models, v.metrics, v.n_samples) for cid, v in valid.items()
            }
            try:
                self.strategy.aggregate_fit(r, replies_in)
            except (StrategyError, ValueError) as exc:  # bad replies cost the round, not the run
                failed = True
                log.error("round %d: aggregation refused the replies: %s", r, exc)
            if not failed and self.checkpoint is not None:
                self.checkpoint(r, {"round": r, "strategy": self.strategy.state_dict()})
        personal = glob = None
        if r % self.rc.eval_every == 0 or r == self.rounds:
            scores = self._run_phase(r, "evaluate", self._broadcast(self.strategy.eval_models()))
            personal, glob, _ = _accuracies(scores)
        return RoundRecord(
            round=r,
            seconds=time.perf_counter() - t0,
            mean_personal_acc=personal,
            global_acc=glob,
            trained=sorted(plan),
            replied=sorted(valid),
            failed=failed,
            train_metrics=_mean_metrics(valid),
        )

    def _finalize(self) -> list[ClientResult]:
        assert self.strategy is not None
        scores = self._run_phase(
            self.rounds, "finalize", self._broadcast(self.strategy.finalize_models())
        )
        _, _, per_client = _accuracies(scores)
        out = []
        for cid, info in self.clients.items():
            p, g = per_client.get(cid, (None, None))
            out.append(
                ClientResult(
                    id=cid,
                    arch=info.spec.family,
                    spec=info.spec.model_dump(),
                    n_train=info.capabilities.n_train,
                    personal_acc=p,
                    global_acc=g,
                    error=None if scores.get(cid) else "no valid finalize reply",
                )
            )
        return out

    def _broadcast(self, models: dict[str, WireModel]) -> dict[str, dict[str, WireModel]]:
        return {cid: models for cid in self.clients}

    def _run_phase(
        self, r: int, phase: Phase, plan: Mapping[str, Mapping[str, WireModel]]
    ) -> dict[str, _Collected | None]:
        """Send one task per planned client, collect replies until all or the deadline."""
        config = self.config.model_dump(mode="json")
        packed: dict[int, tuple[dict, dict]] = {}  # models shared by many tasks are encoded once
        pending: dict[str, str] = {}
        for cid, models in plan.items():
            key = id(models)
            if key not in packed:
                packed[key] = pack_models(models, max_bytes=self.max_blob_bytes)
            refs, blobs = packed[key]
            task = Task(
                run=self.run_id,
                sender="coordinator",
                task_id=f"{phase}-{r}-{cid}-{uuid.uuid4().hex[:8]}",
                round=r,
                rounds=self.rounds,
                phase=phase,
                algorithm=self.algorithm,
                config=config,
                models=refs,
                export_onnx=self.export_onnx and phase == "finalize",
            )
            pending[task.task_id] = cid
            self._send(cid, task, blobs)
        results: dict[str, _Collected | None] = {cid: None for cid in plan}
        deadline = time.monotonic() + self.rc.deadline_s
        while pending:
            left = deadline - time.monotonic()
            env = self.endpoint.receive(timeout=max(0.0, left)) if left > 0 else None
            if env is None:
                log.warning(
                    "round %d %s: deadline passed; no reply from %s",
                    r,
                    phase,
                    sorted(pending.values()),
                )
                break
            msg = env.message
            if not isinstance(msg, Reply):
                self._dispatch_control(msg)
                continue
            owner = pending.get(msg.task_id)
            if owner is None or owner != msg.sender or msg.round != r:
                log.warning("dropping stale or unknown reply %s from %s", msg.task_id, msg.sender)
                continue
            del pending[msg.task_id]
            results[owner] = self._validate(owner, phase, msg, env.blobs)
        return results

    def _validate(
        self, cid: str, phase: str, msg: Reply, blobs: dict[str, bytes]
    ) -> _Collected | None:
        assert self.strategy is not None
        if not msg.ok:
            log.error("%s failed its %s task: %s", cid, phase, msg.error)
            return None
        try:
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
            log.error("invalid %s reply from %s dropped: %s", phase, cid, exc)
            return None
        return _Collected(models, msg.metrics, msg.n_samples)

    def _send(self, cid: str, msg: Any, blobs: Mapping[str, bytes] | None = None) -> None:
        self.endpoint.send(topics.client_inbox(self.run_id, cid), msg, blobs)


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
