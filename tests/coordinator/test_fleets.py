"""The two fleets: LocalFleet (ClientNodes in this process) and NetworkFleet (EdgeClients over the
in-memory transport) run the same algorithms to the same results, and each fleet's own duties."""

import logging
import threading
import time
from collections import Counter

import pytest
import torch
from tests_helpers import EVERY_ALGORITHM, needs_cuda, tiny_config, to_rounding

from coordinator.federation import build_coordinator, build_node, prepare_federation
from coordinator.fleet import (
    CoordinatorError,
    LocalFleet,
    PhaseRequest,
    RunInfo,
    check_reply,
    refusal,
)
from coordinator.simulator import run_federation
from coordinator.strategies import ClientInfo, FitReply
from edge_sdk.algorithms import algorithm_names
from edge_sdk.codec import WireModel
from edge_sdk.peers import PeerBoard
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec, build


def _run(algorithm: str, fleet: str):
    one_arch = algorithm in {"fedavg", "fedprox", "fedavg_ft"}
    flags = dict(
        algorithm=algorithm,
        clients=3,
        rounds=2,
        models=["mlr"] if one_arch else ["mlr", "mlp"],
        global_model="mlr",
        fleet=fleet,
        lr=0.05,
        overrides=EVERY_ALGORITHM.get(algorithm, {}),
    )
    cfg = tiny_config(**flags)
    return run_federation(cfg, prepare_federation(cfg), algorithm)


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_local_and_network_fleets_give_the_same_per_client_results(algorithm):
    # Execute: the same seed and config, in process and over the in-memory transport
    local = _run(algorithm, "local")
    network = _run(algorithm, "network")

    # Assert: every client ends with the same accuracies and reports the same details, round by
    # round and at the end (the local fleet stacks clients: values such as a validation loss
    # agree to float rounding)
    assert [c.id for c in local.clients] == [c.id for c in network.clients]
    for a, b in zip(local.clients, network.clients, strict=True):
        assert (a.personal_acc, a.global_acc, a.error) == (b.personal_acc, b.global_acc, b.error)
        assert a.details == to_rounding(b.details)
        assert a.personal_acc is not None
    for a, b in zip(local.rounds, network.rounds, strict=True):
        assert (a.failed, a.replied, a.client_acc) == (b.failed, b.replied, b.client_acc)
        assert a.client_details == to_rounding(b.client_details)
        assert a.train_metrics == pytest.approx(b.train_metrics, rel=1e-5)
    assert local.extra.keys() == network.extra.keys()


@pytest.mark.parametrize("fleet", ["local", "network"])
def test_both_fleets_count_every_task_that_ends(fleet):
    # FedAvg, 4 clients: an evaluation before the first round (what a rollback compares
    # with), 2 rounds of a fit and an evaluation, then the finalize: 6 phases, 24 tasks. The
    # local fleet tells as each job ends (stacks of clients), the network one as each reply.
    cfg = tiny_config(rounds=2, fleet=fleet)
    told: list[int] = []
    run_federation(cfg, prepare_federation(cfg), "fedavg", on_clients=told.append)
    assert sum(told) == 6 * 4
    if fleet == "network":
        assert told == [1] * 24
    else:
        assert all(1 <= n <= 4 for n in told) and len(told) >= 6


def _nodes(n=3, algorithm="fedavg"):
    cfg = tiny_config(algorithm=algorithm, clients=n, rounds=1)
    fed = prepare_federation(cfg)
    return cfg, fed, [build_node(cfg, fed, i) for i in range(n)]


def _info(**kw):
    base = dict(
        run_id="r", algorithm="fedavg", config={}, rounds=1, incarnation=1, expected_clients=3
    )
    return RunInfo(**(base | kw))


def test_the_local_fleet_admits_by_the_same_rules_and_says_who_it_refused():
    # Prepare: an allow-list that leaves c2 out
    _, _, nodes = _nodes()
    fleet = LocalFleet(nodes)
    fleet.open(_info(allow=frozenset({"c0", "c1"}), expected_clients=3))

    # Execute / Assert: two of three cannot start a run that needs three
    with pytest.raises(CoordinatorError, match=r"only 2 of 3 clients registered.*allow-list: c2"):
        fleet.gather(0, None)

    # ... but may when two are enough
    fleet = LocalFleet(nodes)
    fleet.open(_info(allow=frozenset({"c0", "c1"}), expected_clients=3))
    fleet.gather(0, min_clients=2)
    assert sorted(fleet.clients) == ["c0", "c1"] and fleet.online() == {"c0", "c1"}


def test_refusal_names_each_reason():
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    caps = Capabilities(n_train=10, num_classes=10, algorithms=["fedavg"])
    known = {"c0": ClientInfo("c0", spec, caps)}
    run = _info(expected_clients=1)
    assert refusal("c0", spec, caps, run=run, clients=known, started=True) is None
    assert "already started" in refusal("c9", spec, caps, run=run, clients=known, started=True)
    other = spec.with_(family="mlp")
    assert "change its architecture" in refusal(
        "c0", other, caps, run=run, clients=known, started=True
    )
    assert "full" in refusal("c9", spec, caps, run=run, clients=known, started=False)
    assert "support" in refusal("c0", spec, caps, run=_info(algorithm="fml"), clients={}, started=0)
    assert "over the limit" in refusal(
        "c0", spec, caps, run=_info(max_blob_bytes=100), clients={}, started=False
    )


def test_check_reply_refuses_counts_and_models_the_client_cannot_have():
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    caps = Capabilities(n_train=10, n_test=5, num_classes=10)
    model = WireModel(spec, dict(build(spec).state_dict()))
    ok = FitReply("c0", {"model": model}, {"personal_correct": 3, "personal_total": 5}, 10)
    check_reply(ok, caps, {"model": spec})
    for bad, why in [
        (FitReply("c0", {"model": model}, {}, 11), "exceeds the 10 training samples"),
        (FitReply("c0", {}, {"personal_correct": 6, "personal_total": 5}), "above 1"),
        (FitReply("c0", {}, {"personal_correct": 1}), "come together"),
        (FitReply("c0", {}, {"personal_correct": 1, "personal_total": 6}), "exceeds the 5 test"),
        (FitReply("c0", {}, {}, 1), r"carries models named \[\], the strategy expects"),
        # A plugin's slip: the task's key sent back. Before: only the two dicts of ArchSpecs.
        (
            FitReply("c0", {"global": model}, {}, 1),
            r"named \['global'\], the strategy expects \['model'\].*'model' for FedAvg",
        ),
        (
            FitReply("c0", {"model": WireModel(spec.model_copy(update={"num_classes": 3}), {})}),
            "expected models",
        ),
    ]:
        with pytest.raises(ValueError, match=why):
            check_reply(bad, caps, {"model": spec})


def test_a_local_reply_with_a_non_finite_weight_or_metric_is_not_counted(caplog):
    # Prepare: c0's model comes back with a NaN, c1's metrics with an infinity, c2's model with
    # a finite weight beyond robust.max_abs (one by one, so that each node's own execute runs).
    # (The warning is asserted: a CLI test run earlier in this process may have left the root
    # logger at ERROR. The fleet's loggers, base's and local's, are set back to WARNING.)
    caplog.set_level(logging.WARNING, logger="coordinator.fleet")
    cfg, fed, nodes = _nodes(4)
    fleet = LocalFleet(nodes, parallel=1, stack=False)
    coordinator = build_coordinator(cfg, fleet, fed=fed)
    coordinator.open()
    fleet.gather(0, None)
    coordinator._new_strategy().setup()
    real = [n.execute for n in nodes]

    def nan_model(task, real=real[0]):
        out = real(task)
        w = next(iter(out.models.values())).weights
        w[next(iter(w))][0] = float("nan")
        return out

    def inf_metric(task, real=real[1]):
        out = real(task)
        out.metrics["loss"] = float("inf")
        return out

    def huge(task, real=real[2]):
        out = real(task)
        w = next(iter(out.models.values())).weights
        w[next(iter(w))][0] = 3e38
        return out

    nodes[0].execute, nodes[1].execute, nodes[2].execute = nan_model, inf_metric, huge

    # Execute
    replies = coordinator._run_phase(1, "fit", coordinator.strategy.configure_fit(1))

    # Assert: only c3's reply counts; c2's is refused with its reason
    assert [cid for cid, r in replies.items() if r is not None] == ["c3"]
    assert fleet.rejected["invalid_reply"] == 2
    assert "holds 3e+38, out of range (robust.max_abs = 1e+06)" in caplog.text


def test_a_phase_runs_every_begin_before_any_task_executes():
    # Prepare: a record of what each node does, in order (one by one: each node executes)
    cfg, fed, nodes = _nodes()
    fleet = LocalFleet(nodes, parallel=1, stack=False)
    order = []
    for n in nodes:
        begin, execute = n.begin, n.execute
        n.begin = lambda t, n=n, f=begin: order.append(("begin", n.client_id)) or f(t)
        n.execute = lambda t, n=n, f=execute: order.append(("execute", n.client_id)) or f(t)
    coordinator = build_coordinator(cfg, fleet, fed=fed)
    coordinator.open()
    fleet.gather(0, None)
    coordinator._new_strategy().setup()

    # Execute
    fleet.run_phase(
        PhaseRequest(1, "fit", coordinator.strategy.configure_fit(1), deadline_s=1),
        lambda cid, reply: None,
    )

    # Assert
    assert [kind for kind, _ in order] == ["begin"] * 3 + ["execute"] * 3


def test_local_peers_fetch_what_is_published_and_read_only_their_messages():
    # Prepare
    board = PeerBoard()
    a, b = board.channel("a"), board.channel("b")
    spec = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
    model = WireModel(spec, dict(build(spec, seed=1).state_dict()))
    a.publish("model", model, 2)

    # Execute / Assert: a version at least the one asked for, or nothing
    assert b.fetch("a", "model", min_version=2) is model
    assert b.fetch("a", "model", min_version=3) is None
    assert b.fetch("c", "model") is None
    # messages: only this round's, only from the senders asked about
    a.send("b", "grad", 1, model)
    a.send("b", "grad", 0, model)  # an older round: dropped when round 1 is read
    board.channel("c").send("b", "grad", 1, model)
    got = b.receive("grad", 1, ["a"])
    assert list(got) == ["a"] and got["a"] is model
    assert ("b", "grad", 0, "a") not in board.messages
    assert ("b", "grad", 1, "c") in board.messages  # not asked about: left for later


def test_a_peer_model_with_a_nan_is_not_fetched():
    board = PeerBoard()
    spec = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
    weights = dict(build(spec, seed=1).state_dict())
    weights["linear.weight"] = torch.full_like(weights["linear.weight"], float("nan"))
    board.channel("a").publish("model", WireModel(spec, weights), 1)
    assert board.channel("b").fetch("a", "model") is None


class _Concurrency:
    """How many tasks run at once, at most, in what it wraps."""

    def __init__(self):
        self.now = self.most = 0
        self.lock = threading.Lock()

    def wrap(self, execute, wait=0.05):
        def counted(self_, task):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            time.sleep(wait)  # long enough for the other threads to come in, if they may
            try:
                return execute(self_, task)
            finally:
                with self.lock:
                    self.now -= 1

        return counted


@pytest.mark.parametrize("fleet", ["local", "network"])
@pytest.mark.parametrize("gpu", [False, True])
def test_tasks_on_a_gpu_take_turns_and_on_the_cpu_run_side_by_side(fleet, gpu, monkeypatch):
    # Prepare: three clients training at once, one by one (the simulator's threads, or
    # EdgeClients on threads); for the GPU, the CPU taken for one (CUDA graph captures fail when
    # another thread uses the device meanwhile)
    import edge_sdk.device
    from edge_sdk.node import ClientNode

    if gpu:
        monkeypatch.setattr(edge_sdk.device, "_takes_turns", lambda device: True)
    seen = _Concurrency()
    monkeypatch.setattr(ClientNode, "execute", seen.wrap(ClientNode.execute))
    cfg = tiny_config(algorithm="local", clients=3, rounds=1, fleet=fleet, parallel=3, cohort=False)

    # Execute
    result = run_federation(cfg, prepare_federation(cfg), "local")

    # Assert: every client trained; one at a time on the GPU, together on the CPU
    assert all(c.personal_acc is not None and c.error is None for c in result.clients)
    assert seen.most == 1 if gpu else seen.most >= 2


@pytest.mark.parametrize(("threads", "parallel", "each"), [(1, 1, 1), (3, 1, 3), (4, 2, 2)])
def test_clients_train_on_the_threads_the_run_was_given(threads, parallel, each, monkeypatch):
    # Prepare: record torch's intra-op threads while each client trains (before, clients trained
    # one at a time on torch's default pool, whatever --threads said)
    from coordinator.stacking import Stacking

    seen: list[int] = []
    execute = Stacking.execute_together

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return execute(*args, **kwargs)

    monkeypatch.setattr(Stacking, "execute_together", counted)
    torch.set_num_threads(2)
    cfg = tiny_config(
        algorithm="local", clients=2, rounds=1, threads=threads, parallel=parallel, cohort=False
    )

    # Execute
    run_federation(cfg, prepare_federation(cfg), "local")

    # Assert: each client (two jobs: unstacked) on its share of the run's threads; torch's own
    # setting restored
    assert seen and set(seen) == {each}
    assert torch.get_num_threads() == 2


def test_a_stack_on_the_cpu_is_dealt_into_one_stack_per_worker_each_on_one_thread(monkeypatch):
    # Prepare: record every stacked job's clients and torch's threads while it trains; eight
    # unequal clients of one architecture, two workers on two threads (before: one stack of
    # eight on both threads, which a competing load slowed below client by client)
    from coordinator.stacking import Stacking

    seen: list[tuple[str, list[str], int]] = []
    execute = Stacking.execute_together

    def counted(self, nodes, tasks):
        seen.append((tasks[0].phase, [n.client_id for n in nodes], torch.get_num_threads()))
        return execute(self, nodes, tasks)

    monkeypatch.setattr(Stacking, "execute_together", counted)
    flags = dict(clients=8, rounds=1, threads=2, parallel=2, **{"data.partition": "dirichlet"})

    # Execute
    cfg = tiny_config(**flags)
    stacked = run_federation(cfg, prepare_federation(cfg), "fedavg")
    during = list(seen)  # (what follows trains one by one)
    cfg = tiny_config(**flags, cohort=False)
    alone = run_federation(cfg, prepare_federation(cfg), "fedavg")

    # Assert: every phase as two stacks of four on one thread each, every client once; and
    # the clients' results those of client by client
    phases = {phase for phase, _, _ in during}
    assert phases == {"fit", "evaluate", "finalize"}
    assert {len(ids) for _, ids, _ in during} == {4} and {t for *_, t in during} == {1}
    for phase in phases:  # (evaluations: more than one a round)
        clients = Counter(c for p, ids, _ in during if p == phase for c in ids)
        assert clients.keys() == {c.id for c in stacked.clients}
        assert len(set(clients.values())) == 1, phase
    assert to_rounding(_accuracies(stacked)) == to_rounding(_accuracies(alone))


def test_the_stack_of_most_work_is_dealt_apart_first_not_the_one_of_most_samples(monkeypatch):
    # Prepare: five mlr clients and four mlp ones (round-robin, iid: 52-53 samples each), three
    # workers: two stacks, one to halve. The mlr stack holds more samples, the mlp one far more
    # work (samples × parameters).
    from coordinator.federation import client_spec
    from coordinator.fleet.base import client_cost
    from coordinator.stacking import Stacking

    seen: list[list[str]] = []
    execute = Stacking.execute_together

    def counted(self, nodes, tasks):
        if tasks[0].phase == "fit":
            seen.append(sorted(n.client_id for n in nodes))
        return execute(self, nodes, tasks)

    monkeypatch.setattr(Stacking, "execute_together", counted)
    cfg = tiny_config(
        algorithm="local", clients=9, rounds=1, threads=3, parallel=3, models=["mlr", "mlp"]
    )
    fed = prepare_federation(cfg)
    mlr, mlp = [f"c{i}" for i in range(0, 9, 2)], [f"c{i}" for i in range(1, 9, 2)]
    n = dict(zip(fed.client_ids, (len(d.y_train) for d in fed.client_data), strict=True))
    work = {f: client_cost(client_spec(cfg, f, fed.dataset), 1) for f in ("mlr", "mlp")}
    assert sum(n[c] for c in mlr) > sum(n[c] for c in mlp)
    assert sum(n[c] for c in mlp) * work["mlp"] > sum(n[c] for c in mlr) * work["mlr"]

    # Execute
    run_federation(cfg, fed, "local")

    # Assert: the mlp stack dealt into two, the mlr stack left whole
    assert sorted(map(len, seen)) == [2, 2, 5], seen
    assert mlr in seen and sorted(c for ids in seen if ids != mlr for c in ids) == mlp


def _accuracies(result):
    return {c.id: c.personal_acc for c in result.clients}


def test_stacks_are_dealt_apart_by_size_until_the_workers_have_a_job_each():
    from coordinator.fleet.local import _spread

    sizes = dict(zip("abcdefgh", [80, 10, 70, 20, 60, 30, 50, 40], strict=True)) | {"x": 5}
    jobs = [(list("abcdefgh"), True), (["x"], False)]

    # Three workers: the stack of eight halved, its clients dealt by size in turn
    assert _spread(jobs, 3, sizes.__getitem__) == [
        (["a", "e", "h", "d"], True),
        (["c", "g", "f", "b"], True),
        (["x"], False),
    ]
    # Four: then the larger half (200 samples against 160) halved again
    assert [ids for ids, _ in _spread(jobs, 4, sizes.__getitem__)] == [
        ["a", "h"],
        ["e", "d"],
        ["c", "g", "f", "b"],
        ["x"],
    ]
    # Enough jobs already, a GPU's stack (not to be dealt apart), a stack of three: as they are
    assert _spread(jobs, 2, sizes.__getitem__) == jobs
    assert _spread([(list("abcdefgh"), False)], 4, sizes.__getitem__) == [(list("abcdefgh"), False)]
    assert _spread([(list("abc"), True)], 4, sizes.__getitem__) == [(list("abc"), True)]


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fml", "federico"])
def test_clients_training_at_once_on_cuda_all_finish(algorithm):
    # Prepare: six clients of two architectures on CUDA, as many threads as clients (stacks
    # of FML, FedeRiCo's clients one by one: each captures its steps in CUDA graphs)
    cfg = tiny_config(
        algorithm=algorithm,
        clients=6,
        rounds=3,
        models=["mlr", "mlp"],
        global_model="mlr",
        device="cuda",
        parallel=6,
        overrides=EVERY_ALGORITHM.get(algorithm, {}),
    )

    # Execute
    result = run_federation(cfg, prepare_federation(cfg), algorithm)

    # Assert: no round failed, every client finished with a personalized model
    assert not any(r.failed for r in result.rounds)
    assert all(c.personal_acc is not None and c.error is None for c in result.clients)


def test_a_client_waiting_for_its_peers_lets_them_take_their_turn_on_the_gpu(monkeypatch):
    # Prepare: FedeRiCo's clients as EdgeClients on threads, taking turns as on a GPU (the CPU
    # taken for one); each waits for its neighbours' models inside its turn, which their owners
    # publish inside theirs; a wait that held the turn would time out
    import edge_sdk.device

    monkeypatch.setattr(edge_sdk.device, "_takes_turns", lambda device: True)
    overrides = EVERY_ALGORITHM["federico"] | {"federico.peer_timeout_s": 10.0}
    cfg = tiny_config(
        algorithm="federico",
        clients=3,
        rounds=2,
        models=["mlr"],
        fleet="network",
        parallel=3,
        overrides=overrides,
    )

    # Execute
    result = run_federation(cfg, prepare_federation(cfg), "federico")

    # Assert: in every round, every client weighed both neighbours' models and received both
    # their gradients (none timed out)
    for rec in result.rounds:
        assert rec.train_metrics["gradients_received"] == 2.0, rec
        assert all(len(d) == 3 for d in rec.client_details.values()), rec.client_details
    assert all(c.personal_acc is not None for c in result.clients)
