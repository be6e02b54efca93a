"""EdgeClient: the runtime a device app embeds.

It connects through a Transport, registers its ArchSpec and capabilities, then serves tasks on
its own worker thread: decode and validate the models, run its ClientAlgorithm, reply with the
models it produced. A task it cannot run gets an error reply; the client logs it and keeps
serving. The network callback only enqueues (see `edge_sdk.wire`).

It listens on its own down topic, the run's broadcast topic (models many tasks share) and the
coordinator's retained status topic; it publishes only on its own up topic (see
`edge_sdk.topics`). Its will announces it offline if the connection dies.

With a `state_dir` it persists its whole algorithm state (atomically) after every task that
changed it, and a restarted device (same id, same run) continues from there. A fit task for a
round it already trained (the coordinator restarted, or retried the round) starts from the state
it had before that round, so a repeated round trains exactly what the first attempt trained.

    client = EdgeClient.connect("mqtt://broker:1883", "phone7", spec, data, run_id="fl-1")
    client.run()             # blocks until the federation ends; or start() ... stop()
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError

from edge_sdk import topics
from edge_sdk.algorithms import (
    AlgorithmError,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    TaskInfo,
    algorithm_class,
    algorithm_names,
)
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, Buffer
from edge_sdk.cohort import Cohort
from edge_sdk.peers import PeerChannel
from edge_sdk.protocol import (
    Archive,
    Capabilities,
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
from edge_sdk.trainer import ClientData, Trainer
from edge_sdk.transport.base import Transport, TransportError

if TYPE_CHECKING:
    from edge_sdk.transport.mqtt import BrokerSettings
from edge_sdk.wire import Endpoint, message_frame, pack_models, read_retained, unpack_models
from model_zoo import ArchSpec

__all__ = ["EdgeClient", "TaskOutcome"]

log = logging.getLogger(__name__)

REGISTER_RETRY_S = 2.0
# How long an idle client waits for a message before looking at its flags again. stop() and a
# reconnection wake it at once; request_stop() (signal-safe: it only sets a flag) within this.
# Every wake-up costs CPU: with 0.2 s, 200 simulated clients spent ~7 % of a round waking.
IDLE_WAIT_S = 1.0
_SEEN_TASKS = 256  # task ids remembered to ignore QoS 1 redeliveries


@dataclass(frozen=True)
class TaskOutcome:
    """What a device app's per-round callback receives after each task."""

    round: int
    rounds: int
    phase: Phase
    ok: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class EdgeClient:
    """One device: its id, architecture, private data, and the algorithm state it accumulates.

    `onnx_path`: where to export the personalized model (verified) after the last round.
    `on_task`: called on the worker thread after every task (a per-round progress hook).
    `compute_gate` (optional) is a semaphore shared by simulated clients to bound how many train
    at once on one machine; a real device leaves it unset. So does `cohort`: simulated clients
    that share one train their fit tasks together as one stacked model (`edge_sdk.cohort`).
    """

    def __init__(
        self,
        client_id: str,
        spec: ArchSpec,
        data: ClientData,
        transport: Transport,
        *,
        run_id: str = "default",
        device: torch.device | str = "cpu",
        seed: int = 0,
        onnx_path: str | Path | None = None,
        class_names: list[str] | None = None,
        normalization: dict[str, list[float]] | None = None,
        fp16_upload: bool = False,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        compute_gate: threading.Semaphore | None = None,
        cohort: Cohort | None = None,
        on_task: Callable[[TaskOutcome], None] | None = None,
        owns_transport: bool = False,
        state_dir: str | Path | None = None,
    ) -> None:
        self.client_id = topics.check_id(client_id, "client id")
        self.run_id = topics.check_id(run_id, "run id")
        shape = tuple(data.x_train.shape[1:])
        if shape != tuple(spec.input_shape) or spec.num_classes != data.num_classes:
            raise ValueError(
                f"{client_id}: the model {spec} does not fit the data: inputs {shape} with "
                f"{data.num_classes} classes"
            )
        self.spec = spec
        self.device = torch.device(device)
        self.data = data.to(self.device)  # moved to the device once
        self.seed = seed
        self.onnx_path = Path(onnx_path) if onnx_path else None
        self.class_names = class_names
        self.normalization = normalization
        self.fp16_upload = fp16_upload
        self.max_blob_bytes = max_blob_bytes
        self.on_task = on_task
        self._gate = compute_gate
        self.cohort = cohort
        self.transport = transport
        self._owns_transport = owns_transport
        self._up = topics.up(run_id, client_id)
        self._status_topic = topics.status(run_id)
        self.endpoint = Endpoint(
            transport,
            [topics.down(run_id, client_id), topics.bcast(run_id), self._status_topic],
            shared_topic=topics.bcast(run_id),
            max_blob_bytes=max_blob_bytes,
        )
        self.peers = PeerChannel(
            transport,
            self.run_id,
            self.client_id,
            max_blob_bytes=max_blob_bytes,
            idle_gate=compute_gate,  # released while waiting on a peer, or peers never run
        )
        self.algorithm: ClientAlgorithm | None = None
        self._algo_key: tuple[str, str] | None = None
        self._stop = threading.Event()
        self._back = threading.Event()  # the connection came back: say we are online
        self._epoch_base = time.time_ns() // 1_000_000 * 1000  # a restart starts higher
        self._thread: threading.Thread | None = None
        self._seen: deque[str] = deque(maxlen=_SEEN_TASKS)
        self.accepted: bool | None = None
        self.status: Status | None = None  # the coordinator's last retained status
        self.finished = False  # the coordinator said the run is over
        self.tasks_done = 0
        self.errors: list[str] = []
        self.last_metrics: dict[str, float] = {}
        self.exported: Path | None = None
        self.state_path = Path(state_dir) / f"{self.client_id}.state" if state_dir else None
        self.resumed_after: int | None = None  # the fit round a restored state had reached
        self._fit_round = 0  # the last round this client trained
        self._fit_steps: list[str] = []  # the steps of that round it has run
        self._before_fit: dict[str, Any] | None = None  # its state before that round

    @classmethod
    def connect(
        cls,
        broker: str | BrokerSettings,
        client_id: str,
        spec: ArchSpec,
        data: ClientData,
        *,
        run_id: str = "default",
        device: torch.device | str = "cpu",
        seed: int = 0,
        onnx_path: str | Path | None = None,
        class_names: list[str] | None = None,
        normalization: dict[str, list[float]] | None = None,
        fp16_upload: bool = False,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        on_task: Callable[[TaskOutcome], None] | None = None,
        state_dir: str | Path | None = None,
    ) -> EdgeClient:
        """An EdgeClient over its own `MqttTransport` to `broker` (a URL or `BrokerSettings`);
        the other arguments are the constructor's.

        The MQTT session is named after the run and the client, so a restarted device resumes
        it (and receives what was queued for it while it was away).
        """
        from edge_sdk.transport.mqtt import MqttTransport

        transport = MqttTransport(broker, f"edgefl-{run_id}-{client_id}")
        return cls(
            client_id,
            spec,
            data,
            transport,
            run_id=run_id,
            device=device,
            seed=seed,
            onnx_path=onnx_path,
            class_names=class_names,
            normalization=normalization,
            fp16_upload=fp16_upload,
            max_blob_bytes=max_blob_bytes,
            on_task=on_task,
            owns_transport=True,
            state_dir=state_dir,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> EdgeClient:
        """Connect, subscribe, register, and serve tasks on a worker thread until the run ends."""
        if self.state_path is not None and self.algorithm is None:
            self._restore()
        self.transport.set_will(
            self._up,
            lambda n: message_frame(
                Presence(run=self.run_id, sender=self.client_id, online=False, epoch=self._epoch(n))
            ),
        )
        self.transport.on_reconnect = self._reconnected
        self.transport.connect()
        self.endpoint.open()
        self.peers.open()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._serve, name=f"edgefl-client-{self.client_id}", daemon=True
        )
        self._thread.start()
        return self

    def run(self, timeout: float | None = None) -> dict[str, float]:
        """Start (if needed) and block until the federation ends; the final metrics."""
        if self._thread is None:
            self.start()
        try:
            if not self.wait(timeout):
                raise TimeoutError(f"{self.client_id}: the federation did not end in {timeout} s")
        finally:
            self.stop()
        return dict(self.last_metrics)

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
        )
        if got is None:
            raise TimeoutError(
                f"{self.client_id}: run {self.run_id!r} has published no archive in {timeout} s "
                "(it is not finished, or its algorithm keeps none: PersFL does)"
            )
        archive, models = got
        assert isinstance(archive, Archive)
        algo = self._algorithm_for(archive.algorithm, archive.config)
        algo.ctx.task = TaskInfo("", {})
        result = algo.finalize(archive.rounds, archive.rounds, models)
        self.finished, self.last_metrics = True, dict(result.metrics)
        self._finalized()
        return result

    def register(self) -> None:
        d = self.data
        caps = Capabilities(
            device=str(self.device),
            n_train=len(d.y_train),
            n_val=len(d.y_val),
            n_test=len(d.y_test),
            num_classes=d.num_classes,
            algorithms=algorithm_names(),
        )
        msg = Register(
            run=self.run_id,
            sender=self.client_id,
            spec=self.spec,
            capabilities=caps,
            epoch=self._epoch(self.transport.connection),
        )
        self._try_send(msg)

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
        self.endpoint.close()
        self.peers.close()
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
        self.register()
        last_register = time.monotonic()
        while not self._stop.is_set():
            if self._back.is_set():  # our will may have marked us offline meanwhile
                self._back.clear()
                epoch = self._epoch(self.transport.connection)
                self._try_send(
                    Presence(run=self.run_id, sender=self.client_id, online=True, epoch=epoch)
                )
            wait = IDLE_WAIT_S
            if self.accepted is None:  # the next registration is due sooner
                wait = min(wait, max(0.0, last_register + REGISTER_RETRY_S - time.monotonic()))
            env = self.endpoint.receive(timeout=wait)
            if env is None:
                # Until the coordinator answers, registrations may have been lost (it was not
                # listening yet): say hello again every few seconds.
                if self.accepted is None and time.monotonic() - last_register >= REGISTER_RETRY_S:
                    self.register()
                    last_register = time.monotonic()
                continue
            msg = env.message
            if msg.run != self.run_id or msg.sender != topics.COORDINATOR:
                log.warning(
                    "%s: ignoring %s from %s/%s", self.client_id, msg.kind, msg.run, msg.sender
                )
                continue
            if env.topic == self._status_topic:
                if isinstance(msg, Status):
                    self._on_status(msg)
                    last_register = time.monotonic()
                continue
            if env.topic != topics.down(self.run_id, self.client_id):
                log.warning("%s: ignoring a %s message on %s", self.client_id, msg.kind, env.topic)
                continue
            if isinstance(msg, Shutdown):
                log.info("%s: shutdown: %s", self.client_id, msg.reason)
                self.finished = True
                return
            if isinstance(msg, Registered):
                self.accepted = msg.accepted
                if not msg.accepted:
                    log.error("%s: registration refused: %s", self.client_id, msg.reason)
                continue
            if isinstance(msg, Task):
                if msg.task_id in self._seen:
                    log.info("%s: ignoring a redelivered task %s", self.client_id, msg.task_id)
                    continue
                self._seen.append(msg.task_id)
                self._handle(msg, env.blobs)
                continue
            log.warning("%s: ignoring unexpected %s message", self.client_id, msg.kind)

    def _reconnected(self) -> None:
        self._back.set()
        self.endpoint.interrupt()

    def _on_status(self, status: Status) -> None:
        previous, self.status = self.status, status
        if previous is not None and previous.incarnation != status.incarnation:
            log.info("%s: the coordinator restarted; registering again", self.client_id)
            self.accepted = None
            self.register()
        elif status.accepting and self.accepted is None:
            self.register()

    def _handle(self, task: Task, blobs: Mapping[str, Buffer]) -> None:
        out_blobs: dict[str, bytes] = {}
        cohort = self._cohort_for(task)
        if cohort is not None:
            cohort.announce(self.client_id)
        try:
            with self._gate or nullcontext():
                result = self.run_task(task, blobs)
            refs, out_blobs = pack_models(
                result.models, fp16=self.fp16_upload, max_bytes=self.max_blob_bytes
            )
            outcome: dict[str, Any] = {
                "ok": True,
                "n_samples": result.n_samples,
                "metrics": result.metrics,
                "details": result.details,
                "models": refs,
            }
            reply = self._reply(task, outcome)
        except Exception as exc:  # the client reports and keeps serving
            log.exception("%s: task %s (%s) failed", self.client_id, task.task_id, task.phase)
            error = f"{type(exc).__name__}: {exc}"[:2000]
            self.errors.append(error)
            out_blobs = {}
            reply = self._reply(task, {"ok": False, "error": error})
        finally:
            if cohort is not None:
                cohort.withdraw(self.client_id)
        try:
            self._send(reply, out_blobs)
        except TransportError as exc:
            log.error("%s: could not send the reply to %s: %s", self.client_id, task.task_id, exc)
        self.tasks_done += 1
        if reply.ok:
            self.last_metrics = dict(reply.metrics)
        if self.on_task is not None:
            outcome_ = TaskOutcome(
                task.round, task.rounds, task.phase, reply.ok, dict(reply.metrics), reply.error
            )
            try:
                self.on_task(outcome_)
            except Exception:  # the app's callback must not stop the client
                log.exception("%s: on_task callback failed", self.client_id)

    def _cohort_for(self, task: Task) -> Cohort | None:
        """The cohort this task trains in: a fit task of an algorithm that trains stacked."""
        if self.cohort is None or task.phase != "fit":
            return None
        try:
            return self.cohort if algorithm_class(task.algorithm).stackable else None
        except AlgorithmError:
            return None  # run_task reports the unknown algorithm

    def _reply(self, task: Task, outcome: dict[str, Any]) -> Reply:
        base = {
            "run": self.run_id,
            "sender": self.client_id,
            "task_id": task.task_id,
            "round": task.round,
            "phase": task.phase,
        }
        try:
            return Reply.model_validate(base | outcome)
        except ValidationError as exc:  # e.g. a NaN metric: say so instead of dying
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            error = f"the reply does not validate: {where}: {first.get('msg')}"
            log.error("%s: task %s: %s", self.client_id, task.task_id, error)
            return Reply.model_validate(base | {"ok": False, "error": error})

    def run_task(self, task: Task, blobs: Mapping[str, Buffer]) -> FitResult:
        """Decode the task's models, run the algorithm phase, export ONNX after the last one."""
        algo = self._algorithm_for(task.algorithm, task.config)
        algo.ctx.task = TaskInfo(task.step, dict(task.params))
        models = unpack_models(
            task.models, blobs, max_bytes=self.max_blob_bytes, partial=algo.partial_models
        )
        if task.phase == "fit":
            if self.state_path is not None:
                # A step run again means the round is being redone: from the state before it.
                # The next step of the same round (multi-step rounds) goes on from here.
                if task.round != self._fit_round or self._before_fit is None:
                    self._before_fit, self._fit_steps = algo.state_dict(), []
                elif task.step in self._fit_steps:
                    log.info(
                        "%s: round %d again: from the state before it", self.client_id, task.round
                    )
                    algo.load_state_dict(self._before_fit)
                    self._fit_steps = []
                self._fit_round = task.round
                self._fit_steps.append(task.step)
            cohort = self._cohort_for(task)
            if cohort is not None:
                result = cohort.fit(self.client_id, algo, task.round, task.rounds, models)
            else:
                result = algo.fit(task.round, task.rounds, models)
            self._save()
            return result
        if task.phase == "evaluate":
            return FitResult(metrics=algo.evaluate(models))
        result = algo.finalize(task.round, task.rounds, models)
        self._finalized()
        return result

    def _finalized(self) -> None:
        """After the finalize phase: persist, then export the personalized model if asked."""
        self._save()
        if self.onnx_path is not None:
            self.exported = self.export_onnx()
            log.info("%s: exported its personalized model to %s", self.client_id, self.exported)

    # -- persistence -----------------------------------------------------------------------
    def _save(self) -> None:
        """Write the algorithm's whole state (atomically) before the reply goes out."""
        if self.state_path is None or self.algorithm is None or self._algo_key is None:
            return
        save_state(
            self.state_path,
            {
                "run": self.run_id,
                "client": self.client_id,
                "algorithm": self._algo_key[0],
                "config": self._algo_key[1],
                "fit_round": self._fit_round,
                "fit_steps": list(self._fit_steps),
                "before_fit": self._before_fit,
                "state": self.algorithm.state_dict(),
            },
        )

    def _restore(self) -> None:
        """Continue from a state this client saved in this run (a restarted device)."""
        assert self.state_path is not None
        if not self.state_path.exists():
            return
        try:
            saved = load_state(self.state_path)
            if (saved["run"], saved["client"]) != (self.run_id, self.client_id):
                log.warning(
                    "%s: %s belongs to %s/%s; starting fresh",
                    self.client_id,
                    self.state_path,
                    saved["run"],
                    saved["client"],
                )
                return
            algo = self._new_algorithm(saved["algorithm"], json.loads(saved["config"]))
            algo.load_state_dict(saved["state"])
        except (StateError, KeyError, ValueError) as exc:
            raise StateError(
                f"{self.client_id}: cannot resume from {self.state_path}: {exc}"
            ) from exc
        self._fit_round, self._before_fit = int(saved["fit_round"]), saved["before_fit"]
        self._fit_steps = [str(s) for s in saved.get("fit_steps", [""])]
        self.resumed_after = self._fit_round
        log.info(
            "%s: resumed from %s (trained up to round %d)",
            self.client_id,
            self.state_path,
            self._fit_round,
        )

    def _new_algorithm(self, name: str, config: dict[str, Any]) -> ClientAlgorithm:
        cls = algorithm_class(name)
        cfg: BaseAlgorithmConfig = cls.config_cls.model_validate(config)
        ctx = ClientContext(
            client_id=self.client_id,
            spec=self.spec,
            data=self.data,
            device=self.device,
            seed=self.seed,
            trainer=Trainer(self.device, seed=self.seed),
            peers=self.peers,
        )
        self.algorithm, self._algo_key = cls(ctx, cfg), (name, cfg.model_dump_json())
        return self.algorithm

    def _algorithm_for(self, name: str, config: dict[str, Any]) -> ClientAlgorithm:
        cls = algorithm_class(name)
        cfg: BaseAlgorithmConfig = cls.config_cls.model_validate(config)
        key = (name, cfg.model_dump_json())
        if self.algorithm is None:
            return self._new_algorithm(name, config)
        if key != self._algo_key:
            # Never wipe what this device has learned because one task says otherwise.
            raise AlgorithmError(
                f"{self.client_id}: the task's {name} config differs from the one this client "
                "trained with in this run; its state is kept. Start a new run id to change it."
            )
        return self.algorithm

    def _send(self, msg: Any, blobs: dict[str, bytes] | None = None) -> None:
        self.endpoint.send(self._up, msg, blobs)

    def _epoch(self, connection: int) -> int:
        return self._epoch_base + connection

    def _try_send(self, msg: Any) -> None:
        """Send a control message; a transport failure is logged (the serving loop goes on)."""
        try:
            self._send(msg)
        except TransportError as exc:
            log.warning("%s: could not send %s: %s", self.client_id, msg.kind, exc)

    # -- export ----------------------------------------------------------------------------
    def export_onnx(self, path: str | Path | None = None) -> Path:
        """Export the personalized model to ONNX (verified against PyTorch)."""
        from edge_sdk.export import export_onnx

        if self.algorithm is None:
            raise RuntimeError(f"{self.client_id}: nothing trained yet, no model to export")
        target = Path(path) if path else self.onnx_path
        if target is None:
            raise ValueError(f"{self.client_id}: no ONNX path given")
        spec, model = self.algorithm.personalized_model()
        return export_onnx(
            model,
            spec,
            target,
            class_names=self.class_names,
            normalization=self.normalization,
            sample_inputs=self.data.x_test[:8].cpu() if len(self.data.x_test) else None,
        )
