"""Server halves: aggregation against hand-computed weights, refusals with clear errors."""

import re

import pytest
import torch

from coordinator.strategies import (
    ClientInfo,
    FitReply,
    IncompatibleClients,
    StrategyError,
    by_what,
    strategy_class,
    weighted_mean,
)
from edge_sdk.algorithms import algorithm_class
from edge_sdk.codec import WireModel
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec

MLR = ArchSpec(family="mlr", num_classes=2, input_shape=(2,))


def _clients(*specs: ArchSpec, n=(10, 30, 60)) -> dict[str, ClientInfo]:
    return {
        f"c{i}": ClientInfo(f"c{i}", s, Capabilities(n_train=n[i], num_classes=s.num_classes))
        for i, s in enumerate(specs)
    }


def _strategy(name, clients, global_spec=MLR, **cfg):
    config = algorithm_class(name).config_cls(**cfg)
    s = strategy_class(name)(config, clients=clients, global_spec=global_spec, rounds=3, seed=0)
    s.setup()
    return s


def _state(value: float) -> dict[str, torch.Tensor]:
    from model_zoo import build

    return {k: torch.full_like(v, value) for k, v in build(MLR).state_dict().items()}


def test_weighted_mean_by_hand():
    states = [
        {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)},
        {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)},
    ]
    out = weighted_mean(states, [1.0, 3.0])
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))  # (1·1 + 3·3)/4, (2 + 18)/4
    assert out["n"].item() == 5  # integer buffers take the max
    with pytest.raises(StrategyError):
        weighted_mean(states, [0.0, 0.0])


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedavg_ft"])
def test_fedavg_weights_by_samples_or_uniformly(name):
    clients = _clients(MLR, MLR, MLR, n=(20, 30, 40))  # none above 1.5 × the median: not capped
    replies = {
        cid: FitReply(cid, {"model": WireModel(MLR, _state(v))}, n_samples=c.capabilities.n_train)
        for (cid, c), v in zip(clients.items(), [1.0, 2.0, 4.0], strict=True)
    }
    s = _strategy(name, clients)  # by_samples is the default
    s.aggregate_fit(1, replies)
    expected = (20 * 1.0 + 30 * 2.0 + 40 * 4.0) / 90
    assert all(torch.allclose(v, torch.full_like(v, expected)) for v in s.global_weights.values())
    assert s.expected_models("c0") == {"model": MLR}
    u = _strategy(name, clients, weighting="uniform")
    u.aggregate_fit(1, replies)
    assert all(torch.allclose(v, torch.full_like(v, 7 / 3)) for v in u.global_weights.values())


def test_a_strategy_has_combined_nothing_before_its_first_aggregation():
    s = _strategy("fedavg", _clients(MLR, MLR))
    assert s.cohort == {} and s.flags == {}


def test_weights_of_another_count_than_the_states_are_refused_not_cut_short():
    s = _strategy("fedavg", _clients(MLR, MLR))
    states = {"c0": _state(1.0), "c1": _state(3.0)}
    with pytest.raises(ValueError, match="zip"):
        s._aggregate(states, [1.0])
    with pytest.raises(ValueError, match="zip"):
        s._aggregate(states, [1.0, 1.0, 1.0])
    assert torch.allclose(s._aggregate(states, [1.0, 1.0])["linear.bias"], torch.full((2,), 2.0))


def test_fedavg_refuses_different_architectures():
    mlp = ArchSpec(family="mlp", num_classes=2, input_shape=(2,))
    with pytest.raises(IncompatibleClients, match="fml, pfml"):
        _strategy("fedavg", _clients(MLR, mlp))


def test_pfml_server_step_with_beta_by_hand():
    clients = _clients(MLR, MLR, MLR)
    s = _strategy("pfml", clients, beta=2.0)
    s.global_weights = _state(1.0)
    s.configure_fit(1)  # everyone sampled (clients_per_round=None)
    replies = {
        cid: FitReply(cid, {"local": WireModel(MLR, _state(v))}, n_samples=5)
        for cid, v in zip(clients, [2.0, 3.0, 4.0], strict=True)
    }
    s.aggregate_fit(1, replies)
    # w ← (1 − β)·w + β·mean = (1 − 2)·1 + 2·3 = 5
    assert all(torch.allclose(v, torch.full_like(v, 5.0)) for v in s.global_weights.values())


def test_pfml_server_step_weights_by_samples_when_asked():
    clients = _clients(MLR, MLR, MLR)  # 10, 30, 60 training samples
    s = _strategy("pfml", clients, beta=0.5, weighting="by_samples")
    s.global_weights = _state(2.0)
    s.configure_fit(1)
    replies = {
        cid: FitReply(cid, {"local": WireModel(MLR, _state(v))}, n_samples=n)
        for cid, v, n in zip(clients, [1.0, 2.0, 4.0], [20, 30, 40], strict=True)
    }
    s.aggregate_fit(1, replies)
    # mean = (20·1 + 30·2 + 40·4)/90 = 8/3; w ← 0.5·2 + 0.5·8/3 = 7/3
    assert all(torch.allclose(v, torch.full_like(v, 7 / 3)) for v in s.global_weights.values())


def test_pfml_quorum_counts_only_the_aggregated_clients_and_none_of_them_is_an_error():
    clients = _clients(MLR, MLR, MLR)
    config = algorithm_class("pfml").config_cls(participation="all")
    s = strategy_class("pfml")(
        config, clients=clients, global_spec=MLR, rounds=3, clients_per_round=1, seed=0
    )
    s.setup()
    plan = s.configure_fit(1)
    (chosen,) = s.quorum_clients(plan)
    assert set(plan) == set(clients) and chosen in plan
    others = {
        cid: FitReply(cid, {"local": WireModel(MLR, _state(1.0))}, n_samples=5)
        for cid in clients
        if cid != chosen
    }
    with pytest.raises(StrategyError, match="no reply from the aggregated clients"):
        s.aggregate_fit(1, others)
    assert strategy_class("fedavg").quorum_clients(s, plan) == set(plan)  # the default: all


def test_pfml_aggregates_only_the_sampled_clients_when_all_train():
    clients = _clients(MLR, MLR, MLR)
    config = algorithm_class("pfml").config_cls(beta=1.0, participation="all")
    s = strategy_class("pfml")(
        config, clients=clients, global_spec=MLR, rounds=3, clients_per_round=1, seed=0
    )
    s.setup()
    plan = s.configure_fit(1)
    assert set(plan) == set(clients)  # all train...
    (chosen,) = s._aggregate_ids
    replies = {
        cid: FitReply(cid, {"local": WireModel(MLR, _state(float(i)))}, n_samples=5)
        for i, cid in enumerate(clients)
    }
    s.aggregate_fit(1, replies)
    value = float(list(clients).index(chosen))  # ...but only the sampled one is averaged
    assert all(torch.allclose(v, torch.full_like(v, value)) for v in s.global_weights.values())


def test_fml_averages_memes_uniformly_by_default():
    lenet = ArchSpec(family="lenet5", num_classes=2, input_shape=(1, 28, 28))
    clients = _clients(MLR.with_(input_shape=(1, 28, 28)), lenet)
    g = ArchSpec(family="mlr", num_classes=2, input_shape=(1, 28, 28))
    s = _strategy("fml", clients, global_spec=g)
    from model_zoo import build

    base = build(g).state_dict()
    replies = {
        cid: FitReply(
            cid,
            {"meme": WireModel(g, {k: torch.full_like(t, v) for k, t in base.items()})},
            n_samples=n,
        )
        for cid, v, n in zip(clients, [1.0, 5.0], [1, 99], strict=True)
    }
    s.aggregate_fit(1, replies)
    assert all(torch.allclose(v, torch.full_like(v, 3.0)) for v in s.global_weights.values())


def test_fml_averages_memes_by_samples_when_asked():
    clients = _clients(MLR, MLR)
    s = _strategy("fml", clients, weighting="by_samples")
    replies = {
        cid: FitReply(cid, {"meme": WireModel(MLR, _state(v))}, n_samples=n)
        for cid, v, n in zip(clients, [1.0, 5.0], [1, 3], strict=True)
    }
    s.aggregate_fit(1, replies)
    assert all(torch.allclose(v, torch.full_like(v, 4.0)) for v in s.global_weights.values())


def test_fml_shared_backbone_aggregates_only_shared_keys_across_class_counts():
    # Two clients with different numbers of classes share only the conv backbone.
    g = ArchSpec(family="cnn1", num_classes=10, input_shape=(1, 28, 28))
    a, b = g.with_(num_classes=3), g.with_(num_classes=5)
    clients = _clients(a, b)
    from model_zoo import build

    prefix = next(iter(build(g).state_dict())).split(".")[0] + "."
    s = _strategy("fml", clients, global_spec=g, shared_prefixes=[prefix])
    assert all(k.startswith(prefix) for k in s.global_weights)
    assert s.expected_models("c0")["meme"].num_classes == 3
    replies = {}
    for (cid, info), v in zip(clients.items(), [2.0, 4.0], strict=True):
        full = build(info.spec).state_dict()
        meme = {k: torch.full_like(t, v) for k, t in full.items() if k.startswith(prefix)}
        replies[cid] = FitReply(cid, {"meme": WireModel(info.spec, meme)}, n_samples=1)
    s.aggregate_fit(1, replies)
    assert all(torch.allclose(v, torch.full_like(v, 3.0)) for v in s.global_weights.values())


def test_fml_without_shared_prefixes_needs_equal_class_counts():
    a = ArchSpec(family="mlr", num_classes=3, input_shape=(2,))
    with pytest.raises(IncompatibleClients, match="classes"):
        _strategy("fml", _clients(a, MLR), global_spec=MLR)


def test_sampling_is_seeded_and_without_replacement():
    clients = _clients(MLR, MLR, MLR)
    config = algorithm_class("fedavg").config_cls()

    def plan(seed):
        s = strategy_class("fedavg")(
            config, clients=clients, global_spec=MLR, rounds=5, clients_per_round=2, seed=seed
        )
        s.setup()
        return [sorted(s.configure_fit(r)) for r in range(1, 6)]

    assert plan(0) == plan(0)
    assert all(len(set(p)) == 2 for p in plan(0))


def test_sampling_from_a_large_fleet_is_fair_and_only_draws_reachable_clients():
    # 1,000 registered clients, 10 a round, 500 rounds: each is drawn Binomial(500, 1/100)
    # times (mean 5, variance 4.95), computed here independently of the strategy; clients that
    # are not reachable (`available`) are never drawn, the others at their fair share.
    clients = _clients(*[MLR] * 1000, n=[10] * 1000)
    s = strategy_class("fedavg")(
        algorithm_class("fedavg").config_cls(),
        clients=clients,
        global_spec=MLR,
        rounds=500,
        clients_per_round=10,
        seed=3,
    )
    s.setup()
    counts = dict.fromkeys(clients, 0)
    for r in range(1, 501):
        for cid in s.sample(r):
            counts[cid] += 1
    drawn = torch.tensor(list(counts.values()), dtype=torch.float64)
    assert drawn.sum() == 5000 and drawn.min() >= 0
    assert abs(drawn.mean() - 5.0) < 1e-9 and 4.0 < drawn.var() < 6.0
    assert (drawn == 0).sum() < 20  # P(never drawn) = 0.99**500 = 0.66%: about 7 of 1,000
    s.available = {f"c{i}" for i in range(0, 1000, 2)}  # half of them offline
    seen = [cid for r in range(100) for cid in s.sample(r)]
    assert set(seen) <= s.available and len(seen) == 1000
    assert len(set(seen)) > 400  # 1 - (1 - 1/50)**100 = 87% of the 500 reachable ones


def test_strategy_state_round_trips():
    clients = _clients(MLR, MLR, MLR)
    s = _strategy("fedavg", clients)
    s.global_weights = _state(7.0)
    state = s.state_dict()
    t = _strategy("fedavg", clients)
    t.load_state_dict(state)
    assert all(torch.equal(t.global_weights[k], s.global_weights[k]) for k in s.global_weights)


def test_unknown_algorithm_names_the_known_ones():
    with pytest.raises(StrategyError, match="fedavg"):
        strategy_class("fedsgd")


def test_weighted_mean_refuses_mismatched_inputs_and_accumulates_in_float64():
    one = {"w": torch.ones(3)}
    with pytest.raises(StrategyError, match=r"^cannot average 2 states with 1 weights$"):
        weighted_mean([one, one], [1.0])
    with pytest.raises(StrategyError, match=r"^cannot average 0 states with 0 weights$"):
        weighted_mean([], [])
    with pytest.raises(StrategyError, match=r"^aggregation weights sum to 0.0$"):
        weighted_mean([one], [0.0])
    # Ten float32 ones at weight 1/10: a float32 running sum ends at 1.0000001, not 1.
    out = weighted_mean([one] * 10, [1.0] * 10)
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], torch.ones(3))


def test_global_model_starts_from_the_seeded_initialisation_and_goes_out_to_every_sampled_client():
    from model_zoo import build

    clients = _clients(MLR, MLR, MLR)
    config = algorithm_class("fedavg").config_cls()
    s = strategy_class("fedavg")(
        config, clients=clients, global_spec=MLR, rounds=3, clients_per_round=2, seed=7
    )
    s.setup()
    expected = build(MLR, seed=7).state_dict()
    assert all(torch.equal(s.global_weights[k], v) for k, v in expected.items())
    default = strategy_class("fedavg")(config, clients=clients, global_spec=MLR, rounds=3)
    default.setup()  # the default seed is 0
    zero = build(MLR, seed=0).state_dict()
    assert all(torch.equal(default.global_weights[k], v) for k, v in zero.items())
    plan = s.configure_fit(1)
    assert len(plan) == 2 and set(plan) <= set(clients)
    for models in plan.values():
        assert set(models) == {"global"} and models["global"].spec == MLR
        assert all(torch.equal(models["global"].weights[k], v) for k, v in expected.items())


def test_global_model_strategies_name_what_is_missing_or_incompatible():
    mlp = ArchSpec(family="mlp", num_classes=2, input_shape=(2,))
    with pytest.raises(
        StrategyError,
        match=r"^fedavg needs a global model architecture: the clients run different "
        r"architectures, so name one with `global_model` \(e.g. --set global_model=lenet5\)$",
    ):
        _strategy("fedavg", _clients(MLR, mlp), global_spec=None)
    with pytest.raises(
        IncompatibleClients, match=re.escape(f"but 1 client registered another ({mlp}: c1)")
    ):
        _strategy("fedavg", _clients(MLR, mlp))


def test_a_population_refused_is_named_by_group_in_a_line():
    # Prepare: 500 clients of one architecture and 2 of another, against the global mlr
    mlp, lstm = (ArchSpec(family=f, num_classes=2, input_shape=(2,)) for f in ("mlp", "lstm"))
    said = {f"c{i}": str(mlp) for i in range(500)} | {"x0": str(lstm), "x1": str(lstm)}

    # Execute / Assert: the largest group first, three of each named
    assert by_what(said) == f"{mlp}: c0, c1, c2 and 497 more; {lstm}: x0, x1"
    clients = _clients(MLR, *[mlp] * 500, n=[10] * 501)
    with pytest.raises(IncompatibleClients) as caught:
        _strategy("fedavg", clients)
    said = f"500 clients registered another ({mlp}: c1, c10, c100 and 497 more)"
    assert said in str(caught.value)
    three = ArchSpec(family="mlr", num_classes=3, input_shape=(2,))
    with pytest.raises(IncompatibleClients, match=re.escape("but 1 client has others (3: c1)")):
        _strategy("fml", _clients(MLR, three))
    with pytest.raises(
        IncompatibleClients, match=re.escape("but 2 clients have others (3: c1, c2)")
    ):
        _strategy("fml", _clients(MLR, three, three, n=[10] * 3))


def test_strategy_registry_refuses_duplicates_and_lists_the_known_ones():
    from coordinator.strategies import base as strategy_base
    from coordinator.strategies import register_strategy, strategy_names
    from edge_sdk.algorithms import algorithm_names

    assert strategy_names() == sorted(strategy_base._REGISTRY) == algorithm_names()
    known = ", ".join(strategy_names())
    with pytest.raises(StrategyError, match=rf"^unknown algorithm 'nope'; known: {known}$"):
        strategy_class("nope")
    fedavg = strategy_class("fedavg")
    with pytest.raises(ValueError, match=r"^strategy 'fedavg' is already registered$"):
        register_strategy(fedavg)

    class Orphan(fedavg):  # no device half of that name: refused
        name = "orphan_for_test"

    with pytest.raises(ValueError, match="orphan_for_test"):
        register_strategy(Orphan)
    assert "orphan_for_test" not in strategy_names()

    class Again(fedavg):  # a second fedavg strategy under a name that has a device half
        name = "local"

    saved = strategy_base._REGISTRY.pop("local")
    try:
        assert register_strategy(Again) is Again and strategy_class("local") is Again
    finally:
        strategy_base._REGISTRY["local"] = saved


def test_pfml_sampled_participation_trains_only_the_sampled_clients():
    clients = _clients(MLR, MLR, MLR)
    config = algorithm_class("pfml").config_cls()  # participation = "sampled"
    s = strategy_class("pfml")(
        config, clients=clients, global_spec=MLR, rounds=3, clients_per_round=1, seed=0
    )
    s.setup()
    plan = s.configure_fit(1)
    assert len(plan) == 1 and set(plan) == s.quorum_clients(plan)
    assert s.expected_models("c0") == {"local": MLR}
    assert set(plan[next(iter(plan))]) == {"global"}


def test_pfml_server_step_leaves_integer_buffers_to_the_mean():
    clients = _clients(MLR, MLR)
    s = _strategy("pfml", clients, beta=2.0)
    s.global_weights = _state(1.0) | {"steps": torch.tensor(3)}
    s.configure_fit(1)
    replies = {
        cid: FitReply(cid, {"local": WireModel(MLR, _state(v) | {"steps": torch.tensor(n)})})
        for cid, v, n in zip(clients, [2.0, 4.0], [5, 9], strict=True)
    }
    s.aggregate_fit(1, replies)
    assert s.global_weights["steps"].item() == 9  # the mean's (max) value, no β step
    assert all(
        torch.allclose(s.global_weights[k], torch.full_like(v, 5.0)) for k, v in _state(0).items()
    )


def test_pfml_state_round_trips_with_the_aggregated_set():
    clients = _clients(MLR, MLR, MLR)
    config = algorithm_class("pfml").config_cls()
    s = strategy_class("pfml")(
        config, clients=clients, global_spec=MLR, rounds=3, clients_per_round=2, seed=0
    )
    s.setup()
    assert s.state_dict()["aggregate_ids"] == []
    s.configure_fit(1)
    state = s.state_dict()
    t = strategy_class("pfml")(
        config, clients=clients, global_spec=MLR, rounds=3, clients_per_round=2, seed=5
    )
    t.setup()
    t.load_state_dict(state)
    assert t.quorum_clients({}) == s.quorum_clients({}) and len(t.quorum_clients({})) == 2
    assert all(torch.equal(t.global_weights[k], v) for k, v in s.global_weights.items())
    assert set(t.configure_fit(2)) == set(s.configure_fit(2))  # same rng state
    older = {k: v for k, v in state.items() if k != "aggregate_ids"}  # a checkpoint without it
    t.load_state_dict(older)
    assert t.quorum_clients({}) == set()


def test_fml_shared_backbone_drops_the_heads_from_full_meme_replies():
    from model_zoo import build

    g = ArchSpec(family="cnn1", num_classes=10, input_shape=(1, 28, 28))
    a = g.with_(num_classes=3)
    clients = _clients(a, a)
    prefix = next(iter(build(g).state_dict())).split(".")[0] + "."
    s = _strategy("fml", clients, global_spec=g, shared_prefixes=[prefix])
    full = build(a).state_dict()
    replies = {
        cid: FitReply(
            cid, {"meme": WireModel(a, {k: torch.full_like(t, v) for k, t in full.items()})}
        )
        for cid, v in zip(clients, [1.0, 3.0], strict=True)
    }
    s.aggregate_fit(1, replies)
    assert set(s.global_weights) == {k for k in full if k.startswith(prefix)}
    assert all(torch.allclose(v, torch.full_like(v, 2.0)) for v in s.global_weights.values())
    short = {cid: FitReply(cid, {"meme": WireModel(a, {})}) for cid in clients}
    with pytest.raises(
        ValueError, match=r"^fml: a meme reply does not carry exactly the shared tensors$"
    ):
        s.aggregate_fit(2, short)
    with pytest.raises(
        ValueError, match=r"^fml: shared_prefixes \['nope\.'\] match no tensor of the global model$"
    ):
        _strategy("fml", clients, global_spec=g, shared_prefixes=["nope."])


def test_strategy_sends_every_client_one_shared_evaluate_and_finalize_plan():
    from coordinator.server_data import ServerData

    clients = _clients(MLR, MLR, MLR)
    s = _strategy("fedavg", clients)
    evaluate, finalize = s.configure_evaluate(1), s.configure_finalize()
    assert set(evaluate) == set(finalize) == set(clients)
    assert len({id(m) for m in evaluate.values()}) == 1  # one dict: encoded once
    assert set(evaluate["c0"]) == {"global"} and set(finalize["c0"]) == {"global"}
    assert isinstance(s.server_data, ServerData) and s.server_data.unlabeled is None
    data = ServerData(unlabeled=torch.zeros(2, 2))
    config = algorithm_class("fedavg").config_cls()
    t = strategy_class("fedavg")(
        config, clients=clients, global_spec=MLR, rounds=3, server_data=data
    )
    assert t.server_data is data
    assert strategy_class("fedavg").unlabeled_holdout(config) == 0


def test_fedavg_refusal_of_mixed_architectures_names_every_alternative():
    mlp = ArchSpec(family="mlp", num_classes=2, input_shape=(2,))
    with pytest.raises(
        IncompatibleClients, match=r"Use fml, pfml, persfl or fedme for heterogeneous models\.$"
    ):
        _strategy("fedavg", _clients(MLR, mlp))


def test_a_one_step_round_is_configure_fit_and_aggregate_fit_of_that_round():
    # The default `steps` is one unnamed step; the step hooks hand the round on unchanged.
    s = _strategy("fedavg", _clients(MLR, MLR), local_epochs=1)
    seen = []
    s.configure_fit = lambda r: seen.append(("configure", r)) or {}
    s.aggregate_fit = lambda r, replies: seen.append(("aggregate", r, dict(replies)))
    assert s.steps == ("",)
    assert s.configure_step(2, "") == {}
    s.aggregate_step(2, "", {"c0": "reply"})
    assert seen == [("configure", 2), ("aggregate", 2, {"c0": "reply"})]
    assert s.task_params(2, "", "c0") == {} and s.results() == {} and not s.late_joiner_models()
