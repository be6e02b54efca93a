"""FedMe's device half: model tuning on validation CE and the DML round, each against a
computation written out here."""

import pytest
import torch
from tests_helpers import raises_exactly

from edge_sdk.algorithms import AlgorithmError, ClientContext
from edge_sdk.algorithms.fedme import ADOPT_MARGIN, FedMe, FedMeConfig
from edge_sdk.budget import DeployBudget
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

FEATURES, CLASSES = 4, 3
MLR = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))
MLP = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,), kwargs={"hidden": [6]})


def _data(seed=0, n_train=20, n_val=10) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val + 10
    y = torch.arange(n) % CLASSES
    x = torch.randn(CLASSES, FEATURES, generator=g)[y] + 0.8 * torch.randn(n, FEATURES, generator=g)
    a, b = n_train, n_train + n_val
    return ClientData(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], num_classes=CLASSES)


# The paper's devices adopt any architecture; a device's own budget is tested below.
ANY = DeployBudget(allow=("any",))


def _client(data=None, spec=MLR, budget=ANY, **cfg) -> FedMe:
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", spec, data or _data(), cpu, 0, Trainer(cpu), budget=budget)
    return FedMe(ctx, FedMeConfig(**cfg))


def _logits(model: WireModel, x: torch.Tensor) -> torch.Tensor:
    """An MLR's or a one-hidden-layer MLP's logits, from the weights alone."""
    w = model.weights
    if model.spec.family == "mlr":
        return x @ w["linear.weight"].T + w["linear.bias"]
    h = torch.relu(x @ w["layers.0.weight"].T + w["layers.0.bias"])
    return h @ w["layers.2.weight"].T + w["layers.2.bias"]


def _ce(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(z - torch.logsumexp(z, 1, keepdim=True))[torch.arange(len(y)), y].mean()


def _kl(z_student: torch.Tensor, z_teacher: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)), batch mean."""
    log_s = z_student - torch.logsumexp(z_student, 1, keepdim=True)
    log_t = z_teacher - torch.logsumexp(z_teacher, 1, keepdim=True)
    return (log_t.exp() * (log_t - log_s)).sum(1).mean()


# -- model tuning ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("budget", "adopt"),
    [(ANY, "budget"), (DeployBudget(), "any")],
    ids=["budget-of-any", "own-budget-adopting-any"],
)
def test_fedme_adopts_the_exchanged_model_exactly_when_its_validation_ce_is_lower(
    seed, budget, adopt
):
    # Prepare: no local epochs, so the validation CEs are those of the models as sent.
    data = _data()
    client = _client(data, local_epochs=0, budget=budget, adopt=adopt)
    personal = WireModel.of(MLR, build(MLR, seed=100 + seed))
    exchanged = WireModel.of(MLP, build(MLP, seed=200 + seed))
    ce_p = float(_ce(_logits(personal, data.x_val), data.y_val))
    ce_ex = float(_ce(_logits(exchanged, data.x_val), data.y_val))

    # Execute
    out = client.fit(1, 10, {"personal": personal, "exchanged": exchanged})

    # Assert
    adopt = ce_ex < ce_p * (1 - ADOPT_MARGIN)
    assert out.metrics["adopted"] == float(adopt)
    assert out.metrics["val_loss_personal"] == pytest.approx(ce_p, rel=1e-5)
    assert out.metrics["val_loss_exchanged"] == pytest.approx(ce_ex, rel=1e-5)
    assert client.personalized_model()[0] == (MLP if adopt else MLR)
    assert out.details == {"arch": "mlp" if adopt else "mlr"}


@pytest.mark.parametrize("seed", range(6))
def test_a_device_adopting_within_its_budget_never_adopts_another_architecture(seed):
    # The cases above, with the default budget and adopting within it: the better MLP is
    # trained and sent back (its owner's aggregate learns), but this device keeps its MLR.
    data = _data()
    client = _client(data, local_epochs=0, budget=DeployBudget(), adopt="budget")
    personal = WireModel.of(MLR, build(MLR, seed=seed))
    exchanged = WireModel.of(MLP, build(MLP, seed=100 + seed))
    out = client.fit(1, 3, {"personal": personal, "exchanged": exchanged})
    assert out.metrics["adopted"] == 0.0
    assert client.personalized_model()[0] == MLR and out.details == {"arch": "mlr"}
    assert set(out.models) == {"personal", "exchanged"}


def test_a_device_adopting_any_architecture_deploys_a_student_of_its_own():
    # Prepare: an own-architecture budget, adopting any; the exchanged MLP trained on the data,
    # so that the device adopts it over its untrained MLR
    data = _data()
    client = _client(data, budget=DeployBudget(), adopt="any")
    mlp = build(MLP, seed=7)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.5)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(mlp(data.x_train), data.y_train).backward()
        opt.step()
    sent = {"personal": WireModel.of(MLR, build(MLR, seed=1)), "exchanged": WireModel.of(MLP, mlp)}

    # Execute: a round, then the finalize with the aggregate of the model it chose
    out = client.fit(1, 2, sent)
    spec, model = client.personalized_model()
    final = client.finalize(2, 2, {"personal": WireModel.of(spec, model)})

    # Assert: it trained and adopted the MLP, and deploys a student of its own MLR
    assert out.metrics["adopted"] == 1.0 and spec == MLP
    assert (final.details["arch_start"], final.details["arch_end"]) == ("mlr", "mlp")
    assert final.details["deployed"] == "distilled (final, mlr)"
    assert final.details["deployed_arch"] == "mlr"
    assert final.details["deployed_params"] == final.details["own_params"]
    assert (
        "a student of its own architecture learnt from it"
        in (final.details["deployed_outside_budget"])
    )


def test_fedme_adoption_outcomes_both_occur_in_the_parametrized_cases():
    # Guards the test above: its seeds must exercise adopting and keeping.
    data = _data()
    outcomes = set()
    for seed in range(6):
        p = WireModel.of(MLR, build(MLR, seed=100 + seed))
        e = WireModel.of(MLP, build(MLP, seed=200 + seed))
        outcomes.add(
            float(_ce(_logits(e, data.x_val), data.y_val))
            < float(_ce(_logits(p, data.x_val), data.y_val))
        )
    assert outcomes == {True, False}


@pytest.mark.parametrize(("lower_by", "adopted"), [(3e-6, 0.0), (3e-5, 1.0)])
def test_fedme_adopts_only_a_validation_loss_lower_beyond_float_rounding(lower_by, adopted):
    # Prepare: the exchanged model is the personalized one with its logits scaled, so that its
    # validation CE is lower by about `lower_by` of it (a copy of one model trained stacked
    # scores so, or one by one: float rounding)
    data = _data()
    personal = WireModel.of(MLR, build(MLR, seed=4))
    ce_p = float(_ce(_logits(personal, data.x_val), data.y_val))

    def scaled(s: float) -> WireModel:
        return WireModel(MLR, {k: v * s for k, v in personal.weights.items()})

    def lower(s: float) -> float:
        return 1 - float(_ce(_logits(scaled(s), data.x_val), data.y_val)) / ce_p

    up = lower(1.01) > 0  # the direction of the scale that lowers the CE
    s = min(
        (1 + d if up else 1 - d for d in torch.linspace(1e-7, 1e-3, 4000).tolist()),
        key=lambda s: abs(lower(s) - lower_by),
    )
    assert lower(s) == pytest.approx(lower_by, rel=0.2)

    # Execute
    out = _client(data, local_epochs=0).fit(1, 3, {"personal": personal, "exchanged": scaled(s)})

    # Assert: kept as a tie within ADOPT_MARGIN, adopted beyond it
    assert out.metrics["adopted"] == adopted


def test_fedme_keeps_its_model_when_both_score_a_validation_loss_of_zero():
    # Prepare: validation images each a clear one-hot of its class, and two MLRs (different
    # weights) that put their class 1000 logits ahead: each one's cross-entropy is exactly 0
    y = torch.arange(9) % CLASSES
    x = torch.zeros(9, FEATURES)
    x[torch.arange(9), y] = 10.0
    data = ClientData(x, y, x, y, x, y, num_classes=CLASSES)

    def certain(scale: float) -> WireModel:
        w = torch.zeros(CLASSES, FEATURES)
        w[torch.arange(CLASSES), torch.arange(CLASSES)] = scale
        return WireModel(MLR, {"linear.weight": w, "linear.bias": torch.zeros(CLASSES)})

    personal, exchanged = certain(100.0), certain(150.0)
    assert float(_ce(_logits(exchanged, x), y)) == float(_ce(_logits(personal, x), y)) == 0.0

    # Execute
    client = _client(data, local_epochs=0)
    out = client.fit(1, 3, {"personal": personal, "exchanged": exchanged})

    # Assert: a tie, so it keeps its own
    assert out.metrics["adopted"] == 0.0
    kept = client.personalized_model()[1].linear.weight.detach()
    assert torch.equal(kept, personal.weights["linear.weight"])


def test_fedme_keeps_its_model_when_the_exchanged_one_is_only_as_good():
    same = WireModel.of(MLR, build(MLR, seed=1))
    client = _client(local_epochs=0)
    out = client.fit(1, 3, {"personal": same, "exchanged": same})
    assert out.metrics["adopted"] == 0.0


def test_fedme_evaluates_the_model_the_coordinator_returned_whatever_its_architecture():
    client = _client(local_epochs=0, guard=False)
    returned = WireModel.of(MLP, build(MLP, seed=3))
    client.evaluate({"personal": returned})
    spec, model = client.personalized_model()
    assert spec == MLP
    assert torch.equal(model.layers[0].weight.detach(), returned.weights["layers.0.weight"])
    out = client.finalize(3, 3, {"personal": returned})
    mlp_params = sum(p.numel() for p in build(MLP).parameters())
    assert out.details == {
        "arch_start": "mlr",
        "arch_end": "mlp",
        "deployed": "personal (final, mlp)",
        "deployed_reason": "Its personalized model (mlp): the algorithm's final model (the guard "
        "is off).",
        "deployed_arch": "mlp",
        "deployed_params": mlp_params,
        "deployed_kib": round(mlp_params * 4 / 1024, 1),
        "own_params": sum(p.numel() for p in build(MLR).parameters()),
        "samples_processed": 0,
    }
    assert out.n_samples == 20


def test_fedme_takes_a_returned_model_of_a_new_architecture_after_its_first():
    client = _client(local_epochs=0, guard=False)
    client.evaluate({"personal": WireModel.of(MLR, build(MLR, seed=1))})
    returned = WireModel.of(MLP, build(MLP, seed=3))
    client.evaluate({"personal": returned})
    spec, model = client.personalized_model()
    assert spec == MLP
    assert torch.equal(model.layers[0].weight.detach(), returned.weights["layers.0.weight"])


def test_fedme_has_no_personalized_model_before_the_coordinator_sends_one():
    msg = "fedme: no personalized model before the coordinator sent one"
    with raises_exactly(RuntimeError, msg):
        _client().personalized_model()


@pytest.mark.parametrize("which", ["personal", "exchanged"])
def test_fedme_refuses_a_model_of_other_classes(which):
    four = ArchSpec(family="mlr", num_classes=4, input_shape=(FEATURES,))
    models = {"personal": WireModel.of(MLR, build(MLR)), "exchanged": WireModel.of(MLR, build(MLR))}
    models[which] = WireModel.of(four, build(four))
    msg = f"fedme: the {which} model predicts 4 classes, this client has 3"
    with raises_exactly(AlgorithmError, msg):
        _client().fit(1, 2, models)


def test_fedme_without_validation_data_is_a_clear_error():
    d = _data()
    client = _client(
        ClientData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, CLASSES)
    )
    m = WireModel.of(MLR, build(MLR))
    msg = (
        "fedme tunes its model on the validation split and this client has none; give it "
        "validation data (e.g. data.split = [0.6, 0.2, 0.2])"
    )
    with raises_exactly(AlgorithmError, msg):
        client.fit(1, 2, {"personal": m, "exchanged": m})


# -- the pinned DML round ------------------------------------------------------------------------
def _clipped(grads, max_norm):
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    return [g * scale for g in grads], float(norm)


@pytest.mark.parametrize("epochs", [1, 3])
def test_fedme_round_is_deep_mutual_learning_with_clipped_momentum_sgd(epochs):
    # Prepare: an MLR client receives an MLP to exchange; full batches; a clip that bites; the
    # last of three rounds with a step schedule (one decay per third of the rounds): lr·0.5².
    data = _data()
    lr, mom, wd, clip = 0.2, 0.9, 1e-4, 0.5
    client = _client(
        data,
        local_epochs=epochs,
        batch_size=1000,
        lr=lr,
        clip_norm=clip,
        weight_decay=wd,
        lr_schedule="step",
        lr_gamma=0.5,
        kl_gate="off",  # the paper's DML: both models learn from each other every round
    )
    personal = WireModel.of(MLR, build(MLR, seed=5))
    exchanged = WireModel.of(MLP, build(MLP, seed=6))

    # Execute
    out = client.fit(3, 3, {"personal": personal, "exchanged": exchanged})

    # Assert: the same round by hand — both losses, per-model clipping, SGD with momentum —
    # and the mean of the two models' summed losses over the steps.
    lr = lr * 0.5**2
    wp = {k: v.clone().requires_grad_(True) for k, v in personal.weights.items()}
    we = {k: v.clone().requires_grad_(True) for k, v in exchanged.weights.items()}
    bufs: dict[str, torch.Tensor] = {}
    norms, losses = [], []
    for _ in range(epochs):
        z_p = _logits(WireModel(MLR, wp), data.x_train)
        z_e = _logits(WireModel(MLP, we), data.x_train)
        loss_p = _ce(z_p, data.y_train) + _kl(z_p, z_e.detach())
        loss_e = _ce(z_e, data.y_train) + _kl(z_e, z_p.detach())
        losses.append(float((loss_p + loss_e).detach()))
        for params, loss, tag in ((wp, loss_p, "p"), (we, loss_e, "e")):
            grads, norm = _clipped(torch.autograd.grad(loss, list(params.values())), clip)
            norms.append(norm)
            with torch.no_grad():
                for (k, w), g in zip(params.items(), grads, strict=True):
                    d = g + wd * w
                    key = tag + k
                    bufs[key] = d if key not in bufs else mom * bufs[key] + d
                    w.sub_(lr * bufs[key])
    assert max(norms) > clip  # the clip was active, so the comparison covers it
    for sent, mine in ((out.models["personal"], wp), (out.models["exchanged"], we)):
        for k, w in mine.items():
            assert torch.allclose(sent.weights[k], w.detach(), atol=1e-5), k
    assert out.models["personal"].spec == MLR and out.models["exchanged"].spec == MLP
    assert out.metrics["train_loss"] == pytest.approx(sum(losses) / epochs, rel=1e-5)
    assert out.n_samples == len(data.y_train)


def test_fedme_recreates_both_optimizers_every_round():
    # Two rounds from the same models give the same result only if no momentum carries over.
    data = _data()
    p, e = WireModel.of(MLR, build(MLR, seed=1)), WireModel.of(MLR, build(MLR, seed=2))
    client = _client(data, local_epochs=1, batch_size=1000)
    first = client.fit(1, 5, {"personal": p, "exchanged": e})
    second = client.fit(2, 5, {"personal": p, "exchanged": e})
    for name in ("personal", "exchanged"):
        for k, v in first.models[name].weights.items():
            assert torch.allclose(second.models[name].weights[k], v, atol=1e-6)


def _sure_of_class_zero(spec):
    """Weights that predict class 0 for everything, surely: a high validation loss."""
    w = {k: torch.zeros_like(v) for k, v in build(spec).state_dict().items()}
    w[list(w)[-1]][0] = 10.0  # the last layer's bias
    return w


@pytest.mark.parametrize("gate", ["validation", "soft"])
@pytest.mark.parametrize("spoiled", ["personal", "exchanged"])
def test_fedme_kl_gate_opens_once_the_exchanged_model_does_better(spoiled, gate):
    # Prepare: one of the two models is sure of one class, so the other has the lower
    # validation loss; one full batch, no clipping, plain SGD.
    data = _data()
    lr = 0.1
    client = _client(data, local_epochs=1, batch_size=1000, lr=lr, momentum=0.0,
                     weight_decay=0.0, clip_norm=1e6, guard=False, kl_gate=gate)  # fmt: skip
    personal = WireModel.of(MLR, build(MLR, seed=5))
    exchanged = WireModel.of(MLP, build(MLP, seed=6))
    if spoiled == "personal":
        personal = WireModel(MLR, _sure_of_class_zero(MLR))
    else:
        exchanged = WireModel(MLP, _sure_of_class_zero(MLP))
    val_p = float(_ce(_logits(personal, data.x_val), data.y_val))
    val_e = float(_ce(_logits(exchanged, data.x_val), data.y_val))
    assert (val_e < val_p) == (spoiled == "personal")  # each case takes one side of the gate
    # the KL term's weight: 1 once the exchanged model does better; below, none ("validation")
    # or in proportion to the two validation losses ("soft")
    learn = float(val_e < val_p) if gate == "validation" else min(1.0, val_p / val_e)

    # Execute
    out = client.fit(1, 3, {"personal": personal, "exchanged": exchanged})

    # Assert: the personal model's KL term only when the exchanged one does better; the
    # exchanged model always learns from the personal one.
    wp = {k: v.clone().requires_grad_(True) for k, v in personal.weights.items()}
    we = {k: v.clone().requires_grad_(True) for k, v in exchanged.weights.items()}
    z_p = _logits(WireModel(MLR, wp), data.x_train)
    z_e = _logits(WireModel(MLP, we), data.x_train)
    loss_p = _ce(z_p, data.y_train) + learn * _kl(z_p, z_e.detach())
    loss_e = _ce(z_e, data.y_train) + _kl(z_e, z_p.detach())
    for params, loss, name in ((wp, loss_p, "personal"), (we, loss_e, "exchanged")):
        grads = torch.autograd.grad(loss, list(params.values()))
        for (k, w), g in zip(params.items(), grads, strict=True):
            want = (w - lr * g).detach()
            assert torch.allclose(out.models[name].weights[k], want, atol=1e-5), (name, k)
    assert out.metrics["distilled"] == pytest.approx(learn, rel=1e-6)
