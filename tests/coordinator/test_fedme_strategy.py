"""FedMe's server half: the cluster schedule, exchange within clusters, per-model aggregation,
returning each client the model it chose, and the unlabeled set it clusters on."""

import warnings

import numpy as np
import pytest
import sklearn.cluster
import torch
from safetensors.torch import save_file
from sklearn.exceptions import ConvergenceWarning
from tests_helpers import raises_exactly, tiny_config

from coordinator.federation import prepare_federation
from coordinator.server_data import ServerData, UnlabeledDataError, load_unlabeled
from coordinator.strategies import ClientInfo, FitReply, IncompatibleClients, StrategyError
from coordinator.strategies.fedme import (
    LOGIT_LIMIT,
    FedMeStrategy,
    cluster_models,
    exchange_partners,
    model_logits,
    per_model_average,
    trained_copies,
)
from edge_sdk.algorithms.deployment import UNLABELED
from edge_sdk.algorithms.fedme import FedMeConfig
from edge_sdk.codec import WireModel
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec, build

MLR = ArchSpec(family="mlr", num_classes=2, input_shape=(3,))
MLP = ArchSpec(family="mlp", num_classes=2, input_shape=(3,), kwargs={"hidden": [4]})
U = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))


def _strategy(
    specs, rounds=10, unlabeled=U, seed=0, clients_per_round=None, **cfg
) -> FedMeStrategy:
    clients = {
        f"c{i}": ClientInfo(f"c{i}", s, Capabilities(n_train=10, num_classes=s.num_classes))
        for i, s in enumerate(specs)
    }
    s = FedMeStrategy(
        FedMeConfig(**cfg),
        clients=clients,
        global_spec=None,
        rounds=rounds,
        clients_per_round=clients_per_round,
        seed=seed,
        server_data=ServerData(unlabeled=unlabeled),
    )
    s.setup()
    return s


def _filled(spec: ArchSpec, value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in build(spec).state_dict().items()}


# -- schedule and exchange -----------------------------------------------------------------------
def test_fedme_cluster_counts_follow_the_fraction_of_rounds_done():
    cfg = FedMeConfig()  # 1, 2, 3, 4 clusters from 0, 50, 75, 90 % of the rounds
    got = [cfg.clusters_at(r, 20) for r in range(1, 21)]
    # By hand for 20 rounds: rounds 1-10 → 1, 11-15 → 2, 16-18 → 3, 19-20 → 4.
    assert got == [1] * 10 + [2] * 5 + [3] * 3 + [4] * 2


@pytest.mark.parametrize(
    ("counts", "starts", "needle"),
    [
        ([1, 2], [0.0], "same length"),
        ([1, 2], [0.1, 0.5], "start at 0"),
        ([1, 2], [0.0, 1.0], "below 1"),
    ],
)
def test_fedme_schedule_errors_are_clear(counts, starts, needle):
    with pytest.raises(ValueError, match=needle):
        FedMeConfig(cluster_counts=counts, cluster_starts=starts)


def test_exchange_never_pairs_across_clusters_when_a_partner_exists():
    rng = np.random.default_rng(0)
    ids = [f"c{i}" for i in range(9)]
    for _ in range(200):
        labels = rng.integers(0, 4, size=len(ids)).tolist()
        partners = exchange_partners(ids, labels, rng)
        for cid, label in zip(ids, labels, strict=True):
            mates = [o for o, lab in zip(ids, labels, strict=True) if lab == label and o != cid]
            p = partners[cid]
            assert p != cid
            if mates:
                assert labels[ids.index(p)] == label


def test_exchange_needs_two_clients():
    msg = "fedme exchanges models between at least two clients per round"
    with raises_exactly(StrategyError, msg):
        exchange_partners(["a"], [0], np.random.default_rng(0))


def test_exchange_gives_a_singleton_a_random_other_client():
    rng = np.random.default_rng(1)
    ids, labels = ["a", "b", "c", "d"], [0, 1, 1, 1]  # "a" is alone in its cluster
    seen = {exchange_partners(ids, labels, rng)["a"] for _ in range(100)}
    assert seen == {"b", "c", "d"}


def test_fedme_clusters_models_by_their_outputs_on_the_unlabeled_set():
    # Prepare: six MLR models in two families whose outputs differ in sign; two clusters.
    s = _strategy([MLR] * 6, cluster_counts=[2], cluster_starts=[0.0])
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, generator=g)
    group = {}
    for i, cid in enumerate(s.clients):
        sign = 1.0 if i % 2 == 0 else -1.0
        group[cid] = sign
        w = sign * base + 0.05 * torch.randn(2, 3, generator=g)
        s.models[cid] = WireModel(MLR, {"linear.weight": w, "linear.bias": torch.zeros(2)})

    for r in range(1, 6):
        # Execute
        plan = s.configure_fit(r)

        # Assert: everyone is sent its own model and a partner of its own family
        for cid, models in plan.items():
            assert models["personal"] is s.models[cid]
            partner = s.exchange[cid]
            assert partner != cid and group[partner] == group[cid]
            assert models["exchanged"] is s.models[partner]


def test_a_model_whose_outputs_overflow_sits_alone_instead_of_crashing_the_clustering():
    # Prepare: four sane models and one whose outputs are infinite or NaN on the unlabeled set.
    s = _strategy([MLR] * 5, cluster_counts=[2], cluster_starts=[0.0])
    s.models["c4"] = WireModel(MLR, _filled(MLR, 3e38))
    sane = model_logits([s.models[c] for c in ("c0", "c1")], U)
    # Execute
    features = model_logits([s.models[c] for c in s.clients], U)
    plan = s.configure_fit(1)
    # Assert: clipped, not crashing KMeans; sane outputs untouched; c4 alone in its cluster
    assert np.isfinite(features).all() and np.abs(features).max() == LOGIT_LIMIT
    assert np.array_equal(features[:2], sane)
    assert set(plan) == set(s.clients) and all(s.exchange[c] != "c4" for c in ("c0", "c1"))
    # outputs that are NaN (not a number at all, no sign to clip to) read as 0
    assert not model_logits([WireModel(MLR, _filled(MLR, float("nan")))], U).any()


# Twelve models' outputs whose 3-cluster KMeans solution depends on the initialisations tried.
FEATURES = np.random.default_rng(29).normal(size=(12, 6))


def test_cluster_models_is_seeded_kmeans_with_ten_initialisations():
    # The reference is scikit-learn's KMeans as FedMe's code runs it: 10 k-means++ starts.
    want = sklearn.cluster.KMeans(n_clusters=3, n_init=10, random_state=5).fit_predict(FEATURES)
    for _ in range(3):
        assert cluster_models(FEATURES, 3, seed=5).tolist() == want.tolist()


def test_cluster_models_gives_integer_labels_for_one_cluster_too():
    one = cluster_models(FEATURES, 1, seed=0)
    assert one.tolist() == [0] * 12 and np.issubdtype(one.dtype, np.integer)
    assert np.issubdtype(cluster_models(FEATURES, 3, seed=0).dtype, np.integer)
    assert len(set(cluster_models(FEATURES[:2], 5, seed=0).tolist())) == 2  # k <= models


def test_cluster_models_silences_only_kmeans_convergence_warnings(monkeypatch):
    # Duplicate models (fewer distinct points than clusters) make KMeans warn; nothing else is
    # hidden.
    class _Warns:
        def __init__(self, **kwargs):
            pass

        def fit_predict(self, features):
            warnings.warn("fewer distinct points", ConvergenceWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
            return np.zeros(len(features), dtype=int)

    monkeypatch.setattr(sklearn.cluster, "KMeans", _Warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster_models(FEATURES, 2, seed=0)
    assert [(w.category, str(w.message)) for w in caught] == [(UserWarning, "something else")]


def test_model_logits_are_every_models_raw_outputs_on_every_input_flattened():
    # More inputs than one batch of 1024, so the batching shows.
    x = torch.randn(2100, 3, generator=torch.Generator().manual_seed(3))
    models = [WireModel(MLR, _filled(MLR, 0.5)), WireModel.of(MLR, build(MLR, seed=4))]
    got = model_logits(models, x)
    assert got.shape == (2, 2100 * 2)
    for row, m in zip(got, models, strict=True):
        z = x @ m.weights["linear.weight"].T + m.weights["linear.bias"]
        np.testing.assert_allclose(row, z.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)


def test_model_logits_run_each_model_of_mixed_architectures_with_its_own_weights():
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    models = [
        WireModel.of(MLP, build(MLP, seed=1)),
        WireModel.of(MLR, build(MLR, seed=2)),
        WireModel.of(MLP, build(MLP, seed=3)),
    ]
    got = model_logits(models, x)
    for row, m in zip(got, models, strict=True):
        w = m.weights
        if m.spec == MLP:  # Linear, ReLU, Linear
            h = (x @ w["layers.0.weight"].T + w["layers.0.bias"]).clamp(min=0)
            z = h @ w["layers.2.weight"].T + w["layers.2.bias"]
        else:
            z = x @ w["linear.weight"].T + w["linear.bias"]
        np.testing.assert_allclose(row, z.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)


def test_model_logits_draw_nothing_from_torchs_global_generator():
    # Building the network the models' weights run through draws no random numbers, so how
    # often the coordinator clusters changes no other draw of the process
    models = [WireModel.of(MLP, build(MLP, seed=1)), WireModel.of(MLR, build(MLR, seed=2))]
    before = torch.random.get_rng_state()
    model_logits(models, torch.zeros(2, 3))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_fedme_exchange_plan_is_reproducible_from_the_seed():
    # Sixteen unrelated models, four clusters: KMeans finds different partitions from different
    # starts, so its seed must come from the run's seed.
    def plans(seed):
        s = _strategy([MLR] * 16, seed=seed, cluster_counts=[4], cluster_starts=[0.0])
        g = torch.Generator().manual_seed(1)
        for cid in s.clients:
            w = {
                "linear.weight": torch.randn(2, 3, generator=g),
                "linear.bias": torch.randn(2, generator=g),
            }
            s.models[cid] = WireModel(MLR, w)
        out = []
        for r in range(1, 5):
            s.configure_fit(r)
            out.append(dict(s.exchange))
        return out

    assert plans(0) == plans(0)


def test_fedme_initial_models_are_seeded_per_client_and_per_run():
    def initial(seed):
        return {c: m.weights for c, m in _strategy([MLR] * 3, seed=seed).models.items()}

    a, again, other = initial(0), initial(0), initial(1)
    for c in a:
        assert all(torch.equal(a[c][k], again[c][k]) for k in a[c])  # reproducible
        assert not torch.equal(a[c]["linear.weight"], other[c]["linear.weight"])  # run seed
    assert not torch.equal(a["c0"]["linear.weight"], a["c1"]["linear.weight"])  # per client


# -- aggregation ---------------------------------------------------------------------------------
def _reply(cid, personal, exchanged, adopted):
    return FitReply(
        cid, {"personal": personal, "exchanged": exchanged}, metrics={"adopted": float(adopted)}
    )


def test_per_model_average_is_the_owner_and_its_copies_over_s_plus_one():
    # c0 owns an MLR that c1 and c2 were sent; c1 owns an MLP sent to c0; c2's MLR went to nobody.
    exchange = {"c0": "c1", "c1": "c0", "c2": "c0"}
    replies = {
        "c0": _reply(
            "c0", WireModel(MLR, _filled(MLR, 1.0)), WireModel(MLP, _filled(MLP, 10.0)), 0
        ),
        "c1": _reply(
            "c1", WireModel(MLP, _filled(MLP, 20.0)), WireModel(MLR, _filled(MLR, 4.0)), 0
        ),
        "c2": _reply(
            "c2", WireModel(MLR, _filled(MLR, 7.0)), WireModel(MLR, _filled(MLR, 13.0)), 0
        ),
    }
    out = per_model_average(replies, exchange)
    expected = {"c0": (1 + 4 + 13) / 3, "c1": (20 + 10) / 2, "c2": 7.0}
    assert set(out) == set(expected)
    for m, value in expected.items():
        assert all(torch.allclose(v, torch.full_like(v, value)) for v in out[m].values()), m


def test_per_model_average_pulls_a_far_copy_in_and_flags_nobody():
    # c0's model and five copies of it: four at 1, one at 100. Five or more: centered clipping
    # pulls the far one in to the others, all at the median (the uniform mean would be 17.5);
    # per_model_average has no round to flag it in.
    exchange = {"c0": "c1", **{f"c{i}": "c0" for i in range(1, 6)}}
    replies = {
        c: _reply(
            c,
            WireModel(MLR, _filled(MLR, 1.0)),
            WireModel(MLR, _filled(MLR, 100.0 if c == "c5" else 1.0)),
            0,
        )
        for c in exchange
    }
    out = per_model_average(replies, exchange)
    assert all(torch.equal(v, torch.ones_like(v)) for v in out["c0"].values())


def test_the_trained_copies_of_a_model_start_with_its_owners_own():
    # c2's copy of c0's model arrives before c0's own reply: the owner's still comes first, so
    # each model's sum runs in one order whatever order the replies came in.
    exchange = {"c2": "c0", "c0": "c1", "c1": "c0"}
    replies = {
        c: _reply(c, WireModel(MLR, _filled(MLR, i)), WireModel(MLR, _filled(MLR, 10 + i)), 0)
        for i, c in enumerate(exchange)
    }
    got = {
        m: [copy.client for copy in copies]
        for m, copies in trained_copies(replies, exchange).items()
    }
    assert got == {"c2": ["c2"], "c0": ["c0", "c2", "c1"], "c1": ["c1", "c0"]}
    assert float(trained_copies(replies, exchange)["c0"][0].state["linear.bias"][0]) == 1.0


def test_fedme_returns_each_client_the_aggregate_of_the_model_it_chose():
    # Prepare: c0 (mlr) and c1 (mlp) swap models; c1 adopts c0's MLR, c0 keeps its own.
    s = _strategy([MLR, MLP])
    s.configure_fit(1)
    assert s.exchange == {"c0": "c1", "c1": "c0"}
    replies = {
        "c0": _reply("c0", WireModel(MLR, _filled(MLR, 2.0)), WireModel(MLP, _filled(MLP, 5.0)), 0),
        "c1": _reply("c1", WireModel(MLP, _filled(MLP, 3.0)), WireModel(MLR, _filled(MLR, 4.0)), 1),
    }

    # Execute
    s.aggregate_fit(1, replies)

    # Assert: both now hold the MLR (2 + 4) / 2 = 3; the MLP (3 + 5) / 2 is nobody's any more.
    for cid in ("c0", "c1"):
        m = s.models[cid]
        assert m.spec == MLR
        assert all(torch.allclose(v, torch.full_like(v, 3.0)) for v in m.weights.values())
    evals = s.configure_evaluate(1)
    assert {c: m["personal"].spec for c, m in evals.items()} == {"c0": MLR, "c1": MLR}
    assert s.configure_finalize()["c1"]["personal"] is s.models["c1"]


def test_fedme_clients_not_sampled_keep_their_models():
    # Prepare: two of three clients train each round; the third's model is nobody's partner.
    s = _strategy([MLR, MLR, MLR], clients_per_round=2)
    plan = s.configure_fit(1)
    (idle,) = set(s.clients) - set(plan)
    kept = s.models[idle]
    replies = {
        c: _reply(c, WireModel(MLR, _filled(MLR, 2.0)), WireModel(MLR, _filled(MLR, 4.0)), 0)
        for c in plan
    }

    # Execute
    s.aggregate_fit(1, replies)

    # Assert: the trained pair average their models, (2 + 4) / 2; the idle client keeps its own.
    assert s.models[idle] is kept
    for c in plan:
        assert all(torch.allclose(v, torch.full_like(v, 3.0)) for v in s.models[c].weights.values())
    assert set(s.configure_evaluate(2)) == set(s.clients)


def test_fedme_refuses_a_reply_that_does_not_say_whether_it_adopted():
    s = _strategy([MLR, MLR])
    s.configure_fit(1)
    bad = FitReply(
        "c0",
        {"personal": WireModel(MLR, _filled(MLR, 1)), "exchanged": WireModel(MLR, _filled(MLR, 1))},
    )
    with pytest.raises(StrategyError, match="adopted"):
        s.aggregate_fit(1, {"c0": bad})


def test_fedme_state_survives_a_checkpoint():
    s = _strategy([MLR, MLP, MLR])
    s.configure_fit(1)
    fresh = _strategy([MLR, MLP, MLR])
    fresh.load_state_dict(s.state_dict())
    assert fresh.exchange == s.exchange
    for cid, m in s.models.items():
        assert fresh.models[cid].spec == m.spec
        assert all(torch.equal(fresh.models[cid].weights[k], v) for k, v in m.weights.items())
    assert fresh.configure_fit(2).keys() == s.configure_fit(2).keys()
    assert fresh.exchange == s.exchange  # the same rng draws from here on


def test_fedme_state_before_the_first_round_survives_a_checkpoint():
    s = _strategy([MLR, MLP])
    fresh = _strategy([MLR, MLP])
    fresh.load_state_dict(s.state_dict())
    assert fresh.exchange == {}


def test_fedme_needs_two_clients_and_one_label_space():
    msg = "fedme exchanges models between clients: it needs at least 2 clients per round"
    with raises_exactly(IncompatibleClients, msg):
        _strategy([MLR])
    with raises_exactly(IncompatibleClients, msg):
        _strategy([MLR] * 3, clients_per_round=1)
    assert _strategy([MLR] * 3, clients_per_round=2).clients_per_round == 2
    with pytest.raises(IncompatibleClients, match="same classes"):
        _strategy([MLR, MLR.with_(num_classes=3)])


# -- the unlabeled set ---------------------------------------------------------------------------
def test_fedme_holds_out_its_unlabeled_set_unless_it_reads_one_from_a_file():
    assert FedMeStrategy.unlabeled_holdout(FedMeConfig(unlabeled_size=300)) == 300
    assert FedMeStrategy.unlabeled_holdout(FedMeConfig(unlabeled_path="u.npy")) == 0


def test_fedme_without_an_unlabeled_set_says_how_to_give_one():
    msg = (
        "fedme clusters models on an unlabeled set the coordinator holds: name a .npy or "
        ".safetensors file of inputs in fedme.unlabeled_path"
    )
    with raises_exactly(StrategyError, msg):
        _strategy([MLR, MLR], unlabeled=None)
    with pytest.raises(StrategyError, match=r"shape \(4,\)"):
        _strategy([MLR, MLR], unlabeled=torch.zeros(5, 4))


def test_fedme_reads_the_unlabeled_set_named_in_its_config(tmp_path):
    np.save(tmp_path / "u.npy", U.numpy())
    s = _strategy([MLR, MLR], unlabeled=None, unlabeled_path=str(tmp_path / "u.npy"))
    assert torch.equal(s.unlabeled, U)


def test_load_unlabeled_reads_npy_and_safetensors_and_refuses_the_rest(tmp_path):
    np.save(tmp_path / "a.npy", U.numpy())
    save_file({"inputs": U}, tmp_path / "b.safetensors")
    save_file({"x": U, "y": U.clone()}, tmp_path / "c.safetensors")
    np.save(tmp_path / "d.npy", np.array([{"code": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "e.npy", np.full((3, 2), np.nan, dtype=np.float32))
    assert torch.equal(load_unlabeled(tmp_path / "a.npy"), U)
    assert torch.equal(load_unlabeled(tmp_path / "b.safetensors"), U)
    for name, needle in [
        ("c.safetensors", "name the inputs 'inputs'"),
        ("d.npy", "not a plain .npy"),
        ("e.npy", "NaN"),
        ("missing.npy", "does not exist"),
    ]:
        with pytest.raises(UnlabeledDataError, match=needle):
            load_unlabeled(tmp_path / name)


def test_a_simulation_refuses_an_unlabeled_set_larger_than_its_dataset():
    # (the set held out of every client's data: tests/coordinator/test_students_unlabeled.py)
    with pytest.raises(ValueError, match=r"lower fedme\.unlabeled_size"):
        prepare_federation(tiny_config(algorithm="fedme", overrides={"fedme.unlabeled_size": 800}))


# -- the unlabeled inputs the finalize tasks carry -----------------------------------------------
def test_the_finalize_tasks_carry_one_seeded_draw_of_the_unlabeled_set_for_the_students():
    # Prepare: 40 unlabeled inputs, 15 of them for the students
    s = _strategy([MLR, MLP, MLR], seed=3, guard_distill_unlabeled=15)

    # Execute
    plan = s.configure_finalize()

    # Assert: every task carries the personalized model and one object of the same 15 inputs
    # (the network sends it once), rows of U in U's order, drawn from the run's seed alone
    sent = {id(models[UNLABELED]) for models in plan.values()}
    assert len(sent) == 1
    wire = plan["c0"][UNLABELED]
    assert wire.spec == ArchSpec(
        family="inputs", num_classes=2, input_shape=(3,), kwargs={"count": 15}
    )
    rows = np.sort(np.random.default_rng(3).choice(40, size=15, replace=False))
    assert torch.equal(wire.weights["inputs"], U[torch.from_numpy(rows)])
    assert {n for models in plan.values() for n in models} == {"personal", UNLABELED}
    assert s.configure_finalize()["c1"][UNLABELED].weights["inputs"].equal(wire.weights["inputs"])


def test_the_finalize_tasks_carry_all_of_a_smaller_unlabeled_set_and_none_without_students():
    # all of U where it holds fewer than asked, in its order
    whole = _strategy([MLR, MLP], guard_distill_unlabeled=100).configure_finalize()
    assert torch.equal(whole["c1"][UNLABELED].weights["inputs"], U)
    # none by default, nor where the students take none or the guard makes none
    for cfg in (
        {},
        {"guard_distill_unlabeled": 0},
        {"guard_distill_unlabeled": 9, "guard_distill_epochs": 0},
    ):
        plan = _strategy([MLR, MLP], **cfg).configure_finalize()
        assert all(set(models) == {"personal"} for models in plan.values()), cfg
