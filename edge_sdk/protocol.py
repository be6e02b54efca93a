"""Typed, versioned control messages between the coordinator and edge clients.

Every message is a frozen pydantic model with a `kind` discriminator, the protocol version, the
run id and the sender. Model weights never ride inside a message: a message names them through
`ModelRef`s (ArchSpec + a blob reference with its sha256) and the blobs travel separately.
`decode` is the one entry point for bytes from the network and raises `ProtocolError`.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, TypeAdapter, ValidationError

from edge_sdk.topics import ID_PATTERN
from model_zoo import ArchSpec

__all__ = [
    "MAX_CLASSES",
    "PROTOCOL_VERSION",
    "BlobRef",
    "Capabilities",
    "Message",
    "ModelRef",
    "PeerMessage",
    "Phase",
    "Presence",
    "ProtocolError",
    "ProtocolVersionError",
    "Published",
    "Register",
    "Registered",
    "Reply",
    "Shutdown",
    "Status",
    "Task",
    "decode",
    "encode",
]

# 2: every message a coordinator incarnation sends or is sent binds to that incarnation (a
# registration's answer, replies, peer messages and publications now carry it).
PROTOCOL_VERSION: Final = 2
MAX_CLASSES: Final = 100_000  # bounds what a registering client can make the server allocate

Phase = Literal["fit", "evaluate", "finalize"]
Id = Annotated[str, Field(pattern=ID_PATTERN)]  # ids become topic levels
# One process of a client: a random id it picks at start. The coordinator counts only replies
# from the process whose registration it accepted.
Session = Annotated[str, Field(pattern=r"^[0-9a-f]{0,64}$")]


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol version."""


class ProtocolVersionError(ProtocolError):
    """A message of another protocol version (a peer running another edgefl release)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlobRef(_Frozen):
    id: str = Field(min_length=1, max_length=128)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    shared: bool = False  # sent on the run's broadcast topic (a model many tasks share)


class ModelRef(_Frozen):
    spec: ArchSpec
    blob: BlobRef


class Capabilities(_Frozen):
    device: str = Field("cpu", max_length=64)  # the torch device it trains on: cpu, cuda:0
    # How it computes there (`float32`, `bfloat16 autocast`) and the name of the data set it
    # trains on, for the coordinator's results; None from clients that do not say.
    precision: str | None = Field(None, max_length=64)
    dataset: str | None = Field(None, max_length=128)
    n_train: int = Field(ge=0)
    n_val: int = Field(ge=0, default=0)
    n_test: int = Field(ge=0, default=0)
    num_classes: int = Field(ge=1, le=MAX_CLASSES)
    algorithms: list[str] = Field(default=[], max_length=256)


class _Message(_Frozen):
    v: Literal[2] = PROTOCOL_VERSION
    run: Id
    sender: Id
    # Strictly increasing per sender, set when the message is signed (edge_sdk.auth): a receiver
    # drops one not newer than the last it accepted on that topic (a replay).
    seq: int = Field(0, ge=0)


class Register(_Message):
    """Client → coordinator: here I am, this is my architecture and what I can do."""

    kind: Literal["register"] = "register"
    spec: ArchSpec
    capabilities: Capabilities
    epoch: int = Field(0, ge=0)  # see Presence
    session: Session = ""
    # The coordinator incarnation it registers with (from the status topic): a registration
    # replayed from an earlier incarnation is ignored.
    incarnation: int = Field(0, ge=0)


class Registered(_Message):
    """Coordinator → client: registration accepted or refused (with the reason)."""

    kind: Literal["registered"] = "registered"
    accepted: bool
    reason: str | None = None
    session: Session = ""  # the process it answers (several may share a client id)
    incarnation: int = Field(0, ge=0)  # the coordinator incarnation that answers


class Task(_Message):
    """Coordinator → client: run one phase of the algorithm on these models."""

    kind: Literal["task"] = "task"
    task_id: str
    round: int = Field(ge=0)
    rounds: int = Field(ge=1)
    phase: Phase
    algorithm: str
    config: dict[str, Any] = {}
    models: dict[str, ModelRef] = {}
    # A round's fit phase may take several steps (barriers), named by the strategy, each with
    # per-client parameters (e.g. FedeRiCo: who sent this client gradients).
    step: str = Field("", max_length=64)
    params: dict[str, Any] = {}
    incarnation: int = Field(0, ge=0)  # of the coordinator that sent it
    # The last round whose training the coordinator kept (aggregated); a client whose last
    # trained round is later than that, and not this task's, goes back to the state before it:
    # a round recorded as failed changes no state, on either side.
    kept_round: int | None = Field(None, ge=0)


class Reply(_Message):
    """Client → coordinator: the outcome of a task; models ride as blobs."""

    kind: Literal["reply"] = "reply"
    task_id: str
    session: Session = ""  # the process that ran the task
    incarnation: int = Field(0, ge=0)  # of the task's coordinator
    round: int = Field(ge=0)
    phase: Phase
    ok: bool
    error: str | None = Field(None, max_length=4000)
    n_samples: int = Field(ge=0, default=0)
    metrics: dict[str, FiniteFloat] = Field(default={}, max_length=256)
    # Per-client facts reported as they are (e.g. a chosen teacher round, an architecture name).
    details: dict[
        Annotated[str, Field(max_length=64)],
        Annotated[str, Field(max_length=256)] | bool | int | FiniteFloat | None,
    ] = Field(default_factory=dict, max_length=64)
    models: dict[str, ModelRef] = {}


class Shutdown(_Message):
    """Coordinator → client: the run is over."""

    kind: Literal["shutdown"] = "shutdown"
    reason: str = "run finished"
    incarnation: int = Field(0, ge=0)  # of the coordinator that sent it


class Status(_Message):
    """Coordinator → everyone, retained on the status topic: where the run is.

    A client that starts late or reconnects reads it at once; a new `incarnation` (the
    coordinator restarted) tells registered clients to register again.
    """

    kind: Literal["status"] = "status"
    incarnation: int = Field(ge=0)
    phase: Literal["registering", "fit", "evaluate", "finalize", "finished", "offline"]
    round: int = Field(0, ge=0)
    rounds: int = Field(ge=1)
    algorithm: str
    accepting: bool  # whether registrations are open
    # The largest model the run expects (bytes, 0: not known yet): clients size their
    # reassembly memory to it.
    model_bytes: int = Field(0, ge=0)


class Presence(_Message):
    """Client → coordinator: online or not. A client's will carries `online=False`, so the
    broker announces a client that vanished without saying goodbye."""

    kind: Literal["presence"] = "presence"
    online: bool
    # Grows with every connection of the client (across restarts too): news about an older
    # connection, such as its will delivered late after a broker restart, is ignored.
    epoch: int = Field(0, ge=0)
    session: Session = ""
    # Said by the client itself as it stops (not its will): it is not coming back soon, so the
    # coordinator gives it no reconnection grace.
    leaving: bool = False


class Published(_Message):
    """Client → everyone, retained on its own peer topic: its current model (chunks on the
    sub-topics), so a peer fetches it by reading the publication, with no one answering."""

    kind: Literal["published"] = "published"
    name: Id
    version: int = Field(ge=0)  # the round it is current for
    models: dict[str, ModelRef]
    incarnation: int = Field(0, ge=0)  # of the coordinator its owner is registered with


class PeerMessage(_Message):
    """Client → client on the topic naming both (FedeRiCo's gradients)."""

    kind: Literal["peer"] = "peer"
    name: Id
    round: int = Field(ge=0)
    models: dict[str, ModelRef]
    incarnation: int = Field(0, ge=0)  # of the coordinator its sender is registered with


class Archive(_Message):
    """Coordinator → anyone, retained on the archive topic after the run: what a client that
    joins later needs to personalize from it (PersFL's archived global models)."""

    kind: Literal["archive"] = "archive"
    algorithm: str
    config: dict[str, Any] = {}
    rounds: int = Field(ge=1)
    models: dict[str, ModelRef]


Message = Annotated[
    Register
    | Registered
    | Task
    | Reply
    | Shutdown
    | Status
    | Presence
    | Published
    | PeerMessage
    | Archive,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode()


def decode(data: bytes) -> Message:
    """Parse and validate one message; anything else raises ProtocolError."""
    try:
        return _ADAPTER.validate_json(data)
    except ValidationError as exc:
        versions = [e.get("input") for e in exc.errors() if e.get("loc", ())[-1:] == ("v",)]
        if versions:
            raise ProtocolVersionError(
                f"a message of protocol version {versions[0]!r}; this edgefl speaks version "
                f"{PROTOCOL_VERSION}: upgrade edgefl on the older side"
            ) from exc
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ProtocolError(f"invalid message: {where}: {first.get('msg')}") from exc
