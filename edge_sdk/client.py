"""EdgeClient: the runtime a device app embeds.

It connects through a Transport, registers its ArchSpec and capabilities, then serves tasks on
its own worker thread: decode and validate the models, run its ClientAlgorithm, reply with the
models it produced. A task it cannot run gets an error reply; the client logs it and keeps
serving. The network callback only enqueues (see `edge_sdk.wire`).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from edge_sdk import topics
from edge_sdk.algorithms import (
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    algorithm_class,
    algorithm_names,
)
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES
from edge_sdk.protocol import Capabilities, Register, Registered, Reply, Shutdown, Task
from edge_sdk.trainer import ClientData, Trainer
from edge_sdk.transport.base import Transport
from edge_sdk.wire import Endpoint, pack_models, unpack_models
from model_zoo import ArchSpec

__all__ = ["EdgeClient"]

log = logging.getLogger(__name__)

REGISTER_RETRY_S = 2.0


class EdgeClient:
    """One device: its id, architecture, private data, and the algorithm state it accumulates.

    `compute_gate` (optional) is a semaphore shared by simulated clients to bound how many train
    at once on one machine; a real device leaves it unset.
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
        self._gate = compute_gate
        self.endpoint = Endpoint(
            transport, topics.client_inbox(run_id, client_id), max_blob_bytes=max_blob_bytes
        )
        self.algorithm: ClientAlgorithm | None = None
        self._algo_key: tuple[str, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.accepted: bool | None = None
        self.tasks_done = 0
        self.errors: list[str] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> EdgeClient:
        """Subscribe, register, and serve tasks on a worker thread until Shutdown or stop()."""
        self.endpoint.open()
        self._thread = threading.Thread(
            target=self._serve, name=f"edgefl-client-{self.client_id}", daemon=True
        )
        self._thread.start()
        self.register()
        return self

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
        msg = Register(run=self.run_id, sender=self.client_id, spec=self.spec, capabilities=caps)
        self.endpoint.send(topics.coordinator_inbox(self.run_id), msg)

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.endpoint.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the client has shut down; True when it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- serving ---------------------------------------------------------------------------
    def _serve(self) -> None:
        last_register = time.monotonic()
        while not self._stop.is_set():
            env = self.endpoint.receive(timeout=0.2)
            if env is None:
                # Until the coordinator answers, registrations may have been lost (it was not
                # listening yet): say hello again every few seconds.
                if self.accepted is None and time.monotonic() - last_register > REGISTER_RETRY_S:
                    self.register()
                    last_register = time.monotonic()
                continue
            msg = env.message
            if isinstance(msg, Shutdown):
                log.info("%s: shutdown: %s", self.client_id, msg.reason)
                return
            if isinstance(msg, Registered):
                self.accepted = msg.accepted
                if not msg.accepted:
                    log.error("%s: registration refused: %s", self.client_id, msg.reason)
                continue
            if isinstance(msg, Task):
                self._handle(msg, env.blobs)
                continue
            log.warning("%s: ignoring unexpected %s message", self.client_id, msg.kind)

    def _handle(self, task: Task, blobs: dict[str, bytes]) -> None:
        out_blobs: dict[str, bytes] = {}
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
                "models": refs,
            }
        except Exception as exc:  # the client reports and keeps serving
            log.exception("%s: task %s (%s) failed", self.client_id, task.task_id, task.phase)
            self.errors.append(f"{type(exc).__name__}: {exc}")
            out_blobs = {}
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        reply = Reply.model_validate(
            {
                "run": self.run_id,
                "sender": self.client_id,
                "task_id": task.task_id,
                "round": task.round,
                "phase": task.phase,
                **outcome,
            }
        )
        self.endpoint.send(topics.coordinator_inbox(self.run_id), reply, out_blobs)
        self.tasks_done += 1

    def run_task(self, task: Task, blobs: dict[str, bytes]) -> FitResult:
        """Decode the task's models, run the algorithm phase, export ONNX when asked."""
        algo = self._algorithm_for(task.algorithm, task.config)
        models = unpack_models(
            task.models, blobs, max_bytes=self.max_blob_bytes, partial=algo.partial_models
        )
        if task.phase == "fit":
            return algo.fit(task.round, task.rounds, models)
        if task.phase == "evaluate":
            return FitResult(metrics=algo.evaluate(models))
        result = algo.finalize(task.round, task.rounds, models)
        if task.export_onnx:
            path = self.export_onnx()
            log.info("%s: exported its personalized model to %s", self.client_id, path)
        return result

    def _algorithm_for(self, name: str, config: dict[str, Any]) -> ClientAlgorithm:
        cls = algorithm_class(name)
        cfg: BaseAlgorithmConfig = cls.config_cls.model_validate(config)
        key = (name, cfg.model_dump_json())
        if self.algorithm is None or key != self._algo_key:
            if self.algorithm is not None:
                log.warning("%s: algorithm config changed; starting fresh state", self.client_id)
            ctx = ClientContext(
                client_id=self.client_id,
                spec=self.spec,
                data=self.data,
                device=self.device,
                seed=self.seed,
                trainer=Trainer(self.device, seed=self.seed),
            )
            self.algorithm, self._algo_key = cls(ctx, cfg), key
        return self.algorithm

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
