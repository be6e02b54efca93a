"""The channel between clients for decentralized algorithms (FedeRiCo), over peer topics.

Nothing here passes through the coordinator:
- `publish(name, model, version)`: the client's current model, retained on its own topic
  `peer/ME/pub/NAME` (chunks on `peer/ME/pub/NAME/i`, each retained), so a peer fetches it by
  reading the publication and nobody has to answer requests while it trains;
- `fetch(owner, name, min_version)`: subscribe to the owner's publication, take the first
  version at least `min_version`, unsubscribe;
- `send(to, name, round, model)` / `receive(name, round, senders)`: messages on
  `peer/TO/from/ME`, the topic that names both (only ME may write it under the broker ACL).

A client's first publication is read back once: a broker that does not deliver retained messages
to a new subscription (RabbitMQ's MQTT plugin does not under a wildcard filter, which the chunks
are read with) would leave every peer waiting out its timeout for models that never come, so
the channel raises `RetainedNotDelivered` at once instead, naming the cause.

It works the same over the in-memory transport and MQTT. Models are checked like any received
model (architecture, shapes, finite values) and the sender is taken from the topic; with a
keyring (edge_sdk.auth) publications and messages are signed, and only those signed by the
client their topic names count. Once the client is registered (`bind`), publications and
messages carry the coordinator incarnation it registered with, and only those of that
incarnation count: an earlier run's, still retained or replayed, do not.

`LocalPeers` is the same channel between the ClientNodes of one process (the simulator's
LocalFleet): a `PeerBoard` holds the publications and messages, nothing is serialised, and
nothing waits, since a phase's publications are made before any of its tasks reads one
(`ClientAlgorithm.before_fit`) and its messages are read in a later phase.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, WireModel, check_weights
from edge_sdk.device import stepping_aside
from edge_sdk.model_blobs import pack_models, reference_shapes, unpack_models
from edge_sdk.protocol import Message, PeerMessage, ProtocolError, Published
from edge_sdk.retained import publish_retained, read_retained
from edge_sdk.transport.base import Transport
from edge_sdk.wire import Endpoint

__all__ = ["LocalPeers", "PeerBoard", "PeerChannel", "Peers", "RetainedNotDelivered"]

log = logging.getLogger(__name__)

RETAINED_CHECK_S = 10.0  # how long a client waits for its own first publication to come back


class RetainedNotDelivered(RuntimeError):
    """The broker did not deliver a retained publication to a new subscription: peers could
    never read each other's models."""


class Peers(Protocol):
    """What a decentralized algorithm may ask of the other clients."""

    def publish(self, name: str, model: WireModel, version: int) -> None:
        """Make `model` this client's current `name`, for round `version`."""

    def fetch(
        self, owner: str, name: str, min_version: int = 0, timeout: float = 60.0
    ) -> WireModel | None:
        """The owner's published `name` of version >= `min_version`, or None."""

    def send(self, to: str, name: str, round_: int, model: WireModel) -> None:
        """A message to one peer."""

    def receive(
        self, name: str, round_: int, senders: list[str], timeout: float = 60.0
    ) -> dict[str, WireModel]:
        """The `name` messages of round `round_` from `senders` (what arrived)."""


class PeerChannel:
    def __init__(
        self,
        transport: Transport,
        run_id: str,
        me: str,
        *,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        keyring: Keyring | None = None,
    ) -> None:
        self.transport = transport
        self.run_id = run_id
        self.me = me
        self.max_blob_bytes = max_blob_bytes
        self.keyring = keyring
        self.inbox = Endpoint(
            transport, topics.peer_inbox(run_id, me), max_blob_bytes=max_blob_bytes, keyring=keyring
        )
        self._stash: dict[tuple[str, int, str], WireModel] = {}  # (name, round, sender)
        self._chunks: dict[str, int] = {}  # chunk topics of each publication, to clear stale ones
        self._current: dict[str, tuple[WireModel, int]] = {}  # each publication and its version
        # Whether our own first publication came back to a new subscription (None: not tried
        # yet; False: it did not, and every later publish fails at once for the same reason).
        self._retained_seen: bool | None = None
        self._retained_missing = ""
        # The coordinator incarnation this client registered with (None: not yet; nothing
        # checked then).
        self.incarnation: int | None = None

    def open(self) -> PeerChannel:
        self.inbox.open()
        return self

    def close(self) -> None:
        self.inbox.close()

    # -- publications ----------------------------------------------------------------------
    def bind(self, incarnation: int) -> None:
        """Registered with coordinator `incarnation`: what is sent from now on carries it, and
        only what carries it is taken. Current publications are made again under it."""
        if incarnation == self.incarnation:
            return
        self.incarnation = incarnation
        for name, (model, version) in list(self._current.items()):
            self.publish(name, model, version)

    def _signed_as(self) -> dict[str, Any]:
        """The fields every message of this client carries: run, sender, incarnation."""
        return {"run": self.run_id, "sender": self.me, "incarnation": self.incarnation or 0}

    def publish(self, name: str, model: WireModel, version: int) -> None:
        """Make `model` this client's current `name`, retained, for round `version`."""
        if self._retained_seen is False:
            raise RetainedNotDelivered(self._retained_missing)
        self._current[name] = (model, version)
        self._chunks[name] = publish_retained(
            self.inbox,
            topics.peer_publication(self.run_id, self.me, name),
            {name: model},
            lambda refs: Published(**self._signed_as(), name=name, version=version, models=refs),
            previous_chunks=self._chunks.get(name, 0),
        )
        if self._retained_seen is None:
            self._check_retained(name, version)

    def _check_retained(self, name: str, version: int) -> None:
        """Read our own publication back, as a peer would; raise `RetainedNotDelivered` when
        the broker does not deliver it."""
        topic = topics.peer_publication(self.run_id, self.me, name)
        got = read_retained(
            self.transport,
            topic,
            lambda msg: isinstance(msg, Published) and msg.version == version,
            timeout=RETAINED_CHECK_S,
            max_blob_bytes=self.max_blob_bytes,
            keyring=self.keyring,
        )
        if got is None:
            self._retained_seen = False
            self._retained_missing = (
                f"{self.me}: the broker did not deliver this client's own retained publication "
                f"on {topic} (and {topic}/+) to a new subscription within {RETAINED_CHECK_S:g} "
                "s, so no peer could read it. Decentralized algorithms (FedeRiCo) need retained "
                "messages delivered to every new subscription, wildcard filters included, from "
                "every node of a cluster: use mosquitto (bridged sites work), EMQX or VerneMQ; "
                "RabbitMQ's MQTT plugin (3.x) keeps retained messages per node and sends none "
                "to wildcard filters"
            )
            raise RetainedNotDelivered(self._retained_missing)
        self._retained_seen = True

    def fetch(
        self, owner: str, name: str, min_version: int = 0, timeout: float = 60.0
    ) -> WireModel | None:
        """The owner's published `name` of version >= `min_version`, or None after `timeout`."""

        def accept(msg: Message) -> bool:
            if not isinstance(msg, Published):
                return False
            if msg.sender != owner or msg.name != name:
                log.warning("%s: %s's publication claims %s/%s", self.me, owner, msg.sender, name)
                return False
            if self.incarnation is not None and msg.incarnation != self.incarnation:
                return False  # another coordinator's (an earlier run): wait for the current
            return msg.version >= min_version  # an older one, still retained: wait for the new

        with stepping_aside():  # the owner may need this thread's GPU to publish it
            got = read_retained(
                self.transport,
                topics.peer_publication(self.run_id, owner, name),
                accept,
                timeout=timeout,
                max_blob_bytes=self.max_blob_bytes,
                keyring=self.keyring,
            )
        if got is None or name not in got[1]:
            log.warning(
                "%s: no %s of version >= %d from %s in %g s (it is offline, or the broker did "
                "not deliver its retained publication: in a cluster, every node must serve every "
                "retained message)",
                self.me,
                name,
                min_version,
                owner,
                timeout,
            )
            return None
        return got[1][name]

    # -- messages --------------------------------------------------------------------------
    def send(self, to: str, name: str, round_: int, model: WireModel) -> None:
        refs, blobs = pack_models({name: model}, max_bytes=self.max_blob_bytes)
        msg = PeerMessage(**self._signed_as(), name=name, round=round_, models=refs)
        self.inbox.send(topics.peer_message(self.run_id, to, self.me), msg, blobs)

    def receive(
        self, name: str, round_: int, senders: list[str], timeout: float = 60.0
    ) -> dict[str, WireModel]:
        """The `name` messages of round `round_` from `senders` (what arrived by `timeout`)."""
        want = set(senders)
        with stepping_aside():  # the senders may need this thread's GPU to send them
            self._await(name, round_, want, timeout)
        got = {
            s: self._stash.pop((name, round_, s))
            for s in sorted(want)
            if (name, round_, s) in self._stash
        }
        for key in [k for k in self._stash if k[1] < round_]:  # older rounds: too late now
            del self._stash[key]
        if len(got) < len(want):
            log.warning(
                "%s: no %s of round %d from %s", self.me, name, round_, sorted(want - set(got))
            )
        return got

    def _await(self, name: str, round_: int, want: set[str], timeout: float) -> None:
        """Stash the peer messages that arrive until `want`'s `name` of `round_` are all in,
        or `timeout`."""
        deadline = time.monotonic() + timeout
        while want - {s for (n, r, s) in self._stash if (n, r) == (name, round_)}:
            left = deadline - time.monotonic()
            env = self.inbox.receive(timeout=left) if left > 0 else None
            if env is None:
                break
            msg, sender = env.message, topics.origin_of(env.topic, self.run_id)
            try:
                if not isinstance(msg, PeerMessage) or sender != msg.sender:
                    raise ProtocolError(f"a {msg.kind} on {env.topic} from {msg.sender}")
                if self.incarnation is not None and msg.incarnation != self.incarnation:
                    raise ProtocolError(f"{sender}'s {msg.name} of coordinator {msg.incarnation}")
                # a message may carry a subset of the model's tensors (gradients: no buffers)
                models = unpack_models(
                    msg.models,
                    env.blobs,
                    max_bytes=self.max_blob_bytes,
                    partial=frozenset(msg.models),
                )
                self._stash[(msg.name, msg.round, sender)] = models[msg.name]
            except (ValueError, KeyError) as exc:
                log.warning("%s: dropped a peer message: %s", self.me, exc)


class PeerBoard:
    """The peer topics of one process: every client's current publications and the messages
    sent between clients, shared by the `LocalPeers` of a LocalFleet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.publications: dict[tuple[str, str], tuple[int, WireModel]] = {}  # (owner, name)
        self.messages: dict[tuple[str, str, int, str], WireModel] = {}  # (to, name, round, from)

    def channel(self, me: str) -> LocalPeers:
        return LocalPeers(self, me)


def _checked(model: WireModel, what: str) -> WireModel:
    """A peer's model as a receiver over the network would accept it: finite values, names and
    shapes that fit its architecture (a gradient may carry only some of the tensors)."""
    check_weights(model.weights, reference_shapes(model.spec), what=what, partial=True)
    return model


class LocalPeers:
    """PeerChannel's behaviour between ClientNodes of one process, on a `PeerBoard`: nothing is
    serialised and nothing waits (what is not on the board now never will be in this phase)."""

    def __init__(self, board: PeerBoard, me: str) -> None:
        self.board = board
        self.me = me

    def publish(self, name: str, model: WireModel, version: int) -> None:
        with self.board._lock:
            self.board.publications[(self.me, name)] = (version, model)

    def fetch(
        self, owner: str, name: str, min_version: int = 0, timeout: float = 60.0
    ) -> WireModel | None:
        with self.board._lock:
            got = self.board.publications.get((owner, name))
        if got is None or got[0] < min_version:
            log.warning("%s: no %s of version >= %d from %s", self.me, name, min_version, owner)
            return None
        try:
            return _checked(got[1], f"{owner}'s {name}")
        except ValueError as exc:
            log.warning("%s: an unusable publication of %s: %s", self.me, owner, exc)
            return None

    def send(self, to: str, name: str, round_: int, model: WireModel) -> None:
        with self.board._lock:
            self.board.messages[(to, name, round_, self.me)] = model

    def receive(
        self, name: str, round_: int, senders: list[str], timeout: float = 60.0
    ) -> dict[str, WireModel]:
        got: dict[str, WireModel] = {}
        with self.board._lock:
            for key in [k for k in self.board.messages if k[0] == self.me]:
                _, n, r, sender = key
                if (n, r) == (name, round_) and sender in senders:
                    got[sender] = self.board.messages.pop(key)
                elif r < round_:  # older rounds: too late now
                    del self.board.messages[key]
        for sender in list(got):
            try:
                _checked(got[sender], f"{sender}'s {name}")
            except ValueError as exc:
                log.warning("%s: dropped a peer message: %s", self.me, exc)
                del got[sender]
        missing = sorted(set(senders) - set(got))
        if missing:
            log.warning("%s: no %s of round %d from %s", self.me, name, round_, missing)
        # By sender, as PeerChannel returns them: a sum over them does not depend on the order
        # in which the senders ran (or, over ranks, on which rank they ran on).
        return {s: got[s] for s in sorted(got)}
