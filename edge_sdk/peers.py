"""The channel between clients for decentralized algorithms (FedeRiCo), over peer topics.

Nothing here passes through the coordinator:
- `publish(name, model, version)`: the client's current model, retained on its own topic
  `peer/ME/pub/NAME` (chunks on `peer/ME/pub/NAME/i`, each retained), so a peer fetches it by
  reading the publication and nobody has to answer requests while it trains;
- `fetch(owner, name, min_version)`: subscribe to the owner's publication, take the first
  version at least `min_version`, unsubscribe;
- `send(to, name, round, model)` / `receive(name, round, senders)`: messages on
  `peer/TO/from/ME`, the topic that names both (only ME may write it under the broker ACL).

A client that waits for a peer gives back the simulator's compute gate (`idle_gate`, held while
a task runs) until the wait ends: the peer it waits for may need that slot to publish.

It works the same over the in-memory transport (the simulator) and MQTT. Models are checked like
any received model (architecture, shapes, finite values) and the sender is taken from the topic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from edge_sdk import topics
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, WireModel
from edge_sdk.protocol import Message, PeerMessage, ProtocolError, Published
from edge_sdk.transport.base import Transport
from edge_sdk.wire import (
    Endpoint,
    pack_models,
    publish_retained,
    read_retained,
    unpack_models,
)

__all__ = ["PeerChannel"]

log = logging.getLogger(__name__)


class PeerChannel:
    def __init__(
        self,
        transport: Transport,
        run_id: str,
        me: str,
        *,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        idle_gate: threading.Semaphore | None = None,
    ) -> None:
        self.transport = transport
        self.idle_gate = idle_gate
        self.run_id = run_id
        self.me = me
        self.max_blob_bytes = max_blob_bytes
        self.inbox = Endpoint(
            transport, topics.peer_inbox(run_id, me), max_blob_bytes=max_blob_bytes
        )
        self._stash: dict[tuple[str, int, str], WireModel] = {}  # (name, round, sender)
        self._chunks: dict[str, int] = {}  # chunk topics of each publication, to clear stale ones

    def open(self) -> PeerChannel:
        self.inbox.open()
        return self

    def close(self) -> None:
        self.inbox.close()

    # -- publications ----------------------------------------------------------------------
    def publish(self, name: str, model: WireModel, version: int) -> None:
        """Make `model` this client's current `name`, retained, for round `version`."""
        self._chunks[name] = publish_retained(
            self.inbox,
            topics.peer_publication(self.run_id, self.me, name),
            {name: model},
            lambda refs: Published(
                run=self.run_id, sender=self.me, name=name, version=version, models=refs
            ),
            previous_chunks=self._chunks.get(name, 0),
        )

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
            return msg.version >= min_version  # an older one, still retained: wait for the new

        got = read_retained(
            self.transport,
            topics.peer_publication(self.run_id, owner, name),
            accept,
            timeout=timeout,
            max_blob_bytes=self.max_blob_bytes,
            waiting=self._idle,
        )
        if got is None or name not in got[1]:
            log.warning("%s: no %s of version >= %d from %s", self.me, name, min_version, owner)
            return None
        return got[1][name]

    # -- messages --------------------------------------------------------------------------
    def send(self, to: str, name: str, round_: int, model: WireModel) -> None:
        refs, blobs = pack_models({name: model}, max_bytes=self.max_blob_bytes)
        msg = PeerMessage(run=self.run_id, sender=self.me, name=name, round=round_, models=refs)
        self.inbox.send(topics.peer_message(self.run_id, to, self.me), msg, blobs)

    def receive(
        self, name: str, round_: int, senders: list[str], timeout: float = 60.0
    ) -> dict[str, WireModel]:
        """The `name` messages of round `round_` from `senders` (what arrived by `timeout`)."""
        want = set(senders)
        deadline = time.monotonic() + timeout
        while want - {s for (n, r, s) in self._stash if (n, r) == (name, round_)}:
            left = deadline - time.monotonic()
            with self._idle():
                env = self.inbox.receive(timeout=left) if left > 0 else None
            if env is None:
                break
            msg, sender = env.message, topics.origin_of(env.topic, self.run_id)
            try:
                if not isinstance(msg, PeerMessage) or sender != msg.sender:
                    raise ProtocolError(f"a {msg.kind} on {env.topic} from {msg.sender}")
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

    @contextmanager
    def _idle(self) -> Iterator[None]:
        """Give the compute gate back while blocked (the caller holds it while its task runs)."""
        if self.idle_gate is None:
            yield
            return
        self.idle_gate.release()
        try:
            yield
        finally:
            self.idle_gate.acquire()
