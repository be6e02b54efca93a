"""Who is in a networked run, which process of each client counts, and who is online.

Several processes may speak for one client id (a restarted device whose old process is not gone
yet, or the same device started twice); MQTT lets the newest connection take a client id's
session, so at most one of them is connected at a time. Each process says which it is (a random
`session` in its registration, presence and replies), and the coordinator counts only the one
whose registration for this incarnation it accepted last:
- a registration from a new process of a client is accepted like any other (the same
  architecture, the run's algorithm...); the older process is told it was superseded, and stops;
- one that does not fit (another architecture, the run started without it) is refused, and the
  registered process carries on;
- presence and replies from any other process are dropped (and that process told again).

Online means: registered in this incarnation, and its last news (registration, presence, will,
goodbye) says so. An offline message is final for the connection it names (its epoch), so a
replayed or late "online" of that connection cannot bring it back; a new connection can.

Present means online, or dropped (its will, not its goodbye) less than `grace_s` ago: a device on
a flaky network, or every device when the broker restarts, drops and reconnects within seconds,
and a round that wrote it off at once would drop the reply it sends when it is back. A dead
device costs one grace.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Container

from coordinator.fleet.base import RunInfo, refusal
from coordinator.strategies import ClientInfo
from edge_sdk import topics
from edge_sdk.protocol import Message, Presence, Register, Registered, Reply

__all__ = ["Members"]

log = logging.getLogger(__name__)

TELL_EVERY_S = 2.0  # how often a superseded process is told again while it keeps talking


class Members:
    """The registry of a NetworkFleet. `clients` is the fleet's own dict (admitted clients);
    `reject(reason, detail, who)` counts a dropped message; `answer(cid, registered)` sends a
    registration answer to a client's down topic."""

    def __init__(
        self,
        clients: dict[str, ClientInfo],
        reject: Callable[[str, str, str], None],
        answer: Callable[[str, Registered], None],
    ) -> None:
        self.clients = clients
        self.online: set[str] = set()
        self.grace_s = 0.0  # the run's reconnect_grace_s, from `open`
        self._dropped: dict[str, float] = {}  # offline clients, since when (monotonic)
        self.started = False  # registrations of new clients closed
        self._reject = reject
        self._answer = answer
        self._run: RunInfo | None = None
        self._sessions: dict[str, str] = {}  # the process that counts, per client
        self._epochs: dict[str, int] = {}  # its newest connection we heard of
        self._offline: dict[str, int] = {}  # a connection whose offline we heard: final
        self._former: dict[str, set[str]] = {}  # processes that counted once, per client
        self._told: dict[tuple[str, str], float] = {}  # superseded processes, when told

    def open(self, run: RunInfo, *, started: bool = False) -> None:
        """A new incarnation: every client registers again (its sessions are forgotten)."""
        self._run = run
        self.grace_s = run.reconnect_grace_s
        self.started = started
        self.online.clear()
        self._dropped.clear()
        self._sessions.clear()
        self._epochs.clear()
        self._offline.clear()

    def present(self) -> set[str]:
        """Online, or dropped less than `grace_s` ago (it may be back any moment). Read from
        copies, so another thread (the daemon's metrics) may ask while the round loop updates."""
        now = time.monotonic()
        return set(self.online) | {c for c in list(self._dropped) if self.is_present(c, now)}

    def is_present(self, cid: str, now: float) -> bool:
        """`present()` of one client, without copying the registry (the round loop asks for
        every reply: with thousands of clients a copy per message made a phase quadratic)."""
        if cid in self.online:
            return True
        since = self._dropped.get(cid)
        return since is not None and now - since < self.grace_s

    def grace_ends(self, cids: Container[str], now: float) -> float:
        """When the first grace still running of the offline clients among `cids` runs out
        (monotonic; inf when none is). Walks the dropped clients, not `cids`."""
        ends = (t + self.grace_s for c, t in list(self._dropped.items()) if c in cids)
        return min((end for end in ends if end > now), default=math.inf)

    def is_registered(self, cid: str, session: str) -> bool:
        return cid in self._sessions and self._sessions[cid] == session

    def handle(self, cid: str, msg: Message) -> bool:
        """Take in a control message from `cid` (its topic's writer). True when the client came
        back: a new connection or a new process that may have missed what was sent to it."""
        if isinstance(msg, Register):
            return self._on_register(msg)
        if isinstance(msg, Presence):
            return self._on_presence(cid, msg)
        if cid not in self.clients:
            self._reject("unknown_sender", f"a {msg.kind} from unregistered {cid!r}", cid)
        elif isinstance(msg, Reply):  # its task's phase is over (or it never had one)
            self._reject("stale_reply", f"reply {msg.task_id} from {cid}", cid)
        else:
            log.info("ignoring %s from %s outside its phase", msg.kind, cid)
        return False

    def tell_superseded(self, cid: str, session: str) -> None:
        """Tell an older process of `cid` that a newer one counts (at most every few s); a
        process that never counted (its registration was refused or is pending) is not told."""
        if session not in self._former.get(cid, ()):
            return
        now = time.monotonic()
        if now - self._told.get((cid, session), -TELL_EVERY_S) < TELL_EVERY_S:
            return
        if len(self._told) > 1024:
            self._told.clear()
        self._told[(cid, session)] = now
        reason = (
            f"another process registered as {cid} after this one; the newest process of a "
            "client id is the one that counts"
        )
        self._answer(cid, self._registered(False, session, reason))

    # -- messages --------------------------------------------------------------------------
    def _registered(self, accepted: bool, session: str, reason: str | None = None) -> Registered:
        run = self._require_run()
        return Registered(
            run=run.run_id,
            sender=topics.COORDINATOR,
            accepted=accepted,
            reason=reason,
            session=session,
            incarnation=run.incarnation,
        )

    def _require_run(self) -> RunInfo:
        if self._run is None:
            raise RuntimeError("the fleet is not open")
        return self._run

    def _on_register(self, msg: Register) -> bool:
        run = self._require_run()
        cid = msg.sender
        if msg.incarnation != run.incarnation:  # replayed, or it has not seen our status yet
            detail = f"{cid} registered with incarnation {msg.incarnation}, not {run.incarnation}"
            self._reject("stale_register", detail, cid)
            return False
        current = self._sessions.get(cid)
        if current == msg.session:  # again (its answer may have crossed it): answer again
            self._answer(cid, self._registered(True, msg.session))
            return self._connected(cid, msg.epoch)
        reason = refusal(
            cid, msg.spec, msg.capabilities, run=run, clients=self.clients, started=self.started
        )
        if reason is not None:
            self._reject("refused_register", f"refused registration of {cid}: {reason}", cid)
            self._answer(cid, self._registered(False, msg.session, reason))
            return False
        self.clients[cid] = ClientInfo(cid, msg.spec, msg.capabilities)
        if current is not None:
            log.warning("%s: a newer process registered; the older one is told to stop", cid)
            former = self._former.setdefault(cid, set())
            if len(former) > 64:  # bounded: the oldest are long gone
                former.clear()
            former.add(current)
            self.tell_superseded(cid, current)
        else:
            log.info("registered %s (%s, %d train)", cid, msg.spec, msg.capabilities.n_train)
        self._sessions[cid] = msg.session
        self._epochs.pop(cid, None)
        self._offline.pop(cid, None)
        self.online.discard(cid)
        self._answer(cid, self._registered(True, msg.session))
        return self._connected(cid, msg.epoch)

    def _on_presence(self, cid: str, msg: Presence) -> bool:
        current = self._sessions.get(cid)
        if current is None or msg.session != current:
            if current is not None and msg.online:
                self.tell_superseded(cid, msg.session)
            log.debug("ignoring the presence of a process of %s that does not count", cid)
            return False
        if msg.online:
            return self._connected(cid, msg.epoch)
        if msg.epoch < self._epochs.get(cid, -1):
            log.info("%s: ignoring news about an older connection (%d)", cid, msg.epoch)
            return False
        self._epochs[cid] = self._offline[cid] = msg.epoch
        if msg.leaving:
            self._dropped.pop(cid, None)
        elif cid in self.online:  # its will: the connection dropped, it may be back soon
            self._dropped[cid] = time.monotonic()
        if cid in self.online:
            self.online.discard(cid)
            log.warning("%s %s", cid, "left" if msg.leaving else "went offline")
        return False

    def _connected(self, cid: str, epoch: int) -> bool:
        """`cid`'s registered process is on connection `epoch`; True when that is news."""
        known = self._epochs.get(cid, -1)
        if epoch < known or self._offline.get(cid) == epoch:
            log.info("%s: ignoring news about an older connection (%d)", cid, epoch)
            return False
        back = cid not in self.online or epoch > known
        self._epochs[cid] = epoch
        if back and cid not in self.online and known >= 0:
            log.info("%s is back online", cid)
        self.online.add(cid)
        self._dropped.pop(cid, None)
        return back
