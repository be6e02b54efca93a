"""End to end over the in-memory transport: a coordinator plus N EdgeClients, per algorithm."""

import threading
import time
from dataclasses import asdict

import pytest
import torch
from tests_helpers import small_federation, tiny_config

from coordinator.federation import build_coordinator, build_node, prepare_federation
from coordinator.fleet import LocalFleet, NetworkFleet
from coordinator.server import (
    Coordinator,
    CoordinatorError,
    Interrupted,
    RoundConfig,
    eval_sample,
)
from coordinator.simulator import run_federation, simulate
from edge_sdk.algorithms import algorithm_class
from edge_sdk.client import EdgeClient
from edge_sdk.client_data import ClientData
from edge_sdk.node import ClientNode
from edge_sdk.state import load_state, save_state
from edge_sdk.transport import InMemoryBroker
from model_zoo import ArchSpec

CHANCE = 0.1  # ten digit classes


@pytest.mark.parametrize(
    ("algorithm", "flags"),
    [
        ("local", {}),
        ("fedavg", {}),
        ("fedprox", {"overrides": {"fedprox.mu": 0.1}}),
        ("fedavg_ft", {"overrides": {"fedavg_ft.ft_epochs": 1}}),
        ("fml", {}),
        ("pfml", {"lr": 0.05, "overrides": {"pfml.lam": 1.0, "pfml.local_iterations": 20}}),
    ],
)
def test_tiny_federation_learns(algorithm, flags):
    # Prepare: 4 clients on 8×8 digits, IID, mlr everywhere.
    cfg = tiny_config(algorithm=algorithm, **flags)

    # Execute
    results = simulate(cfg, progress=False)

    # Assert: well above chance on each client's own test split, every round recorded.
    assert [r.round for r in results.rounds] == [1, 2, 3]
    assert not any(r.failed for r in results.rounds)
    assert results.summary.mean_personal_acc > 4 * CHANCE
    assert all(c.personal_acc > 3 * CHANCE for c in results.clients)
    if algorithm != "local":
        assert results.summary.global_acc > 3 * CHANCE


def test_fml_with_six_architectures_runs_end_to_end():
    cfg = tiny_config(
        algorithm="fml",
        models=["mlr", "mlp", "lenet5", "cnn1", "vgg11", "lstm"],
        global_model="mlp",
        clients=6,
        rounds=2,
        local_epochs=1,
        **{"data.options": {"size": 28}, "data.max_samples": 600},
        model_kwargs={"vgg11": {"width": 0.125}},
    )
    results = simulate(cfg, progress=False)
    archs = [c.arch for c in results.clients]
    assert archs == ["mlr", "mlp", "lenet5", "cnn1", "vgg11", "lstm"]
    assert all(c.personal_acc is not None for c in results.clients)
    assert results.summary.mean_personal_acc > 2 * CHANCE


def test_same_seed_gives_same_results():
    def run(seed):
        cfg = tiny_config(
            algorithm="fml",
            seed=seed,
            rounds=2,
            clients_per_round=3,
            models=["mlr", "mlp"],
            global_model="mlr",
            parallel=3,
        )
        res = simulate(cfg, progress=False)
        return [c.personal_acc for c in res.clients], [r.global_acc for r in res.rounds]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_fedavg_across_architectures_is_refused_with_a_clear_error():
    cfg = tiny_config(algorithm="fedavg", models=["mlr", "mlp"], rounds=1)
    fed = prepare_federation(cfg)
    with pytest.raises(ValueError, match="one architecture"):
        run_federation(cfg, fed, "fedavg", models=["mlr", "mlp"])


def test_baselines_feed_the_personalization_metrics(tmp_path):
    cfg = tiny_config(
        algorithm="fml",
        baselines=["local", "fedavg"],
        out=str(tmp_path),
        models=["mlr", "mlp"],
        global_model="mlr",
        rounds=2,
    )
    results = simulate(cfg, progress=False)
    metrics = results.summary.metrics
    assert {"PUI", "PUD", "MPI", "API", "MPD", "APD", "AV", "CS", "Entropy", "JI"} <= set(metrics)
    assert all(c.local_acc is not None and c.global_acc is not None for c in results.clients)
    assert (tmp_path / "results.json").is_file() and (tmp_path / "report.md").is_file()
    assert set(results.baselines) == {"local", "fedavg"}


# -- resilience: clients that fail, stall or never come ------------------------------------
def test_a_failing_client_is_reported_and_the_round_goes_on_with_quorum():
    coordinator, clients = small_federation(quorum=0.5)

    def broken(*a, **k):
        raise RuntimeError("battery died")

    clients[0].run_task = broken  # this device's training blows up every time
    for c in clients:
        c.start()
    result = coordinator.run()
    assert all(not r.failed for r in result.rounds)
    assert all(r.replied == ["c1", "c2"] for r in result.rounds)
    assert "battery died" in clients[0].errors[0]
    assert result.clients[0].error is not None and result.clients[1].personal_acc is not None


def test_below_quorum_the_round_fails_and_state_is_unchanged():
    coordinator, clients = small_federation(quorum=1.0)
    clients[0].run_task = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no"))
    for c in clients:
        c.start()
    rounds = []
    coordinator.on_round = lambda rec: rounds.append(
        {k: v.clone() for k, v in coordinator.strategy.global_weights.items()}
    )
    result = coordinator.run()
    assert all(r.failed for r in result.rounds)
    assert all(torch.equal(rounds[0][k], rounds[1][k]) for k in rounds[0])


def test_pfml_round_fails_when_no_aggregated_client_replied_though_others_did():
    # Prepare: everyone trains, one of three is aggregated; that one's fit always fails.
    coordinator, clients = small_federation(
        algorithm="pfml",
        config={"participation": "all", "local_iterations": 2},
        clients_per_round=1,
        quorum=0.5,
    )
    for c in clients:
        original = c.run_task

        def fail_if_aggregated(task, blobs, c=c, original=original):
            if task.phase == "fit" and c.client_id in coordinator.strategy._aggregate_ids:
                raise RuntimeError("the aggregated client's battery died")
            return original(task, blobs)

        c.run_task = fail_if_aggregated
    for c in clients:
        c.start()
    before = []
    coordinator.on_round = lambda rec: before.append(
        {k: v.clone() for k, v in coordinator.strategy.global_weights.items()}
    )

    # Execute
    result = coordinator.run()

    # Assert: two of three replied (above quorum by count), but nothing was aggregated.
    assert all(len(r.replied) == 2 for r in result.rounds)
    assert all(r.failed for r in result.rounds)
    assert all(torch.equal(before[0][k], before[1][k]) for k in before[0])


def test_a_stalled_client_does_not_block_the_round_past_its_deadline():
    coordinator, clients = small_federation(quorum=0.5, deadline_s=1.0)
    release = threading.Event()
    original = clients[2].run_task

    def stall(*a, **k):
        release.wait(10)
        return original(*a, **k)

    clients[2].run_task = stall
    for c in clients:
        c.start()
    try:
        result = coordinator.run()
    finally:
        release.set()
    assert all("c2" not in r.replied for r in result.rounds)
    assert result.rounds[-1].mean_personal_acc is not None


def test_too_few_registrations_is_a_clear_error():
    coordinator, clients = small_federation(register_timeout_s=0.5)
    clients[0].start()
    with pytest.raises(CoordinatorError, match="1 of 3 clients registered"):
        coordinator.run()


def test_nan_weights_from_a_client_are_dropped_not_aggregated():
    coordinator, clients = small_federation(quorum=0.5)
    original = clients[0].run_task

    def poisoned(task, blobs):
        result = original(task, blobs)
        for w in result.models.values():
            next(iter(w.weights.values())).fill_(float("nan"))
        return result

    clients[0].run_task = poisoned
    for c in clients:
        c.start()
    result = coordinator.run()
    assert all(r.replied == ["c1", "c2"] for r in result.rounds)
    assert all(torch.isfinite(v).all() for v in coordinator.strategy.global_weights.values())


def test_a_task_with_nan_weights_gets_an_error_reply_and_the_client_keeps_serving():
    coordinator, clients = small_federation(quorum=0.5)

    def poison(rec):  # after round 1, corrupt the global model the coordinator will send
        if rec.round == 1:
            next(iter(coordinator.strategy.global_weights.values())).fill_(float("nan"))

    coordinator.on_round = poison
    for c in clients:
        c.start()
    result = coordinator.run()
    assert result.rounds[1].failed  # nobody could train on NaN weights
    assert all("NaN" in c.errors[0] for c in clients)
    assert all(c.tasks_done >= 4 for c in clients)  # and they kept answering tasks


def test_a_coordinator_stopped_mid_run_resumes_from_its_checkpoint_and_ends_the_same(tmp_path):
    def federation(sub, **kw):
        return small_federation(
            n=3,
            algorithm="fml",
            rounds=4,
            config={"local_epochs": 1, "batch_size": 32, "lr": 0.1},
            state_dir=tmp_path / sub / "clients",
            **kw,
        )

    # Reference: uninterrupted.
    coordinator, clients = federation("ref")
    for c in clients:
        c.start()
    reference = coordinator.run()
    ref_global = {k: v.clone() for k, v in coordinator.strategy.global_weights.items()}

    # Interrupted: stopped right after round 2 (round 3's tasks are already out and trained on).
    broker = InMemoryBroker()
    ckpt = tmp_path / "run" / "checkpoint.state"
    first, clients = federation("run", broker=broker, checkpoint_path=ckpt)
    first.on_round = lambda rec: first.stop() if rec.round == 2 else None
    for c in clients:
        c.start()
    with pytest.raises(Interrupted):
        first.run()
    state = load_state(ckpt)
    assert state["records"][-1]["round"] == 2
    # Written before round records counted their online clients (they listed them all): loads.
    for rec in state["records"]:
        rec["online"] = ["c0", "c1", "c2"]
        del rec["offline"]
    save_state(ckpt, state)

    # A new coordinator process: same settings, same checkpoint.
    second = Coordinator(
        NetworkFleet(broker.connect("coordinator-2"), keyring=first.fleet.keyring),
        algorithm="fml",
        config=first.config,
        rounds=4,
        expected_clients=3,
        round_config=first.rc,
        checkpoint_path=ckpt,
    )
    assert second.restore() and [r.round for r in second.records] == [1, 2]
    assert [(r.online, r.offline) for r in second.records] == [(3, [])] * 2
    resumed = second.run()

    assert [r.round for r in resumed.rounds] == [1, 2, 3, 4]
    assert [c.personal_acc for c in resumed.clients] == [c.personal_acc for c in reference.clients]
    assert all(torch.equal(second.strategy.global_weights[k], v) for k, v in ref_global.items())
    assert second.incarnation > first.incarnation
    for c in clients:
        c.stop()


def test_a_fleet_past_client_history_checkpoints_compact_rounds_and_reports_them_whole(
    tmp_path,
):
    # Prepare: 3 clients × 3 rounds = 9 client-rounds, over a limit of 8.
    ckpt = tmp_path / "checkpoint.state"
    coordinator, clients = small_federation(n=3, rounds=3, checkpoint_path=ckpt, client_history=8)
    seen = []
    coordinator.on_round = seen.append
    for c in clients:
        c.start()

    # Execute
    result = coordinator.run()

    # Assert: each round was reported whole as it ended (the daemon's rounds.jsonl line)...
    assert [(r.trained, r.replied, len(r.client_acc)) for r in seen] == [(IDS3, IDS3, 3)] * 3
    # ...but the run kept, and checkpointed, each without its clients' parts: a record a round
    # of the same size whatever the fleet's.
    kept = load_state(ckpt)["records"]
    for rec in [*kept, *map(asdict, result.rounds)]:
        assert rec["trained"] == rec["replied"] == rec["offline"] == []
        assert rec["client_acc"] == rec["client_details"] == {}
        assert (rec["n_trained"], rec["n_replied"], rec["acc_spread"]["n"]) == (3, 3, 3)
    for c in clients:
        c.stop()


IDS3 = ["c0", "c1", "c2"]


def test_a_client_with_an_unknown_architecture_is_refused_and_told_why():
    cfg = tiny_config(clients=2, rounds=1)
    fed = prepare_federation(cfg)
    broker = InMemoryBroker()
    coordinator = Coordinator(
        NetworkFleet(broker.connect()),
        algorithm="local",
        config=algorithm_class("local").config_cls(local_epochs=1),
        rounds=1,
        expected_clients=1,
        round_config=RoundConfig(deadline_s=30, register_timeout_s=30),
    ).open()
    bogus = ArchSpec(family="transformer9000", num_classes=10, input_shape=(1, 8, 8))
    good = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    bad_client = EdgeClient(ClientNode("bad", bogus, fed.client_data[0]), broker.connect()).start()
    good_client = EdgeClient(ClientNode("good", good, fed.client_data[1]), broker.connect()).start()
    result = coordinator.run()
    deadline = time.monotonic() + 5
    while bad_client.accepted is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the refusal is handled on the client's own thread
    assert [c.id for c in result.clients] == ["good"]
    assert bad_client.accepted is False and good_client.accepted is True
    bad_client.stop()
    good_client.stop()


def test_an_aggregation_that_refuses_the_replies_fails_the_round_not_the_run(monkeypatch):
    coordinator, clients = small_federation()
    calls = []

    def refuse(self, r, replies):
        calls.append(r)
        raise ValueError("inconsistent replies")

    monkeypatch.setattr(coordinator.strategy_cls, "aggregate_fit", refuse)
    for c in clients:
        c.start()
    result = coordinator.run()
    assert calls == [1, 1, 2, 2] and all(r.failed for r in result.rounds)  # each retried once
    assert all(c.personal_acc is not None for c in result.clients)


def test_a_round_that_misses_quorum_is_retried_and_can_succeed(tmp_path):
    failures = {"left": 1}

    class FailsOnce(EdgeClient):
        def run_task(self, task, blobs):
            if task.phase == "fit" and failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("flaky radio")
            return super().run_task(task, blobs)

    coordinator, clients = small_federation(client_cls=FailsOnce, quorum=1.0, retries=1)
    for c in clients:
        c.start()
    result = coordinator.run()
    assert not any(r.failed for r in result.rounds)
    assert result.rounds[0].replied == ["c0", "c1", "c2"]


def test_a_round_with_no_valid_reply_is_never_counted_as_aggregated():
    coordinator, clients = small_federation(
        algorithm="local", rounds=2, retries=0, reconnect_grace_s=0
    )

    def everyone_vanishes(rec):  # after round 1 every client's connection dies: wills fire
        if rec.round == 1:
            for c in clients:
                c.transport.abort()

    coordinator.on_round = everyone_vanishes
    for c in clients:
        c.start()
    result = coordinator.run()
    assert not result.rounds[0].failed and result.rounds[1].failed
    assert result.rounds[1].trained == []


def test_fml_federates_clients_with_different_numbers_of_classes_through_a_shared_backbone():
    # Prepare: two devices on different tasks (3 vs 5 digit classes), one conv backbone shared.
    from model_zoo.data import load_dataset

    digits = load_dataset("digits", size=8)
    x, y = digits.x, digits.y
    broker = InMemoryBroker()
    config = algorithm_class("fml").config_cls(
        local_epochs=2, batch_size=32, lr=0.05, shared_prefixes=["features."]
    )
    coordinator = Coordinator(
        NetworkFleet(broker.connect()),
        algorithm="fml",
        config=config,
        rounds=2,
        expected_clients=2,
        global_model="cnn1",
        round_config=RoundConfig(deadline_s=60, register_timeout_s=30),
    ).open()
    clients = []
    for cid, labels in (("three", [0, 1, 2]), ("five", [3, 4, 5, 6, 7])):
        keep = torch.isin(y, torch.tensor(labels))
        xi = x[keep]
        yi = torch.searchsorted(torch.tensor(labels), y[keep])  # remap to 0..k-1
        n = len(yi)
        tr, te = slice(0, int(0.7 * n)), slice(int(0.7 * n), n)
        data = ClientData(xi[tr], yi[tr], xi[:0], yi[:0], xi[te], yi[te], num_classes=len(labels))
        spec = ArchSpec(family="mlr", num_classes=len(labels), input_shape=(1, 8, 8))
        clients.append(EdgeClient(ClientNode(cid, spec, data), broker.connect()).start())

    # Execute
    result = coordinator.run()

    # Assert: both learn their own task; only backbone tensors are global.
    assert all(not r.failed for r in result.rounds)
    accs = {c.id: c.personal_acc for c in result.clients}
    assert accs["three"] > 0.8 and accs["five"] > 0.6
    assert set(coordinator.strategy.global_weights) == {
        "features.0.weight",
        "features.0.bias",
        "features.3.weight",
        "features.3.bias",
    }
    for c in clients:
        c.stop()


@pytest.mark.parametrize("algorithm", ["pfml", "fml", "fedavg_ft", "local"])
def test_eval_every_does_not_change_results(algorithm):
    # Prepare: 8 clients, 2 sampled per round, 3 rounds; only the evaluation schedule differs.
    def run(eval_every):
        cfg = tiny_config(
            algorithm=algorithm,
            clients=8,
            clients_per_round=2,
            rounds=3,
            lr=0.05,
            **{"round.eval_every": eval_every},
        )
        return simulate(cfg, progress=False)

    # Execute
    every_round, last_only = run(1), run(3)

    # Assert: evaluation changes no state, so every final number is the same.
    def finals(res):
        clients = [(c.personal_acc, c.global_acc) for c in res.clients]
        return clients, res.summary.global_acc, res.summary.mean_personal_acc

    assert finals(every_round) == finals(last_only)
    assert [r.global_acc for r in last_only.rounds][:2] == [None, None]


def test_the_evaluation_sample_gives_each_architecture_its_share_and_depends_on_the_seed_alone():
    # Prepare: 90 mlr, 9 mlp, 1 lstm clients
    fams = {f"c{i:03d}": "mlr" if i < 90 else "mlp" if i < 99 else "lstm" for i in range(100)}

    def counts(sample):
        return {f: sum(fams[c] == f for c in sample) for f in ("mlr", "mlp", "lstm")}

    # Execute / Assert: a seat each, then seat by seat to the one furthest below its share (of
    # 10: 9, 0.9, 0.1; of 20: 18, 1.8, 0.2; of 40: 36, 3.6, 0.4); the lone lstm is never left out
    # while there are seats enough, and too few seats go to the largest
    assert counts(eval_sample(fams, 10, seed=0)) == {"mlr": 8, "mlp": 1, "lstm": 1}
    assert counts(eval_sample(fams, 20, seed=0)) == {"mlr": 18, "mlp": 1, "lstm": 1}
    assert counts(eval_sample(fams, 40, seed=0)) == {"mlr": 36, "mlp": 3, "lstm": 1}
    assert counts(eval_sample(fams, 2, seed=0)) == {"mlr": 2, "mlp": 0, "lstm": 0}
    assert eval_sample(fams, 100, seed=0) == eval_sample(fams, 500, seed=3) == frozenset(fams)
    # the same clients and seed draw the same; another seed draws others
    assert eval_sample(dict(reversed(fams.items())), 10, seed=0) == eval_sample(fams, 10, seed=0)
    assert eval_sample(fams, 10, seed=1) != eval_sample(fams, 10, seed=0)


def test_a_deployment_evaluates_the_sample_each_round_and_finalizes_every_device():
    # Prepare: the daemon's coordinator (no federation at hand) over 4 clients, 2 evaluated
    cfg = tiny_config(algorithm="fedavg", rounds=2, **{"round.eval_clients": 2})
    fed = prepare_federation(cfg)
    fleet = LocalFleet([build_node(cfg, fed, i) for i in range(4)])

    # Execute
    result = build_coordinator(cfg, fleet).run()

    # Assert: rounds judge the sample; every device still gets its model and its accuracy
    assert [len(r.client_acc) for r in result.rounds] == [2, 2]
    assert [c.id for c in result.clients] == ["c0", "c1", "c2", "c3"]
    assert all(c.personal_acc is not None for c in result.clients) and result.population is None


def test_fedavg_ft_reports_the_fine_tuned_models_it_deploys_as_its_best():
    cfg = tiny_config(algorithm="fedavg_ft", overrides={"fedavg_ft.ft_epochs": 1})
    results = simulate(cfg, progress=False)
    summary = results.summary
    # No personalized model exists before fine-tuning: rounds report the global model only.
    assert all(r.mean_personal_acc is None for r in results.rounds)
    assert all(r.global_acc is not None for r in results.rounds)
    assert summary.best_mean_personal_acc == summary.mean_personal_acc


def test_results_say_what_local_training_budget_each_run_got():
    cfg = tiny_config(
        algorithm="pfml",
        baselines=["local"],
        lr=0.05,
        overrides={"pfml.local_iterations": 7, "pfml.lam": 1.0},
        rounds=1,
        clients=2,
    )
    results = simulate(cfg, progress=False)
    assert results.budget == {
        "pfml": {"local_iterations": 7, "batch_size": 32, "lr": 0.05},
        "local": {"local_epochs": 5, "batch_size": 32, "lr": 0.05},
    }


def test_a_client_joining_after_a_persfl_run_personalizes_from_its_archive():
    # Prepare: a finished PersFL run that archives its last two global models.
    broker = InMemoryBroker()
    config = {
        "local_epochs": 1,
        "archive_size": 2,
        "distill_lambdas": [0.0, 0.5],
        "distill_temperatures": [2.0],
        "distill_epochs": 1,
    }
    coordinator, clients = small_federation(
        n=2, algorithm="persfl", rounds=3, broker=broker, config=config
    )
    for c in clients:
        c.start()
    coordinator.run()
    for c in clients:
        c.stop()
    archive = coordinator.strategy.archived_models()
    # A device that was not in the run: data of a fourth client of the same split.
    data = prepare_federation(tiny_config(clients=3)).client_data[2]
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    late = EdgeClient(ClientNode("late", spec, data, seed=7), broker.connect("late"))
    # Execute
    result = late.join_late(timeout=10)

    # Assert: its teacher is the archived model with the lowest validation loss on its own data
    # (computed here), and it distilled a student (ONNX export is the same path as at a run's end).
    def val_loss(wire):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        model[1].load_state_dict({k.split(".")[-1]: v for k, v in wire.weights.items()})
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(data.x_val), data.y_val))

    losses = {int(name.split("@")[1]): val_loss(m) for name, m in archive.items()}
    assert sorted(losses) == [2, 3]
    assert result.details["teacher_round"] == min(losses, key=losses.get)
    assert late.finished and late.algorithm is not None and late.algorithm.student is not None
    assert result.metrics["personal_total"] > 0
