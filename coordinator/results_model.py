"""The results.json document as typed models: what a run writes and what the report reads.

`Results` is built by `coordinator.results.build_results` (simulate, the coordinator daemon,
the demo), read by the report, the CLI and the demo with attributes, and dumped to the same
JSON keys and nesting results.json always had. Reading a results.json file validates it
(`Results.read`); a malformed one raises `ResultsError` naming the first bad field, e.g.
``results['clients'][0]['personal_acc']: Input should be a valid number``.

Accuracies are fractions in [0, 1] measured on each client's own test split; a mean over
clients gives every client the same weight (docs/reference/results.md).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from edge_sdk.algorithms import Detail

__all__ = [
    "EXIT_CODES",
    "AccSpread",
    "Accuracy",
    "Baseline",
    "BaselineClient",
    "BaselineSummary",
    "ClientEntry",
    "CollaborationRound",
    "DeviceRecord",
    "Metrics",
    "OnnxRow",
    "Outcome",
    "Results",
    "ResultsError",
    "RoundEntry",
    "Split",
    "SplitClient",
    "Summary",
    "deployment_summary",
    "spread",
]

Accuracy = Annotated[float, Field(ge=0.0, le=1.0)] | None
# The PersFL metrics: numbers, and the fairness of the improved / worsened clients (or None).
Metrics = dict[str, float | dict[str, float] | None]


# What `edgefl simulate`, `edgefl coordinator` and `edgefl demo` exit with, by the run's
# `summary.outcome` (2 is a usage or config error, 130 an interruption).
EXIT_CODES: dict[str, int] = {"complete": 0, "failed": 3, "partial": 4}
Outcome = Literal["complete", "partial", "failed"]


class ResultsError(ValueError):
    """A results document that does not have the shape results.json has."""


class _Doc(BaseModel):
    """A part of results.json: strict types (no "0.9" for 0.9), no unknown keys; the fields in
    `_omit_empty` are left out of the JSON when empty, as results.json always left them."""

    model_config = ConfigDict(strict=True, extra="forbid")
    _omit_empty: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in self._omit_empty:
            if data.get(key) in (None, {}, []):
                data.pop(key, None)
        return data


class AccSpread(_Doc):
    """How the personalized accuracies of a round's evaluated clients spread: how many had
    one, the lowest, the 10th, 50th and 90th percentile (linear interpolation) and the
    highest."""

    n: int = Field(ge=1)
    min: Annotated[float, Field(ge=0.0, le=1.0)]
    p10: Annotated[float, Field(ge=0.0, le=1.0)]
    p50: Annotated[float, Field(ge=0.0, le=1.0)]
    p90: Annotated[float, Field(ge=0.0, le=1.0)]
    max: Annotated[float, Field(ge=0.0, le=1.0)]


def spread(accs: Iterable[float | None]) -> dict[str, float]:
    """How accuracies spread over clients (`AccSpread`'s fields); {} when none has one."""
    import numpy as np  # here: reading results needs no numpy

    values = np.array([v for v in accs if v is not None], dtype=float)
    if values.size == 0:
        return {}
    points = np.percentile(values, [0, 10, 50, 90, 100])
    keys = ("min", "p10", "p50", "p90", "max")
    return {"n": values.size} | {k: float(v) for k, v in zip(keys, points, strict=True)}


class RoundEntry(_Doc):
    """One round of the run: means over the clients evaluated after it, their spread, and
    (while the fleet is small, `round.client_history`) each client's part."""

    _omit_empty = ("clients", "client_acc", "acc_spread", "flagged", "rolled_back", "suspects")

    round: int = Field(ge=0)
    seconds: float = Field(0.0, ge=0.0)
    mean_personal_acc: Accuracy = None
    global_acc: Accuracy = None  # mean over clients of the global model's accuracy
    failed: bool = False
    replied: int = Field(0, ge=0)
    trained: int = Field(0, ge=0)
    clients: dict[str, dict[str, Detail]] = {}  # per client, what its fit reply reported
    client_acc: dict[str, Accuracy] = {}  # per client, its personalized accuracy
    acc_spread: AccSpread | None = None
    # Clients whose contribution aggregation bounded, with why (docs/security.md); a round
    # undone after its evaluation, and the clients that most likely poisoned it
    flagged: dict[str, str] = {}
    rolled_back: bool | None = None
    suspects: list[str] = []

    @model_validator(mode="after")
    def _spread_from_clients(self) -> Self:
        """Results written before rounds carried a spread: it follows from `client_acc`."""
        if self.acc_spread is None and self.client_acc:
            found = spread(self.client_acc.values())
            self.acc_spread = AccSpread.model_validate(found) if found else None
        return self


class ClientEntry(_Doc):
    """One client of the run, beside the baselines' accuracies for it. Any other key is a
    detail its algorithm reported in its finalize reply (`details`)."""

    model_config = ConfigDict(extra="allow")
    _omit_empty = ("error",)

    id: str
    arch: str | None = None  # the architecture family it registered
    n_train: int | None = Field(None, ge=0)
    personal_acc: Accuracy = None
    global_acc: Accuracy = None  # this run's global model (None without one)
    local_acc: Accuracy = None  # the local baseline's model
    fedavg_acc: Accuracy = None  # the FedAvg baseline's global model
    fedavg_ft_acc: Accuracy = None  # the FedAvg+FT baseline: FedAvg fine-tuned on this client
    dataset: str | None = None  # as the client reported it at registration
    device: str | None = None  # the torch device it trained on
    precision: str | None = None  # float32, or the autocast dtype
    error: str | None = None

    @model_validator(mode="after")
    def _details_are_plain(self) -> Self:
        for key, value in self.details.items():
            if not isinstance(value, str | bool | int | float | None):
                raise ValueError(
                    f"detail {key!r} must be a string, number, boolean or null; got {value!r}"
                )
        return self

    @property
    def details(self) -> dict[str, Detail]:
        """What the algorithm reported about this client (PersFL's teacher round, FedMe's
        architectures, a guard's choice...), in the order it reported them."""
        return dict(self.model_extra or {})

    def baselines(self) -> dict[str, float]:
        """The accuracy each baseline that ran gives this client: label -> accuracy."""
        named = (
            ("local", self.local_acc),
            ("FedAvg", self.fedavg_acc),
            ("FedAvg+FT", self.fedavg_ft_acc),
        )
        return {name: acc for name, acc in named if acc is not None}

    def best_baseline(self) -> tuple[str, float] | None:
        """The best of local, FedAvg and FedAvg+FT for this client (first on ties)."""
        ran = self.baselines()
        if not ran:
            return None
        name = max(ran, key=lambda k: ran[k])
        return name, ran[name]


class Summary(_Doc):
    """The run's headline numbers. Means are over clients, final = after the last round."""

    _omit_empty = ("metrics", "metrics_global_from")

    mean_personal_acc: Accuracy = None
    global_acc: Accuracy = None  # final: the mean of the clients' `global_acc`
    best_mean_personal_acc: Accuracy = None
    best_global_acc: Accuracy = None  # the best round's `global_acc`
    failed_rounds: int = Field(0, ge=0)
    # "complete": every round got its quorum; "partial": some did not (each of those rounds was
    # dropped, the state left as before it); "failed": none did, so no round's training was
    # kept. None: a results.json written before the outcome was recorded.
    outcome: Outcome | None = None
    wall_seconds: float | None = None
    coordinator_bytes_out: int = Field(0, ge=0)
    coordinator_bytes_in: int = Field(0, ge=0)
    metrics: Metrics | None = None
    metrics_global_from: str | None = None


class BaselineSummary(_Doc):
    mean_personal_acc: Accuracy = None
    global_acc: Accuracy = None
    best_global_acc: Accuracy = None
    wall_seconds: float | None = None


class BaselineClient(_Doc):
    id: str
    arch: str | None = None
    personal_acc: Accuracy = None
    global_acc: Accuracy = None


class Baseline(_Doc):
    """A baseline run on the same split and budget."""

    summary: BaselineSummary = BaselineSummary()
    clients: list[BaselineClient] = []


class SplitClient(_Doc):
    id: str
    n_train: int = Field(ge=0)
    n_val: int = Field(ge=0)
    n_test: int = Field(ge=0)
    counts: list[Annotated[int, Field(ge=0)]]  # training samples per class


class Split(_Doc):
    """Each client's share of the data."""

    _omit_empty = ("description",)

    scheme: str | None = None
    classes: list[str] = []
    clients: list[SplitClient] = []
    description: str | None = None

    @model_validator(mode="after")
    def _one_count_per_class(self) -> Self:
        for c in self.clients:
            if self.classes and len(c.counts) != len(self.classes):
                raise ValueError(
                    f"client {c.id} has {len(c.counts)} class counts for "
                    f"{len(self.classes)} classes"
                )
        return self


class OnnxRow(_Doc):
    """A device's exported personalized model, measured with onnxruntime (the demo)."""

    client: str
    arch: str | None = None
    file: str | None = None
    size_bytes: int | None = Field(None, ge=0)
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    throughput: float | None = None
    accuracy: Accuracy = None
    personal_acc: Accuracy = None
    eval_samples: int | None = None
    provider: str | None = None


class DeviceRecord(_Doc):
    """Where the clients trained and why: one device for a simulation, the devices the clients
    registered with for a deployment."""

    requested: str | None = None  # auto, cpu, cuda (None: each client chose its own)
    used: str  # cpu, cuda:0, or several ("cpu ×2, cuda:0 ×1")
    reason: str
    precision: str | None = None  # float32, or the autocast dtype on CUDA

    def describe(self) -> str:
        """One line: `cpu (auto: CUDA is not available), float32`."""
        return f"{self.used} ({self.reason})" + (f", {self.precision}" if self.precision else "")


class CollaborationRound(_Doc):
    round: int = Field(ge=0)
    matrix: list[list[float]]


class Results(_Doc):
    """results.json. Keys beyond the fields are the algorithm's own results (its strategy's
    `results()`), kept as they are."""

    model_config = ConfigDict(extra="allow")
    _omit_empty = (
        "device",
        "collaboration_clients",
        "collaboration",
        "collaboration_history",
        "split",
        "onnx",
        "onnx_note",
        "setup",
        "population",
    )

    config: dict[str, Any] = {}  # the resolved run config (the daemon: without data, models)
    algorithm: str
    budget: dict[str, dict[str, Any]] = {}
    rounds: list[RoundEntry] = []
    clients: list[ClientEntry] = []
    # The clients the run had, when `clients` (and every mean) covers only the sample it
    # evaluated and finalized (a simulation's `round.eval_clients`); absent: every client.
    population: int | None = Field(None, ge=1)
    summary: Summary = Summary()
    device: DeviceRecord | None = None
    # FedeRiCo: each client's weights over every client's model (rows in this order)
    collaboration_clients: list[str] | None = None
    collaboration: list[list[float]] | None = None
    collaboration_history: list[CollaborationRound] | None = None
    baselines: dict[str, Baseline] = {}
    split: Split | None = None
    onnx: list[OnnxRow] | None = None
    onnx_note: str | None = None
    setup: dict[str, str] | None = None  # how the run was carried out: label -> text

    @model_validator(mode="after")
    def _square_collaboration(self) -> Self:
        n = len(self.collaboration_clients or self.clients)
        matrices = [("collaboration", self.collaboration)] + [
            (f"collaboration_history (round {h.round})", h.matrix)
            for h in self.collaboration_history or []
        ]
        for where, m in matrices:
            if m is not None and (len(m) != n or any(len(row) != n for row in m)):
                raise ValueError(f"{where} must be {n}×{n} (clients × clients)")
            if m is not None and not all(math.isfinite(v) for row in m for v in row):
                raise ValueError(f"{where} holds a value that is not finite")
        return self

    # -- reading and writing -----------------------------------------------------------------
    @classmethod
    def parse(cls, data: Mapping[str, Any] | str | bytes) -> Results:
        """Validate a results document (a dict, or JSON text); `ResultsError` when malformed."""
        try:
            if isinstance(data, str | bytes):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ResultsError(_first_error(exc)) from None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Results:
        """Read and validate a results.json file."""
        try:
            return cls.parse(Path(path).read_bytes())
        except ResultsError as exc:
            raise ResultsError(f"{path}: {exc}") from None

    def to_json(self) -> str:
        """The document as results.json holds it (indented JSON)."""
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    # -- what the report, the CLI and the demo ask ---------------------------------------------
    def client_mean(self, field: str) -> float | None:
        """The mean over clients of one of their accuracies (those that have it)."""
        values = [getattr(c, field) for c in self.clients]
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    def deployed(self) -> dict[str, Any]:
        """What the devices deployed (`deployment_summary`)."""
        return deployment_summary(self.clients)

    def sample_line(self) -> str | None:
        """Whose accuracies the run reports, when only a sample was evaluated (None: all), and
        how closely their mean personalized accuracy estimates the population's: one standard
        error, with the correction for a sample drawn without replacement."""
        if self.population is None:
            return None
        line = (
            f"evaluated and finalized: {len(self.clients):,} of the {self.population:,} clients, "
            "a sample drawn per architecture (round.eval_clients); every accuracy and "
            "deployment reported is theirs"
        )
        accs = [c.personal_acc for c in self.clients if c.personal_acc is not None]
        k, n = len(accs), self.population
        if k < 2 or n < 2:
            return line
        mean = sum(accs) / k
        sd = math.sqrt(sum((a - mean) ** 2 for a in accs) / (k - 1))
        se = sd / math.sqrt(k) * math.sqrt(max(0, n - k) / (n - 1))
        return (
            f"{line}, and their mean personalized accuracy estimates the population's to "
            f"±{100 * se:.2f} points (one standard error)"
        )

    @property
    def exit_code(self) -> int:
        """What the command that ran this exits with (`EXIT_CODES`)."""
        return EXIT_CODES[self.summary.outcome or "complete"]

    def closing_line(self) -> str | None:
        """The line a run that lost rounds to a missed quorum ends with (None: it lost none)."""
        outcome = self.summary.outcome
        if outcome in (None, "complete"):
            return None
        quorum = (self.config.get("round") or {}).get("quorum")
        rule = f" (round.quorum {quorum:g})" if quorum is not None else ""
        if outcome == "failed":
            return (
                f"RUN FAILED: none of the {len(self.rounds)} rounds got its quorum{rule}, so no "
                "round's training was kept and the accuracies above measure no federated "
                "training; the log says why clients did not reply validly "
                f"(exit code {self.exit_code})"
            )
        failed = [str(r.round) for r in self.rounds if r.failed]
        return (
            f"RUN INCOMPLETE: {len(failed)} of {len(self.rounds)} rounds missed their "
            f"quorum{rule} (round {', '.join(failed)}); those rounds' training was dropped "
            f"(exit code {self.exit_code})"
        )


class _Deployer(Protocol):
    arch: str | None

    @property
    def details(self) -> Mapping[str, Detail]: ...


def deployment_summary(clients: Sequence[_Deployer]) -> dict[str, Any]:
    """What the devices deployed, beside what they were asked to run: how many reported it, how
    many deployed a model of their own architecture, how many of each architecture (`mixture of
    mlr+mlp` for several models), and the deployed models' mean size against their own
    architectures' (in parameters)."""
    told = [c for c in clients if "deployed_arch" in c.details]
    ratios = [
        p / o
        for c in told
        if isinstance(p := c.details.get("deployed_params"), int | float)
        and isinstance(o := c.details.get("own_params"), int | float)
        and o > 0
    ]
    return {
        "devices": len(told),
        "own_architecture": sum(c.details["deployed_arch"] == c.arch for c in told),
        "architectures": dict(Counter(str(c.details["deployed_arch"]) for c in told)),
        "size_vs_own": sum(ratios) / len(ratios) if ratios else None,
    }


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = "results" + "".join(f"[{p!r}]" for p in first.get("loc", ()))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {msg}{more}"
