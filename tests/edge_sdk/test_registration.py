"""An EdgeClient's registration state machine (edge_sdk.registration), driven directly: every
state and event, the moves the issue's stories need (a replayed "finished" status, a restarted
coordinator, an answer or shutdown from another incarnation), and what a client does in each."""

from __future__ import annotations

import itertools

import pytest
import torch

import edge_sdk.serving as serving_mod
from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.client import EdgeClient
from edge_sdk.client_data import ClientData
from edge_sdk.node import ClientNode
from edge_sdk.protocol import Register, Registered, Status
from edge_sdk.registration import TRANSITIONS, Event, Registration, State
from edge_sdk.transport import InMemoryBroker
from edge_sdk.wire import Endpoint
from model_zoo import ArchSpec

W, R, D, A, X, F = (
    State.WAITING,
    State.REGISTERING,
    State.DOUBTING,
    State.ACCEPTED,
    State.REFUSED,
    State.FINISHED,
)
# The moves the client needs, written out here from the module's description (not read from
# TRANSITIONS): state -> {event: next state}. Anything else is ignored.
EXPECTED = {
    W: {
        Event.NEW_COORDINATOR: R,
        Event.FINISHED_STATUS: D,
        Event.UNSIGNED: X,
        Event.JOINED_LATE: F,
    },
    R: {
        Event.NEW_COORDINATOR: R,
        Event.STATUS: R,
        Event.RETRY: R,
        Event.FINISHED_STATUS: D,
        Event.ACCEPT: A,
        Event.REFUSE: X,
        Event.UNSIGNED: X,
        Event.JOINED_LATE: F,
    },
    D: {
        Event.NEW_COORDINATOR: R,
        Event.STATUS: R,
        Event.FINISHED_STATUS: D,
        Event.ACCEPT: A,
        Event.REFUSE: X,
        Event.GRACE_OVER: X,
        Event.UNSIGNED: X,
        Event.JOINED_LATE: F,
    },
    A: {
        Event.NEW_COORDINATOR: R,
        Event.STATUS: A,
        Event.FINISHED_STATUS: D,
        Event.ACCEPT: A,
        Event.REFUSE: X,
        Event.SHUTDOWN: F,
        Event.UNSIGNED: X,
    },
    X: {Event.JOINED_LATE: F},
    F: {},
}


def _in(state: State) -> Registration:
    """A registration in `state`, registered with (and, once accepted, accepted by) 7."""
    reg = Registration("c0")
    reg.state = state
    reg.registering = None if state is W else 7
    reg.incarnation = 7 if state in (A, F) else None
    reg.since = 100.0 if state is D else None
    return reg


def _args(event: Event) -> dict[str, object]:
    """What each event carries when it comes from where it must (incarnation 7; 8 is new)."""
    incarnation = 8 if event is Event.NEW_COORDINATOR else 7
    return {"incarnation": incarnation, "reason": "why", "now": 200.0}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_every_event_in_every_state_moves_as_the_table_says_or_is_ignored(state, event):
    reg = _in(state)
    applied = reg.fire(event, **_args(event))
    want = EXPECTED[state].get(event)
    assert applied is (want is not None)
    assert reg.state is (want if want is not None else state)


def test_the_table_is_exactly_the_expected_one():
    assert {(s, e): t for s, moves in EXPECTED.items() for e, t in moves.items()} == TRANSITIONS


def test_answers_and_shutdowns_from_another_incarnation_are_ignored(caplog):
    reg = _in(R)  # registered with 7
    assert not reg.fire(Event.ACCEPT, incarnation=6)  # recorded from an earlier coordinator
    assert not reg.fire(Event.REFUSE, incarnation=8, reason="replayed")
    assert reg.state is R and reg.reason is None
    assert reg.fire(Event.ACCEPT, incarnation=7) and reg.incarnation == 7
    assert not reg.fire(Event.SHUTDOWN, incarnation=6)  # an old run's, replayed
    assert reg.state is A
    assert "ignoring a shutdown from coordinator incarnation 6 (registered with 7)" in caplog.text
    assert reg.fire(Event.SHUTDOWN, incarnation=7) and reg.state is F


def test_a_restarted_coordinator_is_registered_with_and_only_its_shutdown_counts():
    reg = _in(A)  # accepted by 7
    assert reg.status_event(8, finished=False) is Event.NEW_COORDINATOR
    assert reg.fire(Event.NEW_COORDINATOR, incarnation=8)
    assert (reg.state, reg.registering, reg.incarnation) == (R, 8, None)
    assert not reg.fire(Event.SHUTDOWN, incarnation=7)  # not accepted by anyone now
    assert not reg.fire(Event.ACCEPT, incarnation=7)  # a late answer from the old one
    assert reg.fire(Event.ACCEPT, incarnation=8) and (reg.state, reg.incarnation) == (A, 8)
    assert reg.fire(Event.SHUTDOWN, incarnation=8) and reg.state is F and reg.incarnation == 8


def test_a_finished_status_is_doubted_from_the_first_one_until_a_newer_status():
    reg = Registration("c0")
    assert reg.status_event(7, finished=True) is Event.FINISHED_STATUS
    assert reg.fire(Event.FINISHED_STATUS, incarnation=7, now=10.0)
    assert (reg.state, reg.since) == (D, 10.0)
    assert reg.fire(Event.FINISHED_STATUS, incarnation=7, now=13.0)  # again: counts from 10
    assert reg.since == 10.0
    # The coordinator of the run that goes on publishes its own: register with it.
    assert reg.status_event(9, finished=False) is Event.NEW_COORDINATOR
    assert reg.fire(Event.NEW_COORDINATOR, incarnation=9, now=14.0)
    assert (reg.state, reg.registering, reg.since) == (R, 9, None)


def test_a_doubt_that_stands_is_a_refusal_saying_the_run_is_over():
    reg = _in(D)
    assert reg.fire(Event.GRACE_OVER)
    assert (reg.state, reg.reason) == (X, "the run has already finished")
    assert reg.done


def test_a_refusal_keeps_its_reason_or_says_none_was_given():
    reg = _in(R)
    assert reg.fire(Event.REFUSE, incarnation=7, reason="another process registered as c0")
    assert reg.reason == "another process registered as c0"
    reg = _in(A)
    assert reg.fire(Event.REFUSE, incarnation=7) and reg.reason == "no reason given"
    assert reg.incarnation is None


# What a status is, by where the registration stands (registered with, accepted by 7).
@pytest.mark.parametrize(
    ("state", "incarnation", "finished", "event"),
    [
        (W, 7, False, Event.NEW_COORDINATOR),
        (W, 7, True, Event.FINISHED_STATUS),
        (R, 7, False, Event.STATUS),  # its registration stands: retried on the timer
        (R, 8, False, Event.NEW_COORDINATOR),
        (R, 7, True, Event.FINISHED_STATUS),
        (D, 7, False, Event.STATUS),
        (D, 8, False, Event.NEW_COORDINATOR),
        (D, 7, True, Event.FINISHED_STATUS),
        (A, 7, False, Event.STATUS),
        (A, 7, True, Event.SHUTDOWN),  # its own coordinator finished (its shutdown was lost?)
        (A, 8, False, Event.NEW_COORDINATOR),
        (A, 8, True, Event.FINISHED_STATUS),
    ],
)
def test_a_status_is_classified_by_the_incarnation_registered_with(
    state, incarnation, finished, event
):
    assert _in(state).status_event(incarnation, finished) is event


# -- the client in each state --------------------------------------------------------------
def _client(monkeypatch, clock):
    monkeypatch.setattr(serving_mod, "_now", lambda: clock[0])
    broker = InMemoryBroker()
    keys = Keyring.ephemeral([topics.COORDINATOR, "c0"])
    coordinator = Endpoint(broker.connect("coordinator"), "unused", keyring=keys["coordinator"])
    spec = ArchSpec(family="mlr", input_shape=(1, 8, 8), num_classes=10)
    x, y = torch.zeros(8, 1, 8, 8), torch.arange(8) % 10
    data = ClientData(x, y, x[:2], y[:2], x[:2], y[:2], num_classes=10)
    client = EdgeClient(ClientNode("c0", spec, data), broker.connect("c0"), keyring=keys["c0"])
    client.open()

    def status(incarnation, phase):
        msg = Status(
            run="default",
            sender=topics.COORDINATOR,
            incarnation=incarnation,
            phase=phase,
            rounds=1,
            algorithm="fedavg",
            accepting=True,
        )
        coordinator.send(topics.status("default"), msg, retain=True)
        while (env := client.endpoint.receive(timeout=10)) is None:  # (a wake-up: connected)
            client.step(None)
        return client.step(env)

    def accept(incarnation):
        msg = Registered(
            run="default",
            sender=topics.COORDINATOR,
            accepted=True,
            session=client.session,
            incarnation=incarnation,
        )
        coordinator.send(topics.down("default", "c0"), msg)
        while (env := client.endpoint.receive(timeout=10)) is None:
            client.step(None)
        return client.step(env)

    status.accept = accept  # type: ignore[attr-defined]
    return client, status


def test_a_client_doubting_a_finished_status_sleeps_until_the_grace_ends_then_gives_up(
    monkeypatch,
):
    # Before, idle_wait() was 0 for the whole grace (its registration timer was "due", but a
    # finished status sends nothing): a client spun for 6 s.
    clock = [1000.0]
    client, status = _client(monkeypatch, clock)
    assert not status(7, "finished")
    assert client.registration.state is State.DOUBTING
    assert client.idle_wait() == min(serving_mod.IDLE_WAIT_S, serving_mod.FINISHED_GRACE_S)
    clock[0] += serving_mod.FINISHED_GRACE_S - 0.25
    assert client.idle_wait() == 0.25
    assert not client.step(None) and client.accepted is None
    clock[0] += 0.25
    assert client.idle_wait() == 0.0
    assert client.step(None)  # done: refused
    assert (client.accepted, client.refused) == (False, "the run has already finished")
    client.stop()


def test_a_client_registers_once_per_incarnation_and_retries_only_on_its_timer(monkeypatch):
    clock = [1000.0]
    client, status = _client(monkeypatch, clock)
    sent = []
    send = client._try_send
    monkeypatch.setattr(
        client,
        "_try_send",
        lambda msg, blobs=None: sent.append(msg) if isinstance(msg, Register) else send(msg),
    )
    status(7, "registering")
    status(7, "fit")  # the same coordinator again: no new registration
    assert [m.incarnation for m in sent] == [7] and client.registration.state is State.REGISTERING
    assert 0 < client.idle_wait() <= serving_mod.IDLE_WAIT_S
    status(8, "registering")  # restarted: registers with the new one at once
    assert [m.incarnation for m in sent] == [7, 8]
    clock[0] += 3 * serving_mod.REGISTER_RETRY_S  # past the retry (jitter at most 1.5x)
    assert not client.step(None)
    assert [m.incarnation for m in sent] == [7, 8, 8]
    client.stop()


def test_an_accepted_client_whose_shutdown_was_lost_ends_on_its_coordinators_finished_status(
    monkeypatch,
):
    # Another connection under the client's MQTT id (a duplicate process, or anyone on an open
    # broker) can hold its session as the shutdown is sent, and take it. The coordinator's
    # "finished" status, retained and published after every shutdown, ends the run all the
    # same; before, the client waited for the shutdown forever.
    clock = [1000.0]
    client, status = _client(monkeypatch, clock)
    status(7, "registering")
    assert not status.accept(7) and client.registration.state is State.ACCEPTED
    assert not status(7, "fit")
    assert status(7, "finished")  # done
    assert client.registration.state is State.FINISHED and client.finished
    client.stop()
