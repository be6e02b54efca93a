"""The guard: a client deploys the best model it has seen on its own validation split.

Each test builds a tiny client, trains it, spoils its personalized model on purpose where that
is the point, and checks the guard's choice against scores computed here from the weights alone.
"""

import gc
import weakref
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tests_helpers import raises_exactly

from edge_sdk.algorithms import AlgorithmError, ClientContext, TaskInfo, algorithm_class
from edge_sdk.algorithms.candidates import blend
from edge_sdk.algorithms.fml import FML, FMLConfig
from edge_sdk.algorithms.picks import Pick
from edge_sdk.budget import DeployBudget
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.optim_config import OptimConfig
from edge_sdk.state import load_state, save_state
from edge_sdk.trainer import EvalResult, Trainer
from model_zoo import ArchSpec, build

FEATURES, CLASSES = 12, 4
MLP = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,), kwargs={"hidden": [16]})
MLR = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))


def _data(n_val=32, seed=0) -> ClientData:
    """Four classes around four random centres: separable, so trained models score high."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 2

    def draw(n):
        y = torch.arange(n) % CLASSES
        return centres[y] + torch.randn(n, FEATURES, generator=g), y

    (xt, yt), (xv, yv), (xs, ys) = draw(64), draw(n_val), draw(40)
    return ClientData(xt, yt, xv, yv, xs, ys, num_classes=CLASSES)


class _Spoiled(FML):
    """FML whose `models` are spoiled after the training of round `spoil` (every round when
    None), on purpose: every weight is zeroed and the bias names one class, so they predict
    that class for everything."""

    spoil: int | None = 0
    models = ("personal", "meme")

    def train_round(self, round_, rounds, models):
        result = super().train_round(round_, rounds, models)
        if self.spoil is None or round_ == self.spoil:
            for name in self.models:
                _constant(getattr(self, name))
        return result


def _constant(model, label=0):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_()
            if name.endswith("bias") and p.shape == (CLASSES,):
                p[label] = 1.0


# These tests are about how the guard chooses: the device may deploy any model (the budget's
# own tests are in test_budget.py).
ANY = DeployBudget(allow=("any",))


def _client(data=None, cls=FML, budget=ANY, **cfg):
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", MLP, data or _data(), cpu, 0, Trainer(cpu, seed=0), budget=budget)
    # No fine-tuned candidate unless a test asks for one: these tests are about the others.
    base = {
        "local_epochs": 2,
        "batch_size": 16,
        "lr": 0.1,
        "alpha_gate": "off",
        "guard_ft_epochs": 0,
    }
    return cls(ctx, FMLConfig(**(base | cfg)))


def _glob(seed=5):
    return {"global": WireModel.of(MLR, build(MLR, seed=seed))}


def _copy(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hand_scores(spec, weights, x, y):
    """(correct, mean cross-entropy) of `weights` on (x, y), computed here from scratch."""
    model = build(spec)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        z = model(x)
    return int((z.argmax(1) == y).sum()), float(F.cross_entropy(z, y))


def _best(candidates, data):
    """The guard's rule, written out: more correct, then lower loss; the first is the default
    and the others replace the leader only when strictly better."""
    scored = [
        (name, spec, w, *_hand_scores(spec, w, data.x_val, data.y_val))
        for name, spec, w in candidates
    ]
    leader = scored[0]
    for s in scored[1:]:
        if (s[3], -s[4]) > (leader[3], -leader[4]):
            leader = s
    return leader


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_guard_falls_back_to_an_earlier_round_when_the_final_model_is_spoiled():
    # Prepare: three rounds; the last one spoils both models, so neither final one is worth
    # deploying. The test keeps its own copy of every model the guard could have kept.
    client = _client(cls=_Spoiled)
    client.spoil = 3
    data = client.ctx.data
    seen = []
    for round_ in (1, 2, 3):
        client.fit(round_, 3, _glob(round_))
        seen.append((f"personal@{round_}", MLP, _copy(client.personal)))
        seen.append((f"meme@{round_}", MLR, _copy(client.meme)))
    final = [("personal@final", MLP, _copy(client.personal))]

    # Execute
    out = client.finalize(3, 3, _glob(9))

    # Assert: it deploys the best of rounds 1 and 2 (the final models predict class 0 only,
    # the final global model is untrained), and the reply's scores are that model's on the
    # test split.
    glob = ("global@final", MLR, _glob(9)["global"].weights)
    name, spec, weights, correct, _ = _best([*final, glob, *seen], data)
    assert name in ("personal@1", "meme@1", "personal@2", "meme@2")
    deployed_spec, deployed = client.personalized_model()
    assert deployed_spec == spec and _same(_copy(deployed), weights)
    test_correct, _ = _hand_scores(spec, weights, data.x_test, data.y_test)
    assert out.metrics["personal_correct"] == test_correct
    assert out.metrics["personal_total"] == len(data.y_test)
    kind, when = name.split("@")
    assert out.details["deployed"] == f"{kind} (round {when}, {spec.family})"
    assert out.details["deployed_arch"] == spec.family
    assert out.details["guard_val_acc"] == correct / len(data.y_val)
    assert out.details["guard_unguarded_acc"] == 0.25  # the spoiled model: one class in four
    prose = {"personal": "Its personalized model", "meme": "Its meme"}[kind]
    assert out.details["deployed_reason"].startswith(
        f"{prose} ({spec.family}, round {when}) had {correct}/32 right on validation: "
    )


def test_guard_off_deploys_the_spoiled_final_model():
    # The same run with the guard off: what the guard saved the client from.
    client = _client(cls=_Spoiled, guard=False)
    client.spoil = 3
    for round_ in (1, 2, 3):
        client.fit(round_, 3, _glob(round_))
    out = client.finalize(3, 3, _glob(9))
    assert out.metrics["personal_correct"] / out.metrics["personal_total"] == 0.25
    assert client.personalized_model()[1] is client.personal
    assert not any(k.startswith("guard") for k in out.details)


def test_guard_keeps_the_final_personalized_model_when_nothing_beats_it():
    # Prepare: a run whose meme is spoiled every round, so that the final personalized model is
    # the best on validation (its earlier copies are less trained).
    client = _client(cls=_Spoiled, alpha=1.0)  # the personal model learns from labels alone
    client.spoil, client.models = None, ("meme",)
    data = client.ctx.data
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))

    # Execute
    out = client.finalize(2, 2, _glob(9))

    # Assert: the algorithm's own model is what it deploys, its scores unchanged.
    final = _hand_scores(MLP, _copy(client.personal), data.x_val, data.y_val)
    assert final[0] == len(data.y_val)  # separable data: nothing can beat it on accuracy
    spec, model = client.personalized_model()
    assert model is client.personal and spec == MLP
    assert out.details["deployed"] == "personal (final, mlp)"
    assert out.details["deployed_reason"].startswith(
        f"Its personalized model (mlp) had {final[0]}/32 right on validation; no other "
        "candidate within its budget was clearly better (the best, "
    )
    assert out.details["guard_unguarded_acc"] == (
        out.metrics["personal_correct"] / out.metrics["personal_total"]
    )


@pytest.mark.parametrize(
    ("b", "c", "z", "switch"),
    [
        (3, 0, 1.0, True),  # 3 > √3
        (2, 0, 1.0, True),  # 2 > √2
        (1, 0, 1.0, False),  # 1 > √1 fails: one sample is no evidence
        (4, 1, 1.0, True),  # 3 > √5
        (3, 1, 1.0, False),  # 2 > √4 fails
        (1, 0, 0.0, True),  # z = 0: any net gain
        (0, 0, 0.0, False),  # the same predictions: nothing to gain
        (5, 2, 2.0, False),  # 3 > 2·√7 fails
    ],
)
def test_guard_switches_only_on_clear_paired_evidence(b, c, z, switch):
    # Prepare: the final personalized model predicts class 0 for everything, so it gets the
    # class-0 validation samples right. The kept rival gets `b` class-1 samples right that the
    # final model misses and `c` class-0 samples wrong that it gets, nothing else different.
    client = _client(guard_z=z)
    y = client.ctx.data.y_val
    personal = build(MLP, seed=1)
    _constant(personal, label=0)
    hits = y == 0
    hits[torch.nonzero(y == 1).flatten()[:b]] = True
    hits[torch.nonzero(y == 0).flatten()[:c]] = False
    rival = Pick("meme", 2, False, hits, 0.1, WireModel.of(MLR, build(MLR, seed=2)))
    client.deployment.guard.best = rival

    # Execute
    d = client.deployment.guard.decide(3, {"personal": (MLP, personal)})

    # Assert
    assert (client.deployment.guard.deployed is rival) == switch
    assert d["deployed"] == ("meme (round 2, mlr)" if switch else "personal (final, mlp)")
    if switch:
        assert (
            f": {b} that its personalized model (mlp) (8/32) missed, {c} the other"
            in (d["deployed_reason"])
        )
    else:
        assert f"{b} more right, {c} fewer)" in d["deployed_reason"]


def test_guard_keeps_the_best_copy_by_accuracy_then_loss():
    # Two models that predict class 1 for everything get the same samples right; the surer one
    # has another validation loss, and the kept copy is the one with the lower.
    client = _client()
    d = client.ctx.data
    plain, surer = build(MLP, seed=1), build(MLP, seed=2)
    for m in (plain, surer):
        _constant(m, label=1)
    with torch.no_grad():
        surer.layers[-1].bias[1] = 5.0
    loss = {
        n: _hand_scores(MLP, _copy(m), d.x_val, d.y_val)[1]
        for n, m in (("plain", plain), ("surer", surer))
    }
    client.deployment.guard.observe(1, {"plain": (MLP, plain), "surer": (MLP, surer)})
    best = client.deployment.guard.best
    assert best is not None and best.name == min(loss, key=loss.get)
    assert best.loss == pytest.approx(min(loss.values()), rel=1e-6)
    assert best.correct == int((d.y_val == 1).sum())
    assert best.source is None  # the kept copy holds no reference to the live model


def test_guard_without_validation_data_deploys_the_final_model_and_says_why():
    d = _data()
    no_val = ClientData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, 4)
    client = _client(data=no_val, cls=_Spoiled)
    client.spoil = 2
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))
    out = client.finalize(2, 2, _glob(9))
    assert client.deployment.guard.best is None
    assert client.personalized_model()[1] is client.personal
    assert out.details["deployed"] == "personal (final, mlp)"
    assert out.details["deployed_reason"] == (
        "Its personalized model (mlp): the algorithm's final model (it has no validation data "
        "to choose by)."
    )


def test_guard_state_survives_a_restart_and_the_same_choice_follows(tmp_path):
    # Prepare: the best model is kept after round 1; a restarted client reads the saved state.
    original = _client(cls=_Spoiled)
    original.spoil = 2
    original.fit(1, 2, _glob(1))
    save_state(tmp_path / "s", original.state_dict())
    restored = _client(cls=_Spoiled)
    restored.spoil = 2
    restored.load_state_dict(load_state(tmp_path / "s"))

    # Execute: both spoil round 2, then finalize.
    for c in (original, restored):
        c.fit(2, 2, _glob(2))
    a, b = original.finalize(2, 2, _glob(9)), restored.finalize(2, 2, _glob(9))

    # Assert: the kept model came back with the state, so the choice and weights agree.
    assert a.details == b.details and a.metrics == b.metrics
    assert "round 1" in a.details["deployed"]
    assert _same(_copy(original.personalized_model()[1]), _copy(restored.personalized_model()[1]))
    assert restored.ctx.trainer.samples == original.ctx.trainer.samples


def test_a_state_without_the_guard_or_the_sample_count_is_refused():
    client = _client()
    client.fit(1, 2, _glob(1))
    state = client.state_dict()
    for key in ("__guard__", "__samples__"):
        with raises_exactly(AlgorithmError, f"fml: the saved state lacks ['{key}']"):
            client.load_state_dict({k: v for k, v in state.items() if k != key})


@pytest.mark.parametrize("name", ["local", "fedavg", "fedprox", "fedavg_ft"])
def test_baselines_have_no_guard(name):
    assert "guard" not in algorithm_class(name).config_cls.model_fields


# -- the fine-tuned final model and its mixture with the personalized one ------------------------
FT_CFG = {"batch_size": 64, "momentum": 0.9, "weight_decay": 5e-4}  # 64 = every training sample


def _hand_finetuned(glob, data, epochs, lr):
    """The global model after `epochs` full-batch SGD steps (momentum, weight decay) on the
    training split, written out here with torch's own SGD: a full batch makes the batch order,
    which the trainer draws, irrelevant."""
    model = build(MLR)
    model.load_state_dict(glob.weights)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(model(data.x_train), data.y_train).backward()
        opt.step()
    return model


def _trained_mlr():
    """An MLR that knows this client's data: the final global model after 30 full-batch epochs on
    its training split, by hand."""
    return _hand_finetuned(_glob(9)["global"], _data(), epochs=30, lr=0.1)


def _probs(model, x):
    model.eval()
    with torch.no_grad():
        return F.softmax(model(x), 1)


def _val_nll(p, q, w, y):
    """The validation loss of the mixture w·p + (1 − w)·q of two predicted distributions."""
    rows = torch.arange(len(y))
    return float(-torch.log(w * p[rows, y] + (1 - w) * q[rows, y]).mean())


@pytest.mark.parametrize(
    ("ft_epochs", "weight", "family", "choice"),
    [
        (1, 0.25, "mixture", "personal+finetuned (final, mixture)"),
        (4, 0.0, "mlr", "finetuned (final, mlr)"),  # one model, not a mixture weighing it 0
    ],
)
def test_the_default_mixes_the_two_with_the_weight_of_lowest_validation_loss(
    ft_epochs, weight, family, choice
):
    # Prepare: two rounds, then the final global model (trained by no one: the fine-tuning is
    # what teaches it this client's data); 8 validation samples.
    data = _data(n_val=8)
    client = _client(data=data, guard_ft_epochs=ft_epochs, **FT_CFG)
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))
    own = build(MLP)
    own.load_state_dict(_copy(client.personal))

    # Execute
    out = client.finalize(2, 2, _glob(9))

    # Assert: of the weights tried, the one whose mixture of the final personalized model and
    # the global model fine-tuned here by hand has the lowest validation loss, computed here.
    tuned = _hand_finetuned(_glob(9)["global"], data, epochs=ft_epochs, lr=0.1)
    p, q = _probs(own, data.x_val), _probs(tuned, data.x_val)
    losses = {w: _val_nll(p, q, w, data.y_val) for w in (1.0, 0.75, 0.5, 0.25, 0.0)}
    assert min(losses, key=losses.__getitem__) == weight
    assert out.details["guard_mix_weight"] == weight
    assert out.details["deployed"] == choice
    spec, deployed = client.personalized_model()
    assert spec.family == family
    x = torch.cat([data.x_val, data.x_test])
    want = weight * _probs(own, x) + (1 - weight) * _probs(tuned, x)
    assert torch.allclose(_probs(deployed, x), want, atol=1e-5)


@pytest.mark.parametrize(("glob_spec", "weight"), [(MLR, 0.5), (MLP, 1.0)])
def test_the_other_arch_weights_are_tried_where_the_two_models_differ_in_architecture(
    glob_spec, weight
):
    # Prepare: the global model of another architecture (MLR) than the personalized model's,
    # or of the same (MLP); one weight to try for each case, so the weight says which was tried.
    def run(**cfg):
        client = _client(guard_ft_epochs=1, **cfg, **FT_CFG)
        glob = {r: {"global": WireModel.of(glob_spec, build(glob_spec, seed=r))} for r in (1, 2, 9)}
        for round_ in (1, 2):
            client.fit(round_, 2, glob[round_])
        out = client.finalize(2, 2, glob[9])
        return out.details, _copy(client.personalized_model()[1])

    # Execute
    details, deployed = run(guard_mix_weights=[1.0], guard_mix_weights_other_arch=[0.5])

    # Assert: the other-arch weights where the architectures differ; and the client ends as one
    # whose weights are those alone.
    assert details["guard_mix_weight"] == weight
    twin, twin_deployed = run(guard_mix_weights=[weight])
    assert details == twin and _same(deployed, twin_deployed)


def test_on_equal_validation_losses_the_first_weight_wins():
    # Two copies of one model: every mixture has the same validation loss.
    client = _client()
    model = build(MLP, seed=3)
    twin = build(MLP)
    twin.load_state_dict(model.state_dict())
    for weights, name in (([1.0, 0.5, 0.0], "personal"), ([0.0, 0.5, 1.0], "finetuned")):
        guard = client.deployment.guard
        w, chosen, (spec, deployed) = guard.weigh((MLP, model), (MLP, twin), weights)
        assert (w, chosen, spec) == (weights[0], name, MLP)
        assert deployed is (model if name == "personal" else twin)


def test_guard_mix_weights_05_is_the_equal_mixture_of_the_personal_and_fine_tuned_model():
    # Prepare: two rounds, then the final global model (trained by no one: the fine-tuning is
    # what teaches it this client's data); only the equal weight to try.
    client = _client(guard_ft_epochs=4, guard_mix_weights=[0.5], **FT_CFG)
    data = client.ctx.data
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))
    personal = _copy(client.personal)

    # Execute
    out = client.finalize(2, 2, _glob(9))

    # Assert: it deploys one mixture model whose probabilities are the mean of the final
    # personalized model's and of the global model fine-tuned here by hand, on every input.
    spec, deployed = client.personalized_model()
    assert spec.family == "mixture" and spec.kwargs["weights"] == [0.5, 0.5]
    own = build(MLP)
    own.load_state_dict(personal)
    tuned = _hand_finetuned(_glob(9)["global"], data, epochs=4, lr=0.1)
    x = torch.cat([data.x_val, data.x_test])
    want = (_probs(own, x) + _probs(tuned, x)) / 2
    assert torch.allclose(_probs(deployed, x), want, atol=1e-5)
    assert _same(_copy(client.personal), personal)  # fine-tuning a copy left its model alone
    assert out.details["deployed"] == "personal+finetuned (final, mixture)"
    assert out.details["deployed_arch"] == "mixture of mlp+mlr"
    test_hits = int((want[len(data.y_val) :].argmax(1) == data.y_test).sum())
    assert out.metrics["personal_correct"] == test_hits
    assert out.metrics["global_total"] == len(data.y_test)  # finish's other metrics stay
    assert out.details["deployed_reason"].startswith(
        "Its personalized and the fine-tuned model mixed (mixture of mlp+mlr) had "
    )


def test_a_clearly_better_fine_tuned_model_replaces_the_spoiled_personal_one():
    # Prepare: the personalized model and the meme are spoiled every round (predict class 0),
    # and the guard's default is the algorithm's own model.
    client = _client(cls=_Spoiled, guard_ft_epochs=6, guard_default="personal", **FT_CFG)
    client.spoil = None
    data = client.ctx.data
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))

    # Execute
    out = client.finalize(2, 2, _glob(9))

    # Assert: the fine-tuned global model is deployed, its weights the hand-made ones.
    tuned = _hand_finetuned(_glob(9)["global"], data, epochs=6, lr=0.1)
    spec, deployed = client.personalized_model()
    assert spec == MLR
    for k, v in _copy(tuned).items():
        assert torch.allclose(deployed.state_dict()[k], v, atol=1e-5), k
    assert out.details["deployed"] == "finetuned (final, mlr)"
    assert "guard_mix_weight" not in out.details  # the default is its own model: no mixture
    hits = int((_probs(tuned, data.x_test).argmax(1) == data.y_test).sum())
    assert out.metrics["personal_correct"] == hits and hits > len(data.y_test) // 2
    assert out.details["guard_unguarded_acc"] == 0.25  # what the spoiled model would score


@pytest.mark.parametrize(
    ("weights", "why"),
    [
        # Weighed: the mixture's validation loss is lowest with the personalized model alone.
        (None, "Its personalized model (mlp) had 31/32 right on validation; no other "),
        # The equal mixture only: it is the default, and the paired evidence replaces it.
        (
            [0.5],
            "Its personalized model (mlp) had 31/32 right on validation: 23 that its "
            "personalized and the fine-tuned model mixed (mixture of mlp+mlr) (8/32) missed, 0 ",
        ),
    ],
)
def test_the_mixture_is_not_deployed_when_the_personal_model_is_clearly_better(weights, why):
    # Prepare: the final global model predicts class 0 with a bias one fine-tuning step at a
    # tiny rate cannot undo, so the mixture predicts class 0 everywhere; the personalized model
    # learns the separable data from the labels alone (the meme is spoiled every round).
    cfg = {} if weights is None else {"guard_mix_weights": weights}
    client = _client(cls=_Spoiled, alpha=1.0, guard_ft_epochs=1, **cfg, **FT_CFG)
    client.spoil, client.models = None, ("meme",)
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))
    client.config = client.config.model_copy(update={"lr": 1e-6})  # the fine-tuning's rate
    stuck = _glob(9)
    stuck["global"].weights["linear.bias"] = torch.tensor([1e3, 0.0, 0.0, 0.0])

    # Execute
    out = client.finalize(2, 2, stuck)

    # Assert
    assert client.personalized_model()[1] is client.personal
    assert out.details["deployed"] == "personal (final, mlp)"
    assert out.details["deployed_reason"].startswith(why)
    assert out.details["guard_mix_weight"] == (weights or [1.0])[0]


def test_a_deployed_mixture_survives_a_restart(tmp_path):
    data = _data(n_val=8)
    client = _client(data=data, guard_ft_epochs=1, **FT_CFG)
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))
    client.finalize(2, 2, _glob(9))
    save_state(tmp_path / "s", client.state_dict())
    restored = _client(data=data, guard_ft_epochs=1, **FT_CFG)
    restored.load_state_dict(load_state(tmp_path / "s"))
    (spec_a, a), (spec_b, b) = client.personalized_model(), restored.personalized_model()
    assert spec_a == spec_b and spec_a.family == "mixture"
    assert spec_a.kwargs["weights"] not in ([0.5, 0.5], [1.0, 0.0], [0.0, 1.0])  # weighed
    label = "personal+finetuned (final, mixture)"
    picks = restored.deployment.guard.deployed, client.deployment.guard.deployed
    assert picks[0].label == picks[1].label == label
    assert restored.personalized_model()[1] is b  # built once, then the same module
    x = client.ctx.data.x_test
    assert torch.equal(_probs(a, x), _probs(b, x))


def test_blend_weighs_its_two_candidates_and_refuses_a_weight_of_zero_or_one():
    a, b = build(MLR, seed=1), build(MLP, seed=2)
    spec, mixed = blend((MLR, a), (MLP, b), 0.75)
    assert spec.kwargs["weights"] == [0.75, 0.25]
    x = torch.randn(5, FEATURES)
    want = 0.75 * _probs(a, x) + 0.25 * _probs(b, x)
    assert torch.allclose(_probs(mixed, x), want, atol=1e-6)
    for weight in (0.0, 1.0):
        message = f"a blend's weight is strictly between 0 and 1, got {weight}"
        with raises_exactly(ValueError, message):
            blend((MLR, a), (MLP, b), weight)


@pytest.mark.parametrize("field", ["guard_mix_weights", "guard_mix_weights_other_arch"])
@pytest.mark.parametrize("weights", [[], [1.5], [0.5, -0.25]])
def test_guard_mix_weights_outside_zero_to_one_are_refused(field, weights):
    with pytest.raises(ValueError, match=field):
        FMLConfig(**{field: weights})


def test_blend_flattens_a_mixture_into_its_members_with_halved_weights():
    # A mixture (weights 1 and 3) blended with a plain model: three members, weights
    # 0.5·(1/4, 3/4) and 0.5, and the same probabilities as the two averaged.
    a, b, c = build(MLR, seed=1), build(MLP, seed=2), build(MLR, seed=3)
    inner = blend((MLR, a), (MLP, b))
    inner_spec = inner[0].model_copy(update={"kwargs": {**inner[0].kwargs, "weights": [1, 3]}})
    inner_model = build(inner_spec)
    inner_model.load_state_dict(inner[1].state_dict())
    spec, mixed = blend((inner_spec, inner_model), (MLR, c))
    assert spec.kwargs["weights"] == [0.125, 0.375, 0.5]
    assert [m["family"] for m in spec.kwargs["members"]] == ["mlr", "mlp", "mlr"]
    x = torch.randn(5, FEATURES)
    want = 0.5 * (0.25 * _probs(a, x) + 0.75 * _probs(b, x)) + 0.5 * _probs(c, x)
    assert torch.allclose(_probs(mixed, x), want, atol=1e-6)
    # The mixture second: its members come after the plain model's.
    spec, mixed = blend((MLR, c), (inner_spec, inner_model))
    assert spec.kwargs["weights"] == [0.5, 0.125, 0.375]
    assert [m["family"] for m in spec.kwargs["members"]] == ["mlr", "mlr", "mlp"]
    assert torch.allclose(_probs(mixed, x), want, atol=1e-6)


def _hand_tuned(start, data, epochs, opt_of):
    """`start` (spec, weights) after `epochs` full-batch steps of the optimizer `opt_of` makes,
    on the training split, written out here."""
    spec, weights = start
    model = build(spec)
    model.load_state_dict(weights)
    opt = opt_of(model.parameters())
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(model(data.x_train), data.y_train).backward()
        opt.step()
    return _copy(model)


def _algo(name, spec, **cfg):
    cls = algorithm_class(name)
    cpu = torch.device("cpu")
    return cls(
        ClientContext("c0", spec, _data(), cpu, 0, Trainer(cpu, seed=0), budget=ANY),
        cls.config_cls(**cfg),
    )


@pytest.mark.parametrize("name", ["pfml", "fedme", "federico"])
def test_each_algorithm_fine_tunes_its_federations_final_model_with_its_own_optimizer(name):
    # Prepare: the model each fine-tunes and how, by hand. PFML: the global model, with its own
    # plain gradient steps at η. FedMe: the aggregate the coordinator returned as its model,
    # with its SGD (momentum 0.9, weight decay). FedeRiCo: its own model, with Adam.
    glob = _glob(7)["global"]
    if name == "pfml":
        client = _algo(name, MLP, lr=0.2, batch_size=64, guard_ft_epochs=3)
        models = {"global": glob}
        start = (MLR, glob.weights)
        opt = lambda p: torch.optim.SGD(p, lr=0.2)  # noqa: E731
    elif name == "fedme":
        client = _algo(name, MLR, lr=0.2, batch_size=64, guard_ft_epochs=3)
        models = {"personal": glob}
        start = (MLR, glob.weights)
        opt = lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=1e-4)  # noqa: E731
    else:
        client = _algo(name, MLR, lr=0.05, batch_size=64, guard_ft_epochs=3)
        models = {}
        start = (MLR, _copy(client.model))
        opt = lambda p: torch.optim.Adam(p, lr=0.05)  # noqa: E731
    client.finish(1, 1, models)  # what the finalize phase does before the guard
    before = _copy(client.trained_model()[1]) if name != "federico" else _copy(client.model)

    # Execute
    spec, tuned = client.deployment.finetune(1, models)

    # Assert: the hand-made weights; the model it started from is unchanged.
    want = _hand_tuned(start, client.ctx.data, 3, opt)
    assert spec == MLR
    for k, v in want.items():
        assert torch.allclose(tuned.state_dict()[k], v, atol=1e-5), k
    after = _copy(client.trained_model()[1]) if name != "federico" else _copy(client.model)
    assert _same(before, after)


def test_a_diverging_fine_tuning_is_no_candidate_and_the_client_keeps_serving(caplog):
    client = _client(guard_ft_epochs=2, **FT_CFG)
    client.fit(1, 1, _glob(1))
    client.config = client.config.model_copy(update={"lr": 1e38})  # the fine-tuning's rate

    out = client.finalize(1, 1, _glob(9))

    assert "finetuned" not in out.details["deployed_reason"]
    assert client.personalized_model()[0].family != "mixture"
    (warning,) = [r.getMessage() for r in caplog.records if "fine-tuning" in r.getMessage()]
    assert warning.startswith("c0: the guard's fine-tuning diverged (training loss became ")


def test_an_algorithm_without_optimizer_settings_gets_no_fine_tuned_candidate():
    # A plugin's algorithm whose config is a BaseAlgorithmConfig with the guard, and no
    # finetune_optim of its own: the guard works, without a fine-tuned candidate.
    from edge_sdk.algorithms import BaseAlgorithmConfig, ClientAlgorithm, FitResult
    from edge_sdk.algorithms.guard import GuardConfig

    class Config(BaseAlgorithmConfig, GuardConfig):
        pass

    class Plain(ClientAlgorithm):
        name = "plain_guarded"
        config_cls = Config

        def __init__(self, ctx, config):
            super().__init__(ctx, config)
            self.model = self._build(ctx.spec)

        def train_round(self, round_, rounds, models):
            return FitResult()

        def trained_model(self):
            return self.ctx.spec, self.model

    cpu = torch.device("cpu")
    client = Plain(ClientContext("c0", MLP, _data(), cpu, 0, Trainer(cpu, seed=0)), Config())
    assert not client.deployment.finetunes
    out = client.finalize(1, 1, _glob(9))
    assert out.details["samples_processed"] == 0
    assert "finetuned" not in out.details["deployed_reason"]


def test_the_fine_tuning_runs_at_the_last_rounds_learning_rate():
    # Prepare: a step schedule halving the rate every round of three (0.4, 0.2, 0.1); the
    # personalized model and the meme are spoiled, so the fine-tuned global model is deployed.
    cfg = {"lr": 0.4, "lr_schedule": "step", "lr_gamma": 0.5, **FT_CFG}
    client = _client(cls=_Spoiled, guard_ft_epochs=6, guard_default="personal", **cfg)
    client.spoil = None
    for round_ in (1, 2, 3):
        client.fit(round_, 3, _glob(round_))

    # Execute
    out = client.finalize(3, 3, _glob(9))

    # Assert: the weights of six full-batch epochs at the third round's rate, 0.1, by hand.
    tuned = _hand_finetuned(_glob(9)["global"], client.ctx.data, epochs=6, lr=0.1)
    assert out.details["deployed"] == "finetuned (final, mlr)"
    deployed = client.personalized_model()[1].state_dict()
    for k, v in _copy(tuned).items():
        assert torch.allclose(deployed[k], v, atol=1e-5), k


def test_the_final_global_model_is_a_candidate_of_its_own():
    # Prepare: the personalized model and the meme are spoiled, no fine-tuning; the final
    # global model is one trained well here by hand.
    client = _client(cls=_Spoiled, guard_default="personal", **FT_CFG)
    client.spoil = None
    client.fit(1, 1, _glob(1))
    good = _trained_mlr()
    final = {"global": WireModel.of(MLR, good)}

    # Execute
    out = client.finalize(1, 1, final)

    # Assert: it deploys that model, under its name.
    assert out.details["deployed"] == "global (final, mlr)"
    deployed = client.personalized_model()[1]
    assert _same(_copy(deployed), _copy(good))


def test_no_fine_tuned_candidate_from_a_partial_or_foreign_global_model():
    # A global model that carries only a shared backbone (FML's shared_prefixes), or one that
    # predicts other classes than this client's, is no model to fine-tune and deploy.
    whole = _client(guard_ft_epochs=2, **FT_CFG)
    assert whole.deployment.finetune(1, _glob(9)) is not None
    partial = _client(guard_ft_epochs=2, shared_prefixes=["linear."], **FT_CFG)
    assert partial.deployment.finetune(1, _glob(9)) is None
    other = ArchSpec(family="mlr", num_classes=CLASSES + 1, input_shape=(FEATURES,))
    assert whole.deployment.finetune(1, {"global": WireModel.of(other, build(other))}) is None


def test_a_single_candidate_is_deployed_and_the_reason_says_so():
    client = _client()
    d = client.ctx.data
    model = build(MLP, seed=1)
    correct, _ = _hand_scores(MLP, _copy(model), d.x_val, d.y_val)

    details = client.deployment.guard.decide(1, {"personal": (MLP, model)})

    assert details["deployed_reason"] == (
        f"Its personalized model (mlp) had {correct}/{len(d.y_val)} right on validation; it was "
        "the only candidate within its budget."
    )


@pytest.mark.parametrize(
    "loss, other, beats",
    [
        (1.0 - 1.5e-6, 1.0, True),  # below a loss of 1 the tie is 1e-6 wide
        (1.0 - 0.5e-6, 1.0, False),
        (10.0 - 2e-5, 10.0, True),  # above it, 1e-6 of the loss
        (10.0 - 5e-6, 10.0, False),
    ],
)
def test_validation_losses_closer_than_a_millionth_tie(loss, other, beats):
    hits = torch.tensor([True, False, True])
    assert Pick("a", 1, False, hits, loss).beats(Pick("b", 1, False, hits, other)) is beats


@pytest.mark.parametrize("optimizer, momentum", [("adam", 0.9), ("sgd", 0.0)])
def test_federico_fine_tunes_with_its_own_optimizer_settings(optimizer, momentum):
    # Adam's β1 is torch's 0.9 there, plain SGD has no momentum; its batch size and rate.
    client = _algo("federico", MLR, lr=0.05, batch_size=8, optimizer=optimizer)
    assert client.finetune_optim() == OptimConfig(
        optimizer=optimizer, lr=0.05, batch_size=8, momentum=momentum, weight_decay=0.0
    )


def test_pfml_fine_tunes_with_plain_steps_at_its_rate_and_batch_size():
    client = _algo("pfml", MLP, lr=0.2, batch_size=8)
    assert client.finetune_optim() == OptimConfig(
        lr=0.2, batch_size=8, momentum=0.0, weight_decay=0.0
    )


def test_what_each_algorithm_offers_the_guard_after_a_round():
    # PFML: its personalized (auxiliary) model and the local model it trained from the global.
    pfml = _algo("pfml", MLP, batch_size=64)
    pfml.fit(1, 1, _glob(1))
    offered = pfml.guard_candidates()
    assert sorted(offered) == ["local", "personal"] and offered["local"][1] is pfml.local
    # FedeRiCo: its mixture and its own model after an update step; nothing after an exchange
    # step, which changes no model.
    federico = _algo("federico", MLR)
    federico.ctx.task = TaskInfo("update", {})
    offered = federico.guard_candidates()
    assert sorted(offered) == ["own", "personal"] and offered["own"][1] is federico.model
    federico.ctx.task = TaskInfo("exchange", {})
    assert federico.guard_candidates() == {}
    # PersFL: nothing before its first round; in stage 1 its copy of the global model after its
    # local epochs; after stage 2 the student, with the teacher when it has one.
    persfl = _algo("persfl", MLR)
    assert persfl.guard_candidates() == {}
    persfl.model, persfl.model_spec = build(MLR, seed=1), MLR
    assert persfl.guard_candidates() == {"tuned_global": (MLR, persfl.model)}
    persfl.student = build(MLR, seed=2)
    assert sorted(persfl.guard_candidates()) == ["personal"]
    persfl.teacher, persfl.teacher_spec = build(MLR, seed=3), MLR
    offered = persfl.guard_candidates()
    assert sorted(offered) == ["personal", "teacher"] and offered["teacher"][1] is persfl.teacher


def test_a_peer_no_better_than_the_student_does_not_teach():
    # FML's and FedMe's gate: a teacher whose validation loss only equals the student's (the
    # same weights) is no reason to distill; a clearly better one is.
    client = _client()
    student = build(MLP, seed=1)
    same = build(MLP, seed=1)
    assert client._teaches(same, student) == 0.0
    better = _trained_mlr()
    assert client._teaches(better, student) == 1.0


@pytest.mark.parametrize(
    "gate, total, teacher_loss, student_loss, weight",
    [
        # "validation": all or nothing, the teacher strictly better
        ("validation", 1, 0.5, 0.6, 1.0),  # one validation sample is enough to decide
        ("validation", 1, 0.6, 0.6, 0.0),
        ("validation", 3, 0.7, 0.6, 0.0),
        # "soft": min(1, L_s / L_t)
        ("soft", 1, 0.5, 0.25, 0.5),  # a sub-1 teacher loss divides as any other
        ("soft", 4, 2.0, 0.5, 0.25),
        ("soft", 4, 0.4, 0.5, 1.0),  # a better teacher: capped at 1
        ("soft", 4, 0.0, 0.5, 1.0),  # a perfect teacher: no division by zero
        # no validation samples: nothing says otherwise
        ("validation", 0, 0.9, 0.1, 1.0),
        ("soft", 0, 0.9, 0.1, 1.0),
    ],
)
def test_the_gates_weight_of_a_teacher_follows_their_validation_losses(
    monkeypatch, gate, total, teacher_loss, student_loss, weight
):
    # Prepare: the trainer's evaluation of the teacher and of the student, as given
    client = _client()
    teacher, student = build(MLP, seed=1), build(MLP, seed=2)
    losses = {id(teacher): teacher_loss, id(student): student_loss}

    def evaluate(model, x, y):
        return EvalResult(correct=0, total=total, loss_sum=losses[id(model)] * total)

    monkeypatch.setattr(client.ctx.trainer, "evaluate", evaluate)

    # Execute, Assert
    assert client._teaches(teacher, student, gate) == weight


@pytest.mark.parametrize("gate, distilled", [("off", 1.0), ("validation", 0.0)])
def test_fedme_distils_from_a_worse_exchanged_model_only_without_its_gate(gate, distilled):
    # The exchanged model predicts one class for everything, the personalized one is trained:
    # the gate ("validation") keeps the personalized model from learning from it; "off", the
    # paper's 1:1, distils whatever the exchanged model knows.
    good = _trained_mlr()
    bad = build(MLR, seed=3)
    _constant(bad)
    client = _algo("fedme", MLR, batch_size=64, kl_gate=gate)
    models = {"personal": WireModel.of(MLR, good), "exchanged": WireModel.of(MLR, bad)}
    assert client.fit(1, 1, models).metrics["distilled"] == distilled


def test_fedme_reports_its_personalized_models_test_scores_at_the_end():
    good = _trained_mlr()
    client = _algo("fedme", MLR)
    d = client.ctx.data
    out = client.finish(1, 1, {"personal": WireModel.of(MLR, good)})
    correct, _ = _hand_scores(MLR, _copy(good), d.x_test, d.y_test)
    assert sorted(out.metrics) == ["personal_correct", "personal_loss", "personal_total"]
    assert (out.metrics["personal_correct"], out.metrics["personal_total"]) == (
        correct,
        len(d.y_test),
    )


def test_an_algorithm_let_go_is_freed_at_once_with_its_deployment():
    # Prepare: the cyclic garbage collector off, as between its runs
    gc.collect()
    gc.disable()
    try:
        client = _client()
        gone = weakref.ref(client)

        # Execute
        del client

        # Assert: freed by its reference count alone (a stack built for one round holds every
        # member's tensors: it must not wait for a collection)
        assert gone() is None
    finally:
        gc.enable()


def test_a_kept_pick_saved_and_loaded_is_the_same_pick_and_an_older_state_reads_its_defaults():
    # Prepare: a distilled student the guard kept, with its teacher
    torch.manual_seed(0)
    model = WireModel.of(MLR, build(MLR))
    hits = torch.tensor([True, False, True])
    pick = Pick("distilled", 3, True, hits, 0.25, model=model, teacher="finetuned")

    # Execute: through a state file's dict; a state written before `teacher`, and one that
    # saved the pick's parameters (`params`, no longer kept: nothing read it)
    state = pick.to_state()
    loaded = Pick.from_state(state)
    older = {k: v for k, v in state.items() if k != "teacher"} | {"params": 650}
    old = Pick.from_state(older)

    # Assert: every field comes back; the older state reads no teacher
    assert (loaded.name, loaded.round, loaded.final, loaded.loss) == ("distilled", 3, True, 0.25)
    assert torch.equal(loaded.hits, hits) and loaded.correct == 2 and loaded.model is model
    assert loaded.teacher == "finetuned" and old.teacher is None
    assert "params" not in state and old == replace(loaded, teacher=None)
    assert Pick.from_state(replace(pick, teacher=None).to_state()).teacher is None
