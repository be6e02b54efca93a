"""What a finalize task carries for the guard's peers (`guard_peers`): the last aggregation's
trained copies of the global model, none that aggregation had to bound, at most
`guard_peers_offered`; kept through a checkpoint; refused where there is no global model to
copy. And a simulation's devices report whose copies they mixed."""

import json

import numpy as np
import pytest
import torch
from tests_helpers import raises_exactly

from coordinator.config import load_config
from coordinator.simulator import simulate
from coordinator.strategies import ClientInfo, FitReply, StrategyError, strategy_class
from edge_sdk.algorithms import algorithm_class
from edge_sdk.algorithms.deployment import peer_name
from edge_sdk.codec import WireModel
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec, build

MLR = ArchSpec(family="mlr", num_classes=2, input_shape=(2,))


def _strategy(name, n=4, **cfg):
    clients = {
        f"c{i}": ClientInfo(f"c{i}", MLR, Capabilities(n_train=10, num_classes=2)) for i in range(n)
    }
    config = algorithm_class(name).config_cls(**cfg)
    s = strategy_class(name)(config, clients=clients, global_spec=MLR, rounds=3, seed=0)
    s.setup()
    return s


def _moved(by: float) -> dict[str, torch.Tensor]:
    """The seeded initial MLR (the strategy's global model) moved by `by` in every weight."""
    return {k: v + by for k, v in build(MLR, seed=0).state_dict().items()}


def _replies(name: str, moves: dict[str, float]) -> dict[str, FitReply]:
    key = {"fml": "meme", "pfml": "local", "persfl": "model", "fedavg": "model"}[name]
    return {
        cid: FitReply(cid, {key: WireModel(MLR, _moved(by))}, n_samples=10)
        for cid, by in moves.items()
    }


def _round(s, round_: int, replies: dict[str, FitReply]) -> None:
    s.configure_fit(round_)  # (PFML aggregates the clients it sampled there)
    s.aggregate_fit(round_, replies)


@pytest.mark.parametrize("name", ["fml", "pfml", "persfl"])
def test_finalize_carries_the_last_aggregations_copies_but_not_a_bounded_one(name):
    # Prepare: two rounds; in the second, c3's update is a hundred times the others'
    s = _strategy(name, guard_peers=2)
    _round(s, 1, _replies(name, {"c0": 0.5, "c1": 0.5, "c2": 0.5, "c3": 0.5}))
    s.flags.clear()  # (the coordinator's, between rounds)
    s.global_weights = _moved(0.0)
    second = {"c0": 0.1, "c1": 0.2, "c2": 0.3, "c3": 30.0}

    # Execute
    _round(s, 2, _replies(name, second))
    models = s.finalize_models()

    # Assert: the global model, and the second round's copies as they came, c3's left out
    assert "c3" in s.flags
    assert sorted(models) == ["global", *(peer_name(c) for c in ("c0", "c1", "c2"))]
    for c in ("c0", "c1", "c2"):
        sent = models[peer_name(c)]
        assert sent.spec == MLR
        assert all(torch.equal(sent.weights[k], v) for k, v in _moved(second[c]).items())


@pytest.mark.parametrize("offered", [3, 5])
def test_a_finalize_carries_at_most_the_offered_copies_a_draw_seeded_by_the_run(offered):
    picks = []
    for _ in range(2):
        s = _strategy("fml", n=6, guard_peers=1, guard_peers_offered=offered)
        _round(s, 1, _replies("fml", {f"c{i}": 0.1 * (i + 1) for i in range(6)}))
        picks.append(sorted(m for m in s.finalize_models() if m != "global"))
    assert len(picks[0]) == offered and picks[0] == picks[1]  # (distinct: drawn without return)
    first = [peer_name(f"c{i}") for i in range(offered)]
    assert picks[0] != first  # drawn, not the first ones
    # only those are held (and checkpointed) between rounds, not the whole cohort's
    assert sorted(peer_name(c) for c in s.copies) == picks[0]
    assert sorted(s.state_dict()["copies"]) == sorted(s.copies)


def test_the_draw_is_the_one_made_from_every_copy_kept():
    # Prepare: the copies of a round of 30, drawn from at the finalize as before (all held)
    s = _strategy("fml", n=30, guard_peers=1, guard_peers_offered=7)
    replies = _replies("fml", {f"c{i}": 0.01 * (i + 1) for i in range(30)})
    ids = sorted(replies)
    drawn = np.random.default_rng(0).choice(30, size=7, replace=False)  # the run's seed: 0

    # Execute
    _round(s, 1, replies)

    # Assert: the same seven, held as they came
    assert sorted(s.copies) == sorted(ids[i] for i in drawn)
    for cid, state in s.copies.items():
        assert all(torch.equal(state[k], v) for k, v in _moved(0.01 * (int(cid[1:]) + 1)).items())


def test_a_copy_whose_sample_weight_was_capped_is_carried_as_it_came():
    # Prepare: PersFL weighs by samples; c3 claims a thousand times the others' samples
    s = _strategy("persfl", guard_peers=2)
    replies = _replies("persfl", {"c0": 0.1, "c1": 0.2, "c2": 0.3, "c3": 0.4})
    replies["c3"] = FitReply("c3", replies["c3"].models, n_samples=10_000)

    # Execute
    _round(s, 1, replies)
    models = s.finalize_models()

    # Assert: its weight was capped before aggregation combined the copies, and its copy,
    # which aggregation did not bound, is carried
    assert "capped" in s.flags["c3"]
    assert peer_name("c3") in models
    assert all(torch.equal(models[peer_name("c3")].weights[k], v) for k, v in _moved(0.4).items())


def test_the_copies_survive_a_checkpoint():
    s = _strategy("pfml", guard_peers=2)
    _round(s, 1, _replies("pfml", {"c0": 0.1, "c1": 0.2, "c2": 0.3, "c3": 0.4}))
    t = _strategy("pfml", guard_peers=2)
    t.load_state_dict(s.state_dict())
    sent, back = s.finalize_models(), t.finalize_models()
    assert sorted(sent) == sorted(back) and len(sent) == 5
    assert all(torch.equal(back[m].weights[k], v) for m in sent for k, v in sent[m].weights.items())


@pytest.mark.parametrize("name", ["fml", "fedavg"])  # (FedAvg's config has no guard_peers)
def test_without_guard_peers_nothing_is_kept_or_carried(name):
    s = _strategy(name)
    _round(s, 1, _replies(name, {"c0": 0.1, "c1": 0.2, "c2": 0.3, "c3": 0.4}))
    assert list(s.finalize_models()) == ["global"] and "copies" not in s.state_dict()
    assert s.copies == {}


@pytest.mark.parametrize("name", ["fedme", "federico"])
def test_guard_peers_without_one_global_model_is_refused(name):
    config = algorithm_class(name).config_cls(guard_peers=3)
    info = {"c0": ClientInfo("c0", MLR, Capabilities(n_train=10, num_classes=2))}
    with raises_exactly(
        StrategyError,
        f"{name}: guard_peers mixes the clients' trained copies of one global model, which this "
        f"algorithm has not (fml, pfml and persfl have): set {name}.guard_peers = 0",
    ):
        strategy_class(name)(config, clients=info, global_spec=MLR, rounds=3, seed=0)


def test_guard_peers_with_a_shared_backbone_is_refused():
    with raises_exactly(
        StrategyError,
        "fml: guard_peers mixes whole trained copies of the global model, and with "
        "shared_prefixes ['layers.'] the clients send only those tensors: set "
        "fml.guard_peers = 0 or shared_prefixes = []",
    ):
        _strategy("fml", guard_peers=1, shared_prefixes=["layers."])


@pytest.mark.parametrize("fleet", ["local", "network"])
def test_each_device_mixes_the_copies_and_deploys_its_own_architecture(fleet):
    cfg = load_config(
        None,
        {
            "algorithm": "fml",
            "clients": 4,
            "rounds": 2,
            "models": ["mlp", "mlr"],
            "global_model": "mlp",
            "data.dataset": "digits",
            "data.max_samples": 400,
            "fml.batch_size": 16,
            "fml.guard_peers": 2,
            "fml.guard_distill_epochs": 2,
            "fleet": fleet,
            "device": "cpu",
        },
        None,
        environ=False,
    )
    res = json.loads(simulate(cfg, progress=False).to_json())
    ids = {c["id"] for c in res["clients"]}
    for c in res["clients"]:
        mixed = c["guard_peers"].split(", ")
        assert len(mixed) == 2 and set(mixed) <= ids
        assert c["deployed_arch"] == c["arch"]
