"""The guard's peers (`guard_peers`): the trained copies of the global model a finalize task
carries, the best of them on the device's validation split mixed into one more candidate and
into the default. Each test builds a tiny client and checks the choice against validation
losses and probabilities computed here."""

import logging

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from test_deploy_budget import CLASSES, FEATURES, MLP, MLR, _data

from edge_sdk.algorithms import ClientContext
from edge_sdk.algorithms.candidates import PEERS
from edge_sdk.algorithms.deployment import PEER_PREFIX, peer_name
from edge_sdk.algorithms.fml import FML, FMLConfig
from edge_sdk.budget import DeployBudget, footprint
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build


def _client(data=None, **cfg) -> FML:
    cpu = torch.device("cpu")
    data = data or _data()
    ctx = ClientContext("c0", MLP, data, cpu, 0, Trainer(cpu, seed=0), budget=DeployBudget())
    base = {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "guard_ft_epochs": 2}
    base |= {"guard_distill_epochs": 3, "guard_distill_views": 1}  # tiny students
    return FML(ctx, FMLConfig(**(base | cfg)))


def _copy(steps: int, seed: int, spec: ArchSpec = MLR) -> WireModel:
    """An MLR trained `steps` full-batch steps on the client's training split (0: as built):
    the more steps, the lower its validation loss."""
    model = build(spec, seed=seed)
    d = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(d.x_train), d.y_train).backward()
        opt.step()
    return WireModel.of(spec, model)


def _val_loss(wire: WireModel) -> float:
    d = _data()
    with torch.no_grad():
        return float(F.cross_entropy(wire.build().eval()(d.x_val), d.y_val))


def _copies() -> dict[str, WireModel]:
    return {peer_name(f"p{i}"): _copy(steps, seed=i) for i, steps in enumerate([0, 30, 3, 10])}


def test_the_peers_candidate_mixes_the_copies_with_the_lowest_validation_loss():
    # Prepare: four copies, their validation losses computed here
    client = _client(guard_peers=2)
    copies = _copies()
    ranked = sorted(copies, key=lambda name: _val_loss(copies[name]))
    best = ranked[:2]

    # Execute
    cand = client.deployment.peers({"global": _copy(5, seed=9), **copies})

    # Assert: the two lowest, each half of the mixture: its probabilities are their mean
    assert cand is not None
    spec, model = cand
    assert spec.family == "mixture" and spec.kwargs["weights"] == [0.5, 0.5]
    x = _data().x_test
    with torch.no_grad():
        want = sum(F.softmax(copies[n].build().eval()(x), 1) for n in sorted(best)) / 2
        got = model.eval()(x)
    assert torch.allclose(F.softmax(got, 1), want, atol=1e-5)
    assert client.deployment._peers == [n.removeprefix(PEER_PREFIX) for n in best]


def test_one_copy_chosen_is_the_candidate_itself():
    client = _client(guard_peers=1)
    copies = _copies()
    best = min(copies, key=lambda name: _val_loss(copies[name]))
    spec, model = client.deployment.peers(copies)
    assert spec == MLR
    assert all(torch.equal(model.state_dict()[k], v) for k, v in copies[best].weights.items())


def test_a_copy_the_device_cannot_use_is_left_out_and_said(caplog):
    # Prepare: a copy of another input size, one of other classes, one that answers NaN, then
    # the good ones
    client = _client(guard_peers=2)
    wide = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES + 1,))
    fewer = ArchSpec(family="mlr", num_classes=2, input_shape=(FEATURES,))
    nan = _copy(0, 5)
    nan.weights["linear.weight"][0, 0] = float("nan")
    copies = {
        peer_name("a-wide"): _copy(0, 1, wide),
        peer_name("b-fewer"): _copy(0, 2, fewer),
        peer_name("b-nan"): nan,
        peer_name("c"): _copy(30, 3),
        peer_name("d"): _copy(10, 4),
    }

    # Execute
    with caplog.at_level(logging.WARNING, logger="edge_sdk.algorithms.deployment"):
        cand = client.deployment.peers(copies)

    # Assert: the two it can use, each bad one said by name
    assert cand is not None and client.deployment._peers == ["c", "d"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3
    assert said[0].startswith("c0: the finalize task's 'peer@a-wide' is left out (")
    assert said[1].startswith("c0: the finalize task's 'peer@b-fewer' is left out (")
    assert all("(None)" not in line and not line.endswith("()") for line in said)  # why, too
    assert (
        said[2] == "c0: the finalize task's 'peer@b-nan' is left out (its validation loss is nan)"
    )


def test_on_equal_losses_the_first_copy_by_name_is_chosen():
    same = _copy(30, seed=3)
    copies = {peer_name("b"): same, peer_name("a"): same, peer_name("c"): _copy(0, seed=4)}
    client = _client(guard_peers=1)
    assert client.deployment.peers(copies) is not None
    assert client.deployment._peers == ["a"]


def test_without_guard_peers_or_validation_the_copies_are_not_looked_at(caplog):
    # (a copy that answers NaN would be said, were the copies scored)
    nan = _copy(0, 5)
    nan.weights["linear.weight"][0, 0] = float("nan")
    copies = _copies() | {peer_name("nan"): nan}
    d = _data()
    none = torch.empty(0, dtype=torch.int64)
    blind = ClientData(
        d.x_train, d.y_train, d.x_train[:0], none, d.x_test, d.y_test, num_classes=CLASSES
    )
    with caplog.at_level(logging.WARNING, logger="edge_sdk.algorithms.deployment"):
        assert _client().deployment.peers(copies) is None  # guard_peers = 0, the default
        assert _client(blind, guard_peers=2).deployment.peers(copies) is None
    assert not caplog.records


def test_the_default_takes_the_best_copies_in_for_half_and_the_device_keeps_its_architecture():
    # Prepare: an FML client of an MLP trained two rounds against an MLR global model
    client = _client(guard_peers=2)
    glob = {"global": _copy(5, seed=9)}
    for r in (1, 2):
        client.fit(r, 2, glob)
    copies = _copies()
    best = sorted(copies, key=lambda name: _val_loss(copies[name]))[:2]
    models = glob | copies

    # Execute: what the guard chooses among, then the finalize itself
    final, w = client.deployment.final_candidates(2, models)
    out = client.finalize(2, 2, models)

    # Assert: the default first, the weighed mixture and the two copies, each a quarter
    name, (spec, _model) = next(iter(final.items()))
    assert name.endswith(f"+{PEERS}") and PEERS in final
    weights = spec.kwargs["weights"]
    assert weights[-2:] == [0.25, 0.25] and abs(sum(weights[:-2]) - 0.5) < 1e-9
    assert w is not None
    # ... and the device deploys its own architecture, saying whose copies it mixed
    deployed_spec, deployed = client.personalized_model()
    assert deployed_spec == MLP and out.details["deployed_arch"] == "mlp"
    assert footprint(deployed).params == out.details["own_params"]
    assert out.details["guard_peers"] == ", ".join(n.removeprefix(PEER_PREFIX) for n in best)


@pytest.mark.parametrize("off", [{"guard": False}, {"preset": "paper"}])
def test_guard_peers_with_the_guard_off_is_refused(off):
    with pytest.raises(ValidationError, match="guard_peers gives the guard one more candidate"):
        FMLConfig(guard_peers=2, **off)
    assert FMLConfig(**off).guard_peers == 0  # (the default is no peers)
