"""The Fleet: the seam between the round loop and the clients, at the level of round phases.

The `Coordinator` keeps the round loop, quorum, retries, records and checkpoints; a Fleet gets
its clients to it and runs phases on them. It is asked to:
- `open` for a run, `gather` the expected clients (registration and admission), or after a
  restart `rejoin` those of the checkpoint;
- say who is `online`, and before a retry `await_back` the clients that dropped out;
- `run_phase`: one task per client (round, phase, step, the models and parameters of each), and
  back each client's reply, validated, or None for that client;
- `publish_archive` for clients that join after the run, then `finish` (or `pause` when the run
  stops before its end, so that clients wait for a coordinator to come back).

`NetworkFleet` carries phases over a transport (MQTT for a deployment, in-memory for faithful
simulations and tests); `LocalFleet` runs the simulator's `ClientNode`s in this process. Both
admit clients and check replies with the pure functions here, so they accept and refuse alike.
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.strategies import ClientInfo, FitReply, by_what
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, WireModel
from edge_sdk.model_blobs import reference_shapes
from edge_sdk.protocol import Capabilities, Phase
from model_zoo import ArchSpec, ModelZooError

log = logging.getLogger(__name__)

__all__ = [
    "BrokerUnfit",
    "CoordinatorError",
    "Fleet",
    "Interrupted",
    "PhaseRequest",
    "RunInfo",
    "Validator",
    "admit",
    "check_reply",
    "client_cost",
    "refusal",
]


def client_cost(spec: ArchSpec, n_train: int) -> int:
    """The work a client brings to its rank: its training samples × its architecture's
    parameter count (what one epoch's forward and backward passes grow with)."""
    params = sum(t.numel() for t in reference_shapes(spec).values())
    return max(1, n_train) * params


class CoordinatorError(RuntimeError):
    """The run cannot go on (too few clients registered, incompatible federation)."""


class BrokerUnfit(CoordinatorError):
    """Most of a phase's clients reported that the broker lacks what the run needs (e.g. it
    does not deliver retained publications, which decentralized algorithms read): no round
    can succeed, so the run ends at once and its clients are told why."""


class Interrupted(RuntimeError):
    """`stop()` was called (SIGTERM, Ctrl-C): the run paused; its checkpoint resumes it."""


@dataclass(frozen=True)
class RunInfo:
    """What a fleet needs to know of the run it serves."""

    run_id: str
    algorithm: str
    config: dict[str, Any]  # the algorithm's config as JSON values (every task carries it)
    rounds: int
    incarnation: int  # a new number per coordinator start (clients re-register when it changes)
    expected_clients: int
    allow: frozenset[str] | None = None  # the client ids admitted (None: any, up to expected)
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    # A reply holding a weight larger than this in magnitude is refused (robust.max_abs)
    max_abs: float = math.inf
    # How long a client whose connection dropped still counts as present (round.reconnect_grace_s)
    reconnect_grace_s: float = 10.0


@dataclass(frozen=True)
class PhaseRequest:
    """One phase of a round: per client, the models its task carries (and, for fit steps, its
    own parameters)."""

    round: int
    phase: Phase
    plan: Mapping[str, Mapping[str, WireModel]]
    deadline_s: float
    step: str = ""
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    partial: frozenset[str] = frozenset()  # reply models that may carry a subset of tensors
    # The last round whose training was kept (aggregated); clients that trained in a later one
    # go back to the state before it (a failed round changes no state). None: not tracked.
    kept_round: int | None = None


# Checks a reply that decoded (raises ValueError with the reason when it cannot be counted).
Validator = Callable[[str, FitReply], None]


class Fleet(ABC):
    """The clients of one run, as the round loop sees them (see the module docstring)."""

    def __init__(self) -> None:
        self.clients: dict[str, ClientInfo] = {}  # registered (admitted) clients, by id
        self.started = False  # registrations closed: the rounds have begun
        self.rejected: Counter[str] = Counter()  # messages or replies dropped, by reason
        self._stop = threading.Event()
        self._run: RunInfo | None = None
        # Told, as a phase's tasks end (a reply taken in, a task that failed; in this process,
        # a job of one client or a stack), how many clients' tasks just ended: progress through
        # a long phase, the finalize after the last round. None: nobody asks.
        self.finished: Callable[[int], None] | None = None

    @property
    def run(self) -> RunInfo:
        """The run this fleet was opened for."""
        if self._run is None:
            raise RuntimeError("the fleet is not open")
        return self._run

    @abstractmethod
    def open(self, run: RunInfo) -> None:
        """Get ready to admit the run's clients (idempotent)."""

    @abstractmethod
    def gather(self, timeout_s: float, min_clients: int | None) -> None:
        """Admit the expected clients into `clients`; raises CoordinatorError when too few came
        within `timeout_s` (at least `min_clients` may be enough)."""

    @abstractmethod
    def rejoin(self, run: RunInfo, timeout_s: float) -> None:
        """After a restart from a checkpoint (`clients` restored, `run` with the new
        incarnation): wait up to `timeout_s` for the registered clients to come back."""

    @abstractmethod
    def online(self) -> set[str]:
        """The registered clients reachable now (over a network: or expected back within their
        reconnection grace). The round loop's: a network fleet first takes in what arrived
        (registrations, wills), so only the thread that runs the phases may call it."""

    @abstractmethod
    def known_online(self) -> set[str]:
        """`online()` as last known, taking nothing in: for other threads (the daemon's
        metrics), which must never consume what the round loop waits for."""

    @abstractmethod
    def await_back(self, timeout_s: float) -> None:
        """Before a retried round: give clients that dropped out up to `timeout_s` to return."""

    @abstractmethod
    def run_phase(self, request: PhaseRequest, validate: Validator) -> dict[str, FitReply | None]:
        """Run one phase; each planned client's valid reply, or None (no reply in time, a
        failed task, a reply that did not validate)."""

    def publish_archive(self, models: Mapping[str, WireModel]) -> None:  # noqa: B027
        """Leave `models` for clients that join after the run (default: nowhere to leave them)."""

    @abstractmethod
    def finish(self, reason: str) -> None:
        """The run is over: tell the clients."""

    @abstractmethod
    def pause(self) -> None:
        """The run stopped before its end: clients keep their state and wait for a restart."""

    def stop(self) -> None:
        """Abandon the phase in progress (the round loop then raises `Interrupted`)."""
        self._stop.set()

    def check_stop(self, round_: int) -> None:
        if self._stop.is_set():
            raise Interrupted(f"stopped during round {round_}")

    def accepted(
        self, cid: str, request: PhaseRequest, reply: Callable[[], FitReply], validate: Validator
    ) -> FitReply | None:
        """The reply `reply()` makes, if it makes one (it may raise ValueError) and it validates;
        else None, counted and logged as dropped."""
        try:
            got = reply()
            validate(cid, got)
        except (ValueError, KeyError) as exc:
            self.rejected["invalid_reply"] += 1
            log.warning("dropped (invalid_reply): %s reply from %s: %s", request.phase, cid, exc)
            return None
        return got

    def rejections(self) -> Counter[str]:
        """Everything dropped so far, by reason (the daemon's metrics)."""
        return Counter(self.rejected)

    @property
    def bytes_out(self) -> int:
        """Payload bytes sent to clients over the run (0 where nothing is serialised)."""
        return 0

    @property
    def bytes_in(self) -> int:
        return 0


def admit(
    fleet: Fleet,
    infos: Iterable[tuple[str, ArchSpec, Capabilities]],
    min_clients: int | None,
) -> None:
    """Admit the clients of an in-process fleet (id, architecture, capabilities, in order) by
    `refusal`'s rules; raises CoordinatorError when fewer than expected (or than `min_clients`)
    were admitted, naming those refused and why. Closes registrations."""
    refused = {}
    for cid, spec, caps in infos:
        why = refusal(cid, spec, caps, run=fleet.run, clients=fleet.clients, started=False)
        if why is None:
            fleet.clients[cid] = ClientInfo(cid, spec, caps)
        else:
            refused[cid] = why
            log.warning("refused registration of %s: %s", cid, why)
    expected = fleet.run.expected_clients
    admitted = len(fleet.clients)
    if admitted < expected and (min_clients is None or admitted < min_clients):
        raise CoordinatorError(
            f"only {admitted} of {expected} clients registered; refused: {by_what(refused)}"
        )
    fleet.started = True


def refusal(
    client_id: str,
    spec: ArchSpec,
    caps: Capabilities,
    *,
    run: RunInfo,
    clients: Mapping[str, ClientInfo],
    started: bool,
) -> str | None:
    """Why a registration cannot be admitted, or None (every fleet admits by these rules)."""
    known = client_id in clients
    if run.allow is not None and client_id not in run.allow:
        return "this client id is not on the run's allow-list"
    if started and not known:
        return "the run has already started"
    if started and spec != clients[client_id].spec:
        return "a client cannot change its architecture during a run"
    if not known and len(clients) >= run.expected_clients:
        return f"the federation is full ({run.expected_clients} clients)"
    if run.algorithm not in caps.algorithms:
        return f"client does not support algorithm {run.algorithm!r}"
    if spec.num_classes != caps.num_classes:
        return (
            f"the model has {spec.num_classes} classes but the client says its data has "
            f"{caps.num_classes}"
        )
    try:  # the coordinator must be able to rebuild what the client runs, within the limit
        shapes = reference_shapes(spec)
    except ModelZooError as exc:
        return str(exc)
    size = sum(t.numel() * t.element_size() for t in shapes.values())
    if size > run.max_blob_bytes:
        return f"the model needs {size} bytes, over the limit of {run.max_blob_bytes}"
    return None


def check_reply(
    reply: FitReply, caps: Capabilities, expected: Mapping[str, ArchSpec] | None
) -> None:
    """Raise ValueError when a decoded reply cannot be counted: malformed accuracy counts, more
    samples than the client registered, or (fit replies, `expected` given) other models than
    the strategy expects from it."""
    problem = _metrics_problem(reply.metrics, caps.n_test)
    if problem is not None:
        raise ValueError(f"malformed metrics: {problem}")
    if reply.n_samples > caps.n_train:
        raise ValueError(
            f"n_samples {reply.n_samples} exceeds the {caps.n_train} training samples it registered"
        )
    if expected is not None:
        got = {name: m.spec for name, m in reply.models.items()}
        if set(got) != set(expected):  # the plugin author's usual slip: a task's key sent back
            raise ValueError(
                f"the reply carries models named {sorted(got)}, the strategy expects "
                f"{sorted(expected)} (its expected_models(); a task's incoming model is named "
                "'global', the models a fit sends back are named as its strategy expects them: "
                "'model' for FedAvg and its subclasses)"
            )
        if got != dict(expected):
            raise ValueError(f"expected models {dict(expected)}, got {got}")


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
