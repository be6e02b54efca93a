"""What the network fleet announces to every client: the run's retained status (phase, round,
incarnation, whether it still admits clients, and the largest models a message of the run
carries), and the reassembly bounds that follow those models' size (the base of
`coordinator.fleet.network.NetworkFleet`, which sets the state declared here)."""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod

from coordinator.fleet.base import Fleet
from edge_sdk import topics
from edge_sdk.model_blobs import model_bytes
from edge_sdk.protocol import Status
from edge_sdk.transport.base import Transport, TransportError
from edge_sdk.wire import DEFAULT_CHUNK_BYTES, Endpoint

__all__ = ["STATUS_AGAIN_S", "STATUS_REFRESH_S", "RunStatus"]

log = logging.getLogger(__name__)

# The fleet reads its own retained status topic back: when what the broker holds is not the
# status it published last (anyone on an open broker may replay a finished run's, retained),
# it publishes it again at once (at most every STATUS_AGAIN_S). Besides, it publishes it again
# every STATUS_REFRESH_S, for brokers that lose retained messages (a cluster whose nodes do not
# share them: clients there still receive it live). Every publication reaches every device:
# before, one every 2 s was the largest cost of 10,000 idle devices to the broker.
STATUS_AGAIN_S = 0.5
STATUS_REFRESH_S = 30.0


class RunStatus(Fleet):
    """A fleet that publishes the run's status (`_publish_status`) and sizes reassembly for the
    run's models (`_grow`, `_resize`, `_pending_bound`)."""

    transport: Transport
    endpoint: Endpoint | None
    _round: int
    _phase: str
    _model_bytes: int
    _status_at: float
    _status_frame: bytes
    _status_replaced: threading.Event

    @property
    @abstractmethod
    def _endpoint(self) -> Endpoint:
        """The open endpoint (the fleet's)."""

    def _grow(self, nbytes: int) -> None:
        """The run's messages may carry `nbytes` of models: size reassembly for it."""
        if nbytes > self._model_bytes:
            self._model_bytes = nbytes
            self._resize()

    def _resize(self) -> None:
        if self.endpoint is None or self._run is None:
            return
        specs = [info.spec for info in self.clients.values()]
        largest = max((model_bytes(s) for s in specs), default=0)
        self._model_bytes = max(self._model_bytes, 2 * largest)  # e.g. its own and the global
        bound = self._per_client_bound()
        self.endpoint.set_limits(
            max_pending_bytes=bound,
            max_total_pending_bytes=bound * max(4, self.run.expected_clients),
        )

    def _per_client_bound(self) -> int:
        """What one registered client may have in reassembly: a reply's models twice (one
        arriving while the last is still being claimed) and a chunk."""
        return 2 * self._model_bytes + 2 * DEFAULT_CHUNK_BYTES

    def _pending_bound(self, topic: str) -> int:
        """Reassembly memory per topic: none for a sender that is not registered."""
        cid = topics.origin_of(topic, self.run.run_id)
        return self._per_client_bound() if cid is not None and cid in self.clients else 0

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
            model_bytes=self._model_bytes,
        )

    def _publish_status(self, phase: str) -> None:
        self._phase, self._status_at = phase, time.monotonic()
        topic = topics.status(self.run.run_id)
        self._status_frame = frame = self._endpoint.frame(topic, self._status(phase))
        try:
            self._endpoint.wait([self.transport.publish(topic, frame, retain=True)])
        except TransportError as exc:
            log.error("could not publish the run status (%s): %s", phase, exc)

    def _on_status_echo(self, topic: str, payload: bytes) -> None:  # the transport's thread
        if payload != self._status_frame and self.endpoint is not None and self.endpoint.is_open:
            self._status_replaced.set()
            self.endpoint.interrupt()
