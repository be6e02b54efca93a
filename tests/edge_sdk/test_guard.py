"""The guard: a client deploys the best model it has seen on its own validation split.

Each test builds a tiny client, trains it, spoils its personalized model on purpose where that
is the point, and checks the guard's choice against scores computed here from the weights alone.
"""

import pytest
import torch
import torch.nn.functional as F
from tests_helpers import raises_exactly

from edge_sdk.algorithms import AlgorithmError, ClientContext, algorithm_class
from edge_sdk.algorithms.fml import FML, FMLConfig
from edge_sdk.algorithms.guard import Pick
from edge_sdk.codec import WireModel
from edge_sdk.state import load_state, save_state
from edge_sdk.trainer import ClientData, Trainer
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


def _client(data=None, cls=FML, **cfg):
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", MLP, data or _data(), cpu, 0, Trainer(cpu, seed=0))
    base = {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "alpha_gate": "off"}
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
    assert out.details["guard_choice"] == f"{kind} (round {when}, {spec.family})"
    assert out.details["guard_arch"] == spec.family
    assert out.details["guard_val_acc"] == correct / len(data.y_val)
    assert out.details["guard_unguarded_acc"] == 0.25  # the spoiled model: one class in four
    assert out.details["guard_reason"].startswith(
        f"{out.details['guard_choice']} on validation, {correct}/32 (loss "
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
    assert out.details["guard_choice"] == "personal (final, mlp)"
    assert out.details["guard_reason"].startswith(f"the final personal model, {final[0]}/32")
    assert ", kept: no clear evidence against it; " in out.details["guard_reason"]
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
    client.guard.best = rival

    # Execute
    d = client.guard.decide(3, {"personal": (MLP, personal)})

    # Assert
    assert (client.guard.deployed is rival) == switch
    assert d["guard_choice"] == ("meme (round 2, mlr)" if switch else "personal (final, mlp)")
    if switch:
        assert f"right on {b} samples the final personal model" in d["guard_reason"]
    else:
        assert f"right on {b} it missed, wrong on {c}" in d["guard_reason"]


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
    client.guard.observe(1, {"plain": (MLP, plain), "surer": (MLP, surer)})
    best = client.guard.best
    assert best is not None and best.name == min(loss, key=loss.get)
    assert best.loss == pytest.approx(min(loss.values()), rel=1e-6)
    assert best.correct == int((d.y_val == 1).sum())


def test_guard_without_validation_data_deploys_the_final_model_and_says_why():
    d = _data()
    no_val = ClientData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, 4)
    client = _client(data=no_val, cls=_Spoiled)
    client.spoil = 2
    for round_ in (1, 2):
        client.fit(round_, 2, _glob(round_))
    out = client.finalize(2, 2, _glob(9))
    assert client.guard.best is None
    assert client.personalized_model()[1] is client.personal
    assert out.details["guard_choice"] == "personal (final)"
    assert out.details["guard_reason"] == (
        "no validation data: the algorithm's final model is deployed"
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
    assert "round 1" in a.details["guard_choice"]
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
