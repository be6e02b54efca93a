"""FedeRiCo's server half: membership and the round clock (exchange, then update, each client
told whom to wait for), and the collaboration matrix it records from the weights the clients
report. No model passes through it."""

from tests_helpers import raises_exactly

from coordinator.strategies import ClientInfo, FitReply, StrategyError, strategy_class
from edge_sdk.algorithms import algorithm_class
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec

SPEC = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
IDS = ["c0", "c1", "c2"]


def _strategy(classes=(3, 3, 3), clients_per_round=None):
    clients = {
        f"c{i}": ClientInfo(
            f"c{i}", SPEC.with_(num_classes=k), Capabilities(n_train=10, num_classes=k)
        )
        for i, k in enumerate(classes)
    }
    config = algorithm_class("federico").config_cls()
    s = strategy_class("federico")(
        config,
        clients=clients,
        global_spec=None,
        rounds=4,
        clients_per_round=clients_per_round,
        seed=0,
    )
    s.setup()
    return s


def _reply(cid: str, **details) -> FitReply:
    return FitReply(cid, {}, details=details)


def _weights(cid: str, **w: float) -> FitReply:
    return FitReply(cid, {}, details={f"w:{k}": v for k, v in w.items()})


def test_federico_round_is_an_exchange_among_members_then_an_update_from_the_senders():
    # Prepare
    s = _strategy()
    assert s.steps == ("exchange", "update")

    # Execute / Assert: every client exchanges, each told who the round's members are...
    assert s.configure_step(1, "exchange") == {c: {} for c in IDS}
    assert s.task_params(1, "exchange", "c1") == {"members": IDS}
    # ...c1's exchange reply is missing; c0 sent c1 a gradient, c2 sent one to c0 and c1.
    s.aggregate_step(
        1, "exchange", {"c0": _reply("c0", sent_to="c1"), "c2": _reply("c2", sent_to="c0,c1")}
    )
    # ...so the update step is for the clients that exchanged, each waiting for its senders.
    assert s.configure_step(1, "update") == {"c0": {}, "c2": {}}
    assert s.task_params(1, "update", "c0") == {"from": ["c2"]}
    assert s.task_params(1, "update", "c1") == {"from": ["c0", "c2"]}
    assert s.task_params(1, "update", "c2") == {"from": []}  # nobody sent c2 a gradient

    # The next round starts over: a client that sent nothing names no one.
    s.configure_step(2, "exchange")
    s.aggregate_step(2, "exchange", {c: _reply(c, sent_to="") for c in IDS} | {"c1": _reply("c1")})
    assert s.configure_step(2, "update") == {c: {} for c in IDS}
    assert all(s.task_params(2, "update", c) == {"from": []} for c in IDS)


def test_federico_samples_the_round_members():
    s = _strategy(clients_per_round=2)
    plan = s.configure_step(1, "exchange")
    assert len(plan) == 2 and set(plan) < set(IDS)
    assert s.task_params(1, "exchange", "c0") == {"members": sorted(plan)}


def test_federico_refuses_an_exchange_reply_whose_sent_to_is_not_text():
    s = _strategy()
    s.configure_step(1, "exchange")
    msg = "federico: c0 reported sent_to=3"
    with raises_exactly(StrategyError, msg):
        s.aggregate_step(1, "exchange", {"c0": _reply("c0", sent_to=3)})


def test_federico_collaboration_matrix_keeps_each_clients_latest_reported_weights():
    # Prepare: round 1, c0 and c1 report; round 2 (through aggregate_fit), c0 only; c2 never.
    s = _strategy()
    s.aggregate_step(
        1,
        "update",
        {
            "c0": _reply("c0", **{"w:c0": 0.75, "w:c1": 0.25, "note": "x", "w:c2": "n/a"}),
            "c1": _weights("c1", c0=0.5, c1=0.5),
        },
    )
    s.aggregate_fit(2, {"c0": _weights("c0", c0=1, c2=0.0)})

    # Execute
    out = s.results()

    # Assert: rows are clients, columns the models they weigh; a client that missed a round
    # keeps its last row, one that never reported has zeros; non-weights are ignored.
    assert out == {
        "collaboration_clients": IDS,
        "collaboration": [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]],
        "collaboration_history": [
            {"round": 1, "matrix": [[0.75, 0.25, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]},
            {"round": 2, "matrix": [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]},
        ],
    }


def test_federico_history_survives_a_checkpoint():
    s = _strategy()
    s.aggregate_step(1, "update", {"c0": _weights("c0", c0=0.5, c1=0.5)})
    s.aggregate_step(2, "update", {"c1": _weights("c1", c1=1.0)})
    fresh = _strategy()
    fresh.load_state_dict(s.state_dict())
    assert fresh.results() == s.results() and len(fresh.results()["collaboration_history"]) == 2


def test_federico_history_stops_at_the_client_history_limit_and_keeps_the_latest_rows(caplog):
    # Prepare: 3 clients, so a round's matrix is 9 entries; room for two rounds, not three.
    s = _strategy()
    s.history_limit = 2 * 9
    s.aggregate_step(1, "update", {"c0": _weights("c0", c0=0.5, c1=0.5)})
    s.aggregate_step(2, "update", {"c1": _weights("c1", c1=1.0)})
    assert len(s.results()["collaboration_history"]) == 2

    # Execute: the third round would hold 27 entries; the log says so, in numbers.
    with caplog.at_level("INFO", logger="coordinator.strategies.federico"):
        s.aggregate_step(3, "update", {"c2": _weights("c2", c0=0.25, c2=0.75)})
    assert "collaboration_history" not in s.results()
    assert [r.getMessage() for r in caplog.records] == [
        "federico: 3 rounds of 3×3 collaboration matrices exceed round.client_history (18): "
        "results keep the latest matrix only"
    ]
    s.aggregate_step(4, "update", {"c0": _weights("c0", c0=1.0)})

    # Assert: no history any more (not a partial one), and still every client's latest row,
    # through a checkpoint too.
    want = {
        "collaboration_clients": IDS,
        "collaboration": [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.25, 0.0, 0.75]],
    }
    assert s.results() == want
    fresh = _strategy()
    fresh.load_state_dict(s.state_dict())
    assert fresh.results() == want


def test_federico_latest_rows_come_back_from_a_checkpoint_that_kept_only_the_history():
    s = _strategy()
    s.aggregate_step(1, "update", {"c0": _weights("c0", c0=0.5, c1=0.5)})
    s.aggregate_step(2, "update", {"c1": _weights("c1", c1=1.0)})
    old = s.state_dict()
    del old["latest"]  # written before the latest rows were kept apart
    fresh = _strategy()
    fresh.load_state_dict(old)
    assert fresh.results() == s.results()


def test_federico_needs_two_clients_of_the_same_classes():
    msg = "federico needs at least two clients to collaborate"
    with raises_exactly(StrategyError, msg):
        _strategy(classes=(3,))
    msg = "federico mixes whole models: every client needs the same classes"
    with raises_exactly(StrategyError, msg):
        _strategy(classes=(3, 4))
    assert list(_strategy(classes=(3, 3)).clients) == ["c0", "c1"]


def test_federico_beyond_the_client_history_limit_keeps_the_clients_with_weights(caplog):
    # Prepare: 5 clients (25 entries) against room for 24; c3 never reports, nor is weighed,
    # c4 is weighed by c0 without a row of its own.
    s = _strategy(classes=(3,) * 5)
    s.history_limit = 24
    s.aggregate_step(1, "update", {"c0": _weights("c0", c0=0.5, c4=0.5, c3=0.0)})
    s.aggregate_step(2, "update", {"c1": _weights("c1", c1=0.75, c2=0.25)})

    # Execute
    with caplog.at_level("INFO", logger="coordinator.strategies.federico"):
        out = s.results()

    # Assert: the square matrix of the four others, in the clients' order; every dropped
    # entry (c3's row and column) is 0, and the log says how many were kept
    assert out == {
        "collaboration_clients": ["c0", "c1", "c2", "c4"],
        "collaboration": [
            [0.5, 0.0, 0.0, 0.5],
            [0.0, 0.75, 0.25, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ],
    }
    assert caplog.records[-1].getMessage() == (
        "federico: a 5×5 collaboration matrix exceeds round.client_history (24): results keep "
        "the 4 clients with a row or a weight (every other entry is 0)"
    )
    s.history_limit = 25  # within it: every client, as before
    assert s.results()["collaboration_clients"] == [f"c{i}" for i in range(5)]
    empty = _strategy(classes=(3,) * 5)
    empty.history_limit = 24
    assert empty.results() == {}  # beyond it, before any weights arrived: no matrix
