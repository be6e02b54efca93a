"""An EdgeClient's registration as an explicit state machine: its states (`State`), the events
that move it (`Event`), and one table of the legal moves (`TRANSITIONS`), applied by
`Registration.fire`.

    WAITING --new coordinator--> REGISTERING --accept--> ACCEPTED --shutdown--> FINISHED
       |                          ^  |   |                 |  |
       |   finished status        |  |   +----refuse-------+--+--> REFUSED
       +-------------------> DOUBTING      (also: grace over, unsigned)

- WAITING: no coordinator status seen yet, so there is no one to register with (the status
  topic is retained: one comes as soon as there is a coordinator).
- REGISTERING: a registration went to coordinator incarnation `registering`, unanswered yet;
  the client sends it again, less and less often (the RETRY event).
- DOUBTING: a "finished" status came while no incarnation had accepted this process. It may be
  an old run's, replayed on an open broker; the coordinator of a run that goes on publishes its
  own again at once. So it is believed only after a grace period without a newer status
  (GRACE_OVER: refused, "the run has already finished"); a live status ends the doubt.
- ACCEPTED: incarnation `incarnation` accepted this process: its tasks run, its shutdown
  counts. A status naming another incarnation (the coordinator restarted) sends it back to
  REGISTERING (or, when that one says "finished", to DOUBTING).
- REFUSED: the coordinator refused this process (`reason`), the run was over, or the client
  cannot sign while its coordinator checks signatures. Terminal: `run()` raises.
- FINISHED: the run ended (a shutdown from the accepting incarnation, or its retained
  "finished" status, which it publishes after every shutdown: a shutdown can be lost where
  another connection under this client's MQTT id took its session meanwhile), or the client
  joined it late from its archive. Terminal.

A reconnection changes nothing here: the broker keeps the session, the coordinator knows the
process by its session id, and the client only says it is online again.

Events that the table does not allow in the current state, and answers or shutdowns from
another incarnation than the one they must come from, are logged and ignored (`fire` returns
False): they come from the network, where a replayed or late message must not stop a client,
so none of them raises.
"""

from __future__ import annotations

import enum
import logging

__all__ = ["TERMINAL", "TRANSITIONS", "Event", "Registration", "State"]

log = logging.getLogger(__name__)


class State(enum.Enum):
    WAITING = "waiting"
    REGISTERING = "registering"
    DOUBTING = "doubting"
    ACCEPTED = "accepted"
    REFUSED = "refused"
    FINISHED = "finished"


class Event(enum.Enum):
    NEW_COORDINATOR = "new coordinator"  # a live status of an incarnation not registered with
    STATUS = "status"  # a status of the incarnation registered with (or accepted by)
    FINISHED_STATUS = "finished status"  # "finished", from no incarnation that accepted us
    RETRY = "retry"  # the unanswered registration's timer ran out: send it again
    ACCEPT = "accept"  # the registered incarnation accepted this process
    REFUSE = "refuse"  # ... refused it (`reason`)
    GRACE_OVER = "grace over"  # a "finished" status stood unanswered for the grace period
    UNSIGNED = "unsigned"  # the coordinator signs and this client cannot: it would never hear
    SHUTDOWN = "shutdown"  # the accepting incarnation ended the run
    JOINED_LATE = "joined late"  # personalized from a finished run's archive instead


S, E = State, Event
_LIVE = (S.WAITING, S.REGISTERING, S.DOUBTING, S.ACCEPTED)  # every state but the terminal ones
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.WAITING, E.NEW_COORDINATOR): S.REGISTERING,
    (S.WAITING, E.FINISHED_STATUS): S.DOUBTING,
    (S.REGISTERING, E.NEW_COORDINATOR): S.REGISTERING,  # registered again, with the new one
    (S.REGISTERING, E.STATUS): S.REGISTERING,  # the retry timer sends it again, not the status
    (S.REGISTERING, E.RETRY): S.REGISTERING,
    (S.REGISTERING, E.FINISHED_STATUS): S.DOUBTING,
    (S.REGISTERING, E.ACCEPT): S.ACCEPTED,
    (S.REGISTERING, E.REFUSE): S.REFUSED,
    (S.DOUBTING, E.NEW_COORDINATOR): S.REGISTERING,
    (S.DOUBTING, E.STATUS): S.REGISTERING,  # its registration still stands: the timer goes on
    (S.DOUBTING, E.FINISHED_STATUS): S.DOUBTING,  # the grace counts from the first
    (S.DOUBTING, E.ACCEPT): S.ACCEPTED,
    (S.DOUBTING, E.REFUSE): S.REFUSED,
    (S.DOUBTING, E.GRACE_OVER): S.REFUSED,
    (S.ACCEPTED, E.NEW_COORDINATOR): S.REGISTERING,  # the coordinator restarted
    (S.ACCEPTED, E.STATUS): S.ACCEPTED,
    (S.ACCEPTED, E.FINISHED_STATUS): S.DOUBTING,  # a restarted coordinator says it is over?
    (S.ACCEPTED, E.ACCEPT): S.ACCEPTED,  # the answer to a retry that crossed the first one
    (S.ACCEPTED, E.REFUSE): S.REFUSED,  # e.g. a newer process of the same id took over
    (S.ACCEPTED, E.SHUTDOWN): S.FINISHED,
    **{(s, E.UNSIGNED): S.REFUSED for s in _LIVE},
    **{(s, E.JOINED_LATE): S.FINISHED for s in (S.WAITING, S.REGISTERING, S.DOUBTING)},
    (S.REFUSED, E.JOINED_LATE): S.FINISHED,  # refused as the run was over: its archive is not
}
TERMINAL = frozenset({S.REFUSED, S.FINISHED})
_REASONS = {E.GRACE_OVER: "the run has already finished"}
del S, E


class Registration:
    """Where one client process stands with its coordinator: the `state`, and what it holds.

    `registering`: the incarnation the last registration named (None: none sent).
    `incarnation`: the incarnation that accepted this process (ACCEPTED, and FINISHED after its
    shutdown; None otherwise).
    `reason`: why it was refused (REFUSED only). `since`: when the doubt began (DOUBTING only).
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.state = State.WAITING
        self.registering: int | None = None
        self.incarnation: int | None = None
        self.reason: str | None = None
        self.since: float | None = None

    def __repr__(self) -> str:
        return f"Registration({self.who}: {self.state.value})"

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def status_event(self, incarnation: int, finished: bool) -> Event:
        """What a coordinator status of `incarnation` (saying "finished" or not) is here."""
        accepted = self.state is State.ACCEPTED
        bound = self.incarnation if accepted else self.registering
        if incarnation == bound and accepted and finished:
            return Event.SHUTDOWN  # the run that accepted us is over, as its shutdown says
        if incarnation == bound and not finished:
            return Event.STATUS
        return Event.FINISHED_STATUS if finished else Event.NEW_COORDINATOR

    def fire(
        self,
        event: Event,
        *,
        incarnation: int | None = None,
        reason: str | None = None,
        now: float = 0.0,
    ) -> bool:
        """Apply `event` (carrying the incarnation it names, a reason, the time): True when it
        applied, False when it was ignored (logged: see the module's docstring)."""
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            log.warning("%s: ignoring %s while %s", self.who, event.value, self.state.value)
            return False
        if event in (Event.ACCEPT, Event.REFUSE) and incarnation != self.registering:
            log.warning(  # recorded from another coordinator, or a late answer to an old one
                "%s: ignoring an answer from coordinator incarnation %s (registered with %s)",
                self.who,
                incarnation,
                self.registering,
            )
            return False
        if event is Event.SHUTDOWN and incarnation != self.incarnation:
            log.warning(
                "%s: ignoring a shutdown from coordinator incarnation %s (registered with %s)",
                self.who,
                incarnation,
                self.incarnation,
            )
            return False
        if event is Event.NEW_COORDINATOR:
            self.registering = incarnation
        if event is Event.ACCEPT:
            self.incarnation = incarnation
        elif target not in (State.ACCEPTED, State.FINISHED):
            self.incarnation = None  # no incarnation accepts this process now
        if target is State.REFUSED:
            self.reason = reason or _REASONS.get(event, "no reason given")
        if target is State.DOUBTING and self.state is not State.DOUBTING:
            self.since = now
        elif target is not State.DOUBTING:
            self.since = None
        self.state = target
        return True
