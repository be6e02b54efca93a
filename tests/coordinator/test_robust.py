"""No client with a valid key can wreck the federation: aggregation bounds each one (clipped
updates, capped sample weights, values in range, robust aggregators), a round that makes most
clients much worse is rolled back, and honest runs keep their results."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tests_helpers import small_federation

from coordinator.robust import Contribution, RobustConfig, combine, suspects
from coordinator.strategies import (
    ClientInfo,
    FitReply,
    ServerData,
    StrategyError,
    strategy_class,
)
from coordinator.strategies import weighted_mean as plain_mean
from edge_sdk.algorithms import algorithm_class
from edge_sdk.codec import WeightsError, WireModel, check_weights
from edge_sdk.protocol import Capabilities
from edge_sdk.state import load_state
from model_zoo import ArchSpec, build

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attacks.py"
_spec = importlib.util.spec_from_file_location("attacks_bench", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["attacks_bench"] = bench
_spec.loader.exec_module(bench)

MLR = ArchSpec(family="mlr", num_classes=2, input_shape=(4,))
MLP = ArchSpec(family="mlp", num_classes=2, input_shape=(4,))


def _clients(*specs, n=(10, 30, 60)):
    return {
        f"c{i}": ClientInfo(f"c{i}", s, Capabilities(n_train=n[i], num_classes=2))
        for i, s in enumerate(specs)
    }


def _strategy(name, clients, global_spec=MLR, robust=None, **cfg):
    config = algorithm_class(name).config_cls(**cfg)
    unlabeled = ServerData(unlabeled=torch.randn(8, 4))  # (FedMe's)
    s = strategy_class(name)(
        config,
        clients=clients,
        global_spec=global_spec,
        rounds=3,
        seed=0,
        robust=robust,
        server_data=unlabeled,
    )
    s.setup()
    return s


def _moved(state, *steps):
    """`state` plus steps[i] on its i-th float tensor (flattened order), as a new state."""
    out = {}
    for i, (k, t) in enumerate(state.items()):
        out[k] = t + steps[i % len(steps)] if t.is_floating_point() else t.clone()
    return out


def _direction(spec, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=g) for k, t in build(spec).state_dict().items()}


def _plus(start, direction, scale):
    return {k: start[k] + scale * direction[k] for k in start}


# -- honest rounds: exactly what they were -------------------------------------------------------
def test_an_honest_round_aggregates_exactly_as_the_plain_weighted_mean():
    clients = _clients(MLR, MLR, MLR, n=(20, 30, 40))
    s = _strategy("fedavg", clients)  # by_samples (cap 1.5 × 30 = 45: none capped)
    start = dict(s.global_weights)
    states = [_plus(start, _direction(MLR, i), 0.1 * (i + 1)) for i in range(3)]  # norms ≤ 3×
    replies = {
        cid: FitReply(cid, {"model": WireModel(MLR, st)}, n_samples=c.capabilities.n_train)
        for (cid, c), st in zip(clients.items(), states, strict=True)
    }
    s.aggregate_fit(1, replies)
    expected = plain_mean(states, [20.0, 30.0, 40.0])
    assert all(torch.equal(s.global_weights[k], expected[k]) for k in expected)  # bit for bit
    assert s.flags == {}


@pytest.mark.parametrize("name", ["fml", "pfml"])
def test_memes_and_local_models_of_an_honest_round_are_the_plain_mean(name):
    clients = _clients(MLR, MLP, MLR)
    s = _strategy(name, clients, **({"beta": 1.0} if name == "pfml" else {}))
    s.configure_fit(1)
    start = dict(s.global_weights)
    states = [_plus(start, _direction(MLR, i), 0.05 * (i + 1)) for i in range(3)]
    key = "meme" if name == "fml" else "local"
    replies = {
        cid: FitReply(cid, {key: WireModel(MLR, st)}, n_samples=5)
        for cid, st in zip(clients, states, strict=True)
    }
    s.aggregate_fit(1, replies)
    expected = plain_mean(states, [1.0] * 3)
    assert all(torch.equal(s.global_weights[k], expected[k]) for k in expected)
    assert s.flags == {}


# -- what one client can do, bounded -------------------------------------------------------------
def test_an_update_far_above_the_cohorts_median_is_clipped_to_three_times_it_and_flagged():
    clients = _clients(MLR, MLR, MLR, n=(20, 20, 20))
    s = _strategy("fedavg", clients, robust=RobustConfig(center_clip=0))  # the norm bound alone
    start = dict(s.global_weights)
    d = [_direction(MLR, i) for i in range(3)]
    norms = [float(torch.cat([v.reshape(-1) for v in x.values()]).norm()) for x in d]
    unit = [{k: v / n for k, v in x.items()} for x, n in zip(d, norms, strict=True)]
    # c0's update has norm 1000, c1's 1, c2's 2: the median is 2, the bound 6
    states = [_plus(start, u, size) for u, size in zip(unit, (1000.0, 1.0, 2.0), strict=True)]
    replies = {
        cid: FitReply(cid, {"model": WireModel(MLR, st)}, n_samples=20)
        for cid, st in zip(clients, states, strict=True)
    }
    s.aggregate_fit(1, replies)
    # c0 now at 6 (scaled by 6/1000) counts (6/1000)² in the mean
    t = (6.0 / 1000.0) ** 2
    expected = {
        k: start[k] + (t * 6.0 * unit[0][k] + unit[1][k] + 2.0 * unit[2][k]) / (t + 2)
        for k in start
    }
    assert all(torch.allclose(s.global_weights[k], expected[k], atol=1e-6) for k in start)
    assert list(s.flags) == ["c0"] and "clipped by 0.006" in s.flags["c0"]


def test_a_state_far_from_the_others_is_pulled_in_to_twice_the_median_distance():
    start = {"w": torch.zeros(1)}
    values = (0.0, 1.0, 2.0, 3.0, 100.0)
    group = [_contribution(f"c{i}", start, v) for i, v in enumerate(values)]
    flags: dict[str, str] = {}
    (out,) = combine({"global": group}, RobustConfig(clip=0), flags).values()
    # center 2; distances 2, 1, 0, 1, 98: median 1, bound 2; 100 goes to 4 and counts
    # (2 / 98)² in the mean
    t = (2.0 / 98.0) ** 2
    assert out["w"].item() == pytest.approx((0.0 + 1.0 + 2.0 + 3.0 + 4.0 * t) / (4 + t))
    assert list(flags) == ["c4"] and "98 from the median pulled in" in flags["c4"]
    flags.clear()
    four = combine({"global": group[1:]}, RobustConfig(clip=0), flags)["global"]
    assert four["w"].item() == 26.5 and not flags  # too few for a center: the norm bound's


def test_sample_weights_are_capped_at_one_and_a_half_times_the_median_and_at_a_maximum():
    clients = _clients(MLR, MLR, MLR, n=(10**9, 30, 60))
    s = _strategy("fedavg", clients)
    start = dict(s.global_weights)
    replies = {
        cid: FitReply(cid, {"model": WireModel(MLR, _moved(start, 0.01))}, n_samples=n)
        for cid, n in zip(clients, (10**9, 30, 60), strict=True)
    }
    assert s._weights(replies) == [90.0, 30.0, 60.0]  # 1.5 × median 60
    assert "capped at 90" in s.flags["c0"]
    capped = _strategy("fedavg", clients, robust=RobustConfig(weight_cap=0, max_samples=40))
    assert capped._weights(replies) == [40.0, 30.0, 40.0]
    off = _strategy("fedavg", clients, robust=RobustConfig(weight_cap=0))
    assert off._weights(replies) == [1e9, 30.0, 60.0]


def test_values_out_of_range_or_not_finite_reject_the_reply_with_the_tensor_named():
    weights = {k: torch.zeros_like(v) for k, v in build(MLR).state_dict().items()}
    weights["linear.bias"][1] = 1e6  # at the bound: accepted
    check_weights(weights, what="model", max_abs=1e6)
    weights["linear.bias"][1] = 3.0e38
    check_weights(weights, what="model")  # no bound: finite is enough (a peer's model)
    with pytest.raises(WeightsError, match=r"^model: tensor 'linear.bias' holds 3e\+38, out of"):
        check_weights(weights, what="model", max_abs=1e6)
    for bad in (float("nan"), float("-inf")):
        weights["linear.bias"][1] = bad
        with pytest.raises(WeightsError, match=r"'linear\.bias' contains NaN or inf"):
            check_weights(weights, what="model")


@pytest.mark.parametrize(
    ("robust", "value"),
    [
        # c2 sent a far outlier (+100 on every weight); c0 +1, c1 +2
        ({"aggregator": "median", "clip": 0}, 2.0),
        ({"aggregator": "trimmed_mean", "trim": 0.34, "clip": 0}, 2.0),
        ({"aggregator": "krum", "krum_f": 0, "clip": 0}, 1.0),  # n - f - 2 = 1 neighbour
    ],
)
def test_robust_aggregators_leave_the_outlier_out(robust, value):
    clients = _clients(MLR, MLR, MLR, n=(20, 20, 20))
    s = _strategy("fedavg", clients, robust=RobustConfig(**robust))
    start = dict(s.global_weights)
    replies = {
        cid: FitReply(cid, {"model": WireModel(MLR, _moved(start, step))}, n_samples=20)
        for cid, step in zip(clients, (1.0, 2.0, 100.0), strict=True)
    }
    s.aggregate_fit(1, replies)
    assert all(torch.allclose(s.global_weights[k], start[k] + value) for k in start)
    if robust["aggregator"] == "krum":
        assert sorted(s.flags) == ["c1", "c2"]  # not chosen


def test_krum_with_too_few_replies_and_fedme_with_krum_are_refused_with_what_to_do():
    clients = _clients(MLR, MLR, MLR, n=(20, 20, 20))
    s = _strategy("fedavg", clients, robust=RobustConfig(aggregator="krum", krum_f=1))
    start = dict(s.global_weights)
    replies = {c: FitReply(c, {"model": WireModel(MLR, start)}, n_samples=20) for c in clients}
    with pytest.raises(StrategyError, match=r"at least 5 updates \(2f \+ 3\); this round has 3"):
        s.aggregate_fit(1, replies)
    with pytest.raises(StrategyError, match=r"use robust\.aggregator = median or trimmed_mean"):
        krum = RobustConfig(aggregator="krum")
        _strategy("fedme", _clients(MLR, MLR), global_spec=None, robust=krum)


def test_fedme_bounds_each_trained_copy_against_the_rounds_median():
    s = _strategy("fedme", _clients(MLR, MLR, MLR, n=(20, 20, 20)), global_spec=None)
    s.exchange = {"c0": "c1", "c1": "c2", "c2": "c0"}
    starts = {m: dict(w.weights) for m, w in s.models.items()}
    # every copy moves 0.01 per weight, but c0's copy of c1's model moves 10
    replies = {
        cid: FitReply(
            cid,
            {
                "personal": WireModel(MLR, _moved(starts[cid], 0.01)),
                "exchanged": WireModel(
                    MLR, _moved(starts[s.exchange[cid]], 10.0 if cid == "c0" else 0.01)
                ),
            },
            metrics={"adopted": 0.0},
        )
        for cid in ("c0", "c1", "c2")
    }
    s.aggregate_fit(1, replies)
    assert list(s.flags) == ["c0"]
    moved = s.models["c1"].weights["linear.weight"] - starts["c1"]["linear.weight"]
    assert float(moved.abs().max()) < 0.1  # c1's model moved by c0's 10, clipped: little


def test_suspects_are_the_flagged_and_the_far_from_the_median():
    start = {"w": torch.zeros(4)}
    group = [
        _contribution(cid, start, step)
        for cid, step in (("c0", 1.0), ("c1", 1.1), ("c2", 0.9), ("c3", -30.0))
    ]
    assert suspects({"global": group}, {}) == ["c3"]
    assert suspects({"global": group}, {"c1": "clipped"}) == ["c1", "c3"]
    near = group[:3]
    assert suspects({"global": near}, {}) == ["c1"]  # nobody stands out: the farthest


def _contribution(cid, start, step):
    return Contribution(cid, {"w": start["w"] + step}, start)


# -- over the network: attackers with valid keys -------------------------------------------------
def _attack(kind, from_round=1):
    cls = bench.attacker(kind)

    class Late(cls):  # honest before `from_round`
        def run_task(self, task, blobs):
            if task.round < from_round:
                return super(cls, self).run_task(task, blobs)
            return super().run_task(task, blobs)

    return Late


LEARN = {"local_epochs": 2, "lr": 0.1, "batch_size": 32}  # a few rounds reach ~90%


def _run(fed):
    coordinator, clients = fed
    for c in clients:
        c.start()
    try:
        return coordinator, clients, coordinator.run()
    finally:
        for c in clients:
            c.stop()


def test_an_honest_run_with_the_defences_ends_exactly_as_one_without_them():
    off = {"clip": 0, "center_clip": 0, "weight_cap": 0, "rollback": False, "max_abs": 1e300}
    _, _, defended = _run(small_federation(rounds=3, config=LEARN))
    _, _, plain = _run(small_federation(rounds=3, config=LEARN, robust=off))
    assert [c.personal_acc for c in defended.clients] == [c.personal_acc for c in plain.clients]
    assert all(not r.flagged and not r.rolled_back for r in defended.rounds)


def test_a_reply_of_huge_finite_weights_is_rejected_and_the_run_ends_well():
    fed = small_federation(client_cls=_attack("huge"), rounds=3, config=LEARN)
    coordinator, _, result = _run(fed)
    assert all(r.replied == ["c1", "c2"] and not r.failed for r in result.rounds)
    assert coordinator.fleet.rejected["invalid_reply"] == 3  # each round's fit reply
    assert all(c.error is None and c.personal_acc > 0.5 for c in result.clients)


def test_a_poisoned_round_is_rolled_back_and_the_checkpoint_holds_the_last_good_model(tmp_path):
    # c0 flips its update ×10 from round 2 on; clipping is off, so only the rollback can help.
    path = tmp_path / "coordinator.ckpt"
    robust = {"clip": 0}
    coordinator, clients = small_federation(
        client_cls=_attack("flipped", from_round=2),
        rounds=3,
        config=LEARN,
        checkpoint_path=path,
        robust=robust,
    )
    after: list[dict] = []
    coordinator.on_round = lambda rec: after.append(dict(coordinator.strategy.global_weights))
    _, _, result = _run((coordinator, clients))
    kept, *poisoned = result.rounds
    assert not kept.failed and not kept.rolled_back
    assert all(r.failed and r.rolled_back and r.suspects == ["c0"] for r in poisoned)
    assert all(torch.equal(a[k], after[0][k]) for a in after[1:] for k in a)  # undone
    saved = load_state(path)["strategy"]["global"]
    assert all(torch.equal(saved[k], after[0][k]) for k in saved)
    assert all(c.personal_acc > 0.5 for c in result.clients)
    # A coordinator started again from the checkpoint resumes from round 1's model.
    again, _ = small_federation(rounds=3, config=LEARN, checkpoint_path=path, robust=robust)
    assert again.restore() and again._kept == 1
    assert all(torch.equal(again.strategy.global_weights[k], after[0][k]) for k in saved)
