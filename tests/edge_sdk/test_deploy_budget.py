"""The deployment budget: what a device may deploy, and how the guard keeps to it.

A device deploys a model of its own architecture unless its budget allows more; a better model
it may not run is distilled into its own architecture. Each test builds a tiny client, makes the
model the budget refuses the clearly better one, and checks what the device deploys against
scores and sizes computed here.
"""

import pytest
import torch
import torch.nn.functional as F
from tests_helpers import raises_exactly

from edge_sdk.algorithms import ClientContext, algorithm_class
from edge_sdk.algorithms.candidates import DISTILLED, PERSONAL
from edge_sdk.algorithms.deployment import UNLABELED, _served, unlabeled_model
from edge_sdk.algorithms.fml import FML, FMLConfig
from edge_sdk.algorithms.guard import _REASON_CHARS, Guard, Pick, _sentence
from edge_sdk.budget import DeployBudget, arch_name, footprint
from edge_sdk.client import Deployed
from edge_sdk.client_data import ClientData, shifted
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build
from model_zoo.models.mixture import mixture_spec

FEATURES, CLASSES = 12, 4
MLP = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,), kwargs={"hidden": [16]})
MLR = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))
BIG = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,), kwargs={"hidden": [64]})
OWN, ANY = DeployBudget(), DeployBudget(allow=("any",))


def _params(spec: ArchSpec) -> int:
    return sum(p.numel() for p in build(spec).parameters())


# -- the budget itself -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("budget", "spec", "refused"),
    [
        (OWN, MLP, None),  # its own architecture, always
        (OWN, BIG, "mlp is not an architecture this device runs"),  # the family, other width
        (OWN, MLR, "mlr is not an architecture this device runs"),
        (DeployBudget(allow="own,mlr"), MLR, None),
        (DeployBudget(allow=("own", "mlr")), BIG, "mlp is not an architecture this device runs"),
        (DeployBudget(allow="mlp"), BIG, None),  # a family allows every width of it
        (ANY, BIG, None),
        (DeployBudget(allow="any", max_params=100), BIG, "exceed this device's 100"),
        (DeployBudget(allow="any", max_params=100), MLP, None),  # its own, whatever the bound
    ],
)
def test_a_budget_admits_its_own_architecture_and_what_it_names(budget, spec, refused):
    why = budget.refusal(spec, MLP, _params(spec))
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


def test_a_refusal_names_every_architecture_the_device_does_not_run():
    # A mixture of three families on an MLP device that allows mixtures, each refused family
    # named once, in order: "a, b and c".
    cnn = ArchSpec(family="cnn1", num_classes=CLASSES, input_shape=(1, 8, 8))
    lenet = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=(1, 8, 8))
    budget = DeployBudget(allow="own,mixture")
    two = mixture_spec([MLR, MLP, lenet], [1, 1, 1])
    three = mixture_spec([MLR, cnn, lenet, MLR], [1, 1, 1, 1])
    assert budget.refusal(MLR, MLP, 1) == "mlr is not an architecture this device runs"
    assert budget.refusal(two, MLP, 1) == "lenet5 and mlr are not architectures this device runs"
    assert budget.refusal(three, MLP, 1) == (
        "cnn1, lenet5 and mlr are not architectures this device runs"
    )


def test_a_mixture_needs_mixture_allowed_and_every_member_admitted():
    mix = mixture_spec([MLP, MLR], [0.5, 0.5])
    params = _params(MLP) + _params(MLR)
    assert "is a mixture of 2 models (mlp, mlr) and this device runs one" in (
        DeployBudget(allow="own,mlr").refusal(mix, MLP, params) or ""
    )
    assert "mlr is not an architecture" in (
        DeployBudget(allow="own,mixture").refusal(mix, MLP, params) or ""
    )
    assert DeployBudget(allow="own,mlr,mixture").refusal(mix, MLP, params) is None
    assert ANY.refusal(mix, MLP, params) is None
    assert arch_name(mix) == "mixture of mlp+mlr"


def test_a_budget_names_no_unknown_architecture():
    with pytest.raises(ValueError, match="cannot allow 'lenet7'"):
        DeployBudget(allow="own,lenet7")


# -- the guard within it -----------------------------------------------------------------------
def _data(seed=0) -> ClientData:
    """Four classes around four random centres: separable, so trained models score high."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 2

    def draw(n):
        y = torch.arange(n) % CLASSES
        return centres[y] + torch.randn(n, FEATURES, generator=g), y

    (xt, yt), (xv, yv), (xs, ys) = draw(64), draw(32), draw(40)
    return ClientData(xt, yt, xv, yv, xs, ys, num_classes=CLASSES)


class _Stuck(FML):
    """FML whose personalized model is reset to one that predicts class 0 everywhere after every
    round: only a model of another architecture (the meme, the global model) knows the data."""

    def train_round(self, round_, rounds, models):
        result = super().train_round(round_, rounds, models)
        with torch.no_grad():  # its output layer (a student starting from it can still learn)
            head = self.personal.layers[-1]
            head.weight.zero_()
            head.bias.zero_()
            head.bias[0] = 1.0
        return result


class _Dead(_Stuck):
    """The stuck client with a personalized model gradient descent cannot move either: every
    hidden unit dead (its ReLU's input below zero everywhere), as a FedeRiCo client's own model,
    trained by its peers to their labels, ended at the long size of the benchmark."""

    def train_round(self, round_, rounds, models):
        result = super().train_round(round_, rounds, models)
        with torch.no_grad():
            hidden = self.personal.layers[0]
            hidden.weight.zero_()
            hidden.bias.fill_(-1.0)
        return result


def _client(budget, kind=_Stuck, data=None, **cfg):
    cpu = torch.device("cpu")
    data = data or _data()
    ctx = ClientContext("c0", MLP, data, cpu, 0, Trainer(cpu, seed=0), budget=budget)
    base = {
        "local_epochs": 3,
        "batch_size": 16,
        "lr": 0.1,
        "alpha_gate": "off",
        "alpha": 1.0,  # the personalized model learns from the labels alone
        "guard_ft_epochs": 4,
        "guard_distill_views": 1,  # GuardConfig's, enough for these tiny students
    }
    return kind(ctx, FMLConfig(**(base | cfg)))


def _trained_global(seed=5):
    """An MLR global model that knows the data: 40 full-batch steps on this client's split."""
    model = build(MLR, seed=seed)
    d = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(40):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(d.x_train), d.y_train).backward()
        opt.step()
    return {"global": WireModel.of(MLR, model)}


def _accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _run(client, rounds=2):
    for r in range(1, rounds + 1):
        client.fit(r, rounds, _trained_global())
    return client.finalize(rounds, rounds, _trained_global())


def test_with_its_own_architecture_only_a_device_never_deploys_another():
    # Prepare: the personalized MLP predicts one class; the MLR meme, global and fine-tuned
    # models know the data. With any budget the guard deploys one of those.
    anything = _run(_client(ANY))
    assert anything.details["deployed_arch"] != "mlp"
    assert "deployed_outside_budget" not in anything.details  # nothing was outside it

    # Execute: the same run with the default budget, and with distillation off.
    client = _client(OWN, guard_distill_epochs=0)
    out = _run(client)

    # Assert: its own architecture, the stuck model, and the reason names what it missed.
    spec, model = client.personalized_model()
    assert spec == MLP and out.details["deployed_arch"] == "mlp"
    assert out.details["deployed"] == "personal (final, mlp)"
    assert out.details["deployed_params"] == out.details["own_params"] == _params(MLP)
    assert "mlr is not an architecture this device runs" in out.details["deployed_outside_budget"]
    d = client.ctx.data
    assert _accuracy(model, d.x_test, d.y_test) == 0.25


def test_a_better_model_outside_the_budget_is_distilled_into_its_own_architecture():
    # Prepare: the same stuck client, the guard's student on (its default epochs), its
    # personalized model the default (within the budget: the student must be clearly better).
    client = _client(OWN, guard_default="personal")

    # Execute
    out = _run(client)

    # Assert: a student of its own architecture and size, which scores what the reply says it
    # does and much better than the stuck model; its epochs counted as processed.
    spec, model = client.personalized_model()
    assert spec == MLP and footprint(model).params == _params(MLP) == out.details["own_params"]
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_arch"] == "mlp"
    assert out.details["deployed_reason"].startswith(
        "A student (mlp) of the final model fine-tuned here (mlr) had 32/32 right on "
        "validation, against 8/32 for its personalized model (mlp)."
    )
    d = client.ctx.data
    acc = _accuracy(model, d.x_test, d.y_test)
    assert acc > 0.9 and out.metrics["personal_correct"] == round(acc * len(d.y_test))
    assert out.details["deployed_outside_budget"] == (
        "The final model fine-tuned here (mlr) had 32/32 but mlr is not an architecture this "
        "device runs; a student of its own architecture learnt from it."
    )
    kept = client.deployment.guard.deployed
    assert kept is not None and Pick.from_state(kept.to_state()).round == 2
    cfg = client.config
    trained = 2 * cfg.local_epochs * 64 + cfg.guard_ft_epochs * 64  # rounds + fine-tuning
    # two students: one from the stuck model, one afresh
    assert out.details["samples_processed"] == trained + 2 * cfg.guard_distill_epochs * 64


def test_a_student_trains_the_epochs_its_samples_bound_allows():
    # Prepare: the same client, its 64 training samples (features: one view an epoch) bounded
    # to 5 epochs and most of a sixth
    client = _client(OWN, guard_default="personal", guard_distill_samples=6 * 64 - 1)
    assert client.config.guard_distill_epochs > 6

    # Execute
    out = _run(client)

    # Assert: both students trained 5 epochs, as many as the bound holds
    cfg = client.config
    trained = 2 * cfg.local_epochs * 64 + cfg.guard_ft_epochs * 64
    assert out.details["samples_processed"] == trained + 2 * 5 * 64
    assert out.details["deployed_arch"] == "mlp"
    # 0: no bound, however many samples
    unbounded = _client(OWN, guard_distill_samples=0)
    assert unbounded.deployment.distil_epochs(10**9) == unbounded.config.guard_distill_epochs


def test_a_default_outside_the_budget_is_the_default_as_a_student():
    # Prepare: the stuck client with the default mixture: weighed on validation, the default is
    # the fine-tuned MLR alone (w = 0), which the budget refuses.
    client = _client(OWN)

    # Execute
    out = _run(client)

    # Assert: the default within the budget is a student of it, deployed since nothing within
    # the budget is clearly better; its reason a sentence within a reply's limit
    assert out.details["guard_mix_weight"] == 0.0
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_reason"] == (
        "A student (mlp) of the final model fine-tuned here (mlr) had 32/32 right on validation; "
        "no other candidate within its budget was clearly better (the best, its personalized "
        "model (mlp), had 8/32: 0 more right, 24 fewer)."
    )
    d = client.ctx.data
    assert _accuracy(client.personalized_model()[1], d.x_test, d.y_test) > 0.9


def test_a_reason_too_long_for_a_reply_drops_its_last_clauses():
    long, tail = "x" * 200, "y" * 100
    assert _sentence(f"{long}; {tail}") == long + "."  # 302 characters: the last clause goes
    assert _sentence(f"{long}; b; {tail}") == f"{long}; b."  # only as many as it takes
    exact = "w" * 100 + "; " + "v" * (_REASON_CHARS - 103)  # with its period, the limit
    assert _sentence(exact) == exact + "." and len(exact + ".") == _REASON_CHARS
    assert _sentence("short; clause") == "short; clause."
    assert _sentence("z" * 300) == "z" * _REASON_CHARS  # one clause: cut


def test_a_guard_given_no_candidate_says_so():
    guard = Guard(Trainer(torch.device("cpu"), seed=0), _data(), z=2.0, budget=OWN, own=MLP)
    with raises_exactly(
        RuntimeError, "the guard found no model within the device's budget to deploy: "
    ):
        guard.decide(2, {}, None)


def test_a_student_starts_afresh_where_its_start_cannot_learn():
    # Prepare: a client whose personalized model's hidden units are dead.
    client = _client(OWN, kind=_Dead)

    # Execute
    out = _run(client)

    # Assert: its own model predicts one class, and a student starting from it learns nothing
    # more (distilled here from the same meme); the student deployed started afresh and knows
    # the data.
    d = client.ctx.data
    assert _accuracy(client.personal, d.x_test, d.y_test) == 0.25
    _, stuck = client.deployment.distil(2, (MLR, client.meme), (MLP, client.personal))
    assert _accuracy(stuck, d.x_test, d.y_test) == 0.25
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    spec, model = client.personalized_model()
    assert spec == MLP and _accuracy(model, d.x_test, d.y_test) > 0.9


def test_the_student_starts_from_its_best_model_of_its_architecture_and_keeps_the_budget():
    # A budget that allows the MLR: the meme is deployed as it is, no student.
    allowed = _run(_client(DeployBudget(allow="own,mlr")))
    assert allowed.details["deployed_arch"] == "mlr"
    assert DISTILLED not in allowed.details["deployed"]
    # A budget bounded in parameters refuses the BIG global model, admits the MLR.
    client = _client(DeployBudget(allow="any", max_params=_params(MLR)))
    assert client.deployment.guard.admits((MLR, build(MLR)))
    assert not client.deployment.guard.admits((BIG, build(BIG)))


def test_guard_off_deploys_the_algorithms_model_and_records_it():
    client = _client(OWN, guard=False)
    out = _run(client)
    assert client.personalized_model()[1] is client.personal
    assert out.details["deployed"] == f"{PERSONAL} (final, mlp)"
    assert out.details["deployed_reason"] == (
        "Its personalized model (mlp): the algorithm's final model (the guard is off)."
    )
    assert not any(k.startswith("guard") for k in out.details)
    rec = Deployed.from_details(out.details)
    assert rec is not None and rec.arch == "mlp" and rec.params == _params(MLP)


def test_a_device_without_any_model_in_its_budget_is_refused_clearly():
    client = _client(OWN, guard_distill_epochs=0)
    mix = (mixture_spec([MLR, MLR], [1, 1]), build(mixture_spec([MLR, MLR], [1, 1])))
    message = (
        "no model within the device's budget: Mix (mixture of mlr+mlr), the algorithm's final "
        "model, it is a mixture of 2 models (mlr, mlr) and this device runs one"
    )
    with raises_exactly(RuntimeError, message):
        client.deployment.guard.deploy_first({"mix": mix}, None, "the guard is off")


def test_the_deployed_size_is_its_weights_in_kib_to_a_tenth():
    # Prepare: the bytes of the MLP's weights, counted here
    out = _run(_client(OWN, guard=False))
    weights = build(MLP).state_dict().values()
    kib = sum(t.numel() * t.element_size() for t in weights) / 1024  # 1,104 bytes

    # Assert
    assert out.details["deployed_kib"] == round(kib, 1) == 1.1


def test_an_algorithm_without_the_guard_deploys_its_final_model_and_says_so():
    # Prepare: FedAvg, which has no guard: its final model is the global model it trained
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", MLR, _data(), cpu, 0, Trainer(cpu, seed=0))
    fedavg = algorithm_class("fedavg")
    client = fedavg(ctx, fedavg.config_cls(local_epochs=1, batch_size=16, lr=0.1))
    models = {"global": WireModel.of(MLR, build(MLR, seed=3))}

    # Execute
    client.fit(1, 1, models)
    out = client.finalize(1, 1, models)

    # Assert
    assert out.details["deployed_reason"] == (
        "Its personalized model (mlr): the algorithm's final model (no guard)."
    )


def test_a_diverging_student_is_no_candidate_and_is_logged(caplog):
    # Prepare: the stuck client after its rounds, at a learning rate its student cannot take
    client = _client(OWN)
    for r in (1, 2):
        client.fit(r, 2, _trained_global())
    client.config = client.config.model_copy(update={"lr": 1e38})

    # Execute
    student = client.deployment.distil(2, (MLR, client.meme), None)

    # Assert
    assert student is None
    (said,) = [r.getMessage() for r in caplog.records if "distillation" in r.getMessage()]
    assert said.startswith("c0: the guard's distillation diverged (training loss became ")


def test_a_budget_in_parameters_counts_one_clients_copy():
    # Prepare: a device that may run any model of up to the MLR's parameters
    client = _client(DeployBudget(allow="any", max_params=_params(MLR)))

    # Assert: the MLR within, the wider MLP not (it holds more parameters)
    assert client._admits(MLR, build(MLR))
    assert not client._admits(BIG, build(BIG))
    assert client._admits(MLP, build(MLP))  # its own architecture, whatever the bound


def test_the_students_and_the_fine_tunings_rate_is_the_last_rounds_and_a_fresh_student_is_its_own(
    monkeypatch,
):
    # Prepare: a step schedule (lr 0.1, × 0.5 every 2 of 6 rounds: 0.025 in round 6), and the
    # trainer's optimizer and loop recorded, the loop not run (the student stays as it starts)
    client = _client(OWN, lr_schedule="step", lr_gamma=0.5)
    trainer = client.ctx.trainer
    rates = []
    optimizer = trainer.optimizer

    def recorded(params, cfg, lr=None):
        rates.append(lr)
        return optimizer(params, cfg, lr)

    monkeypatch.setattr(trainer, "optimizer", recorded)
    monkeypatch.setattr(trainer, "run", lambda step, batches, **kw: None)
    monkeypatch.setattr(trainer, "train_epochs", lambda *a, **kw: 0.0)
    teacher = (MLR, build(MLR, seed=7))
    start = (MLP, build(MLP, seed=8))

    # Execute
    fresh = client.deployment.distil(6, teacher, None)
    started = client.deployment.distil(6, teacher, start)
    tuned = client.deployment.finetune(6, _trained_global())
    client.deployment._distiller(6)(teacher, None)  # what the guard is handed distils the same

    # Assert: every optimizer at round 6's rate, 0.1 × 0.5² (not the first round's 0.1)
    assert rates == [pytest.approx(0.025)] * 4
    # ... the fresh student is this client's own architecture at its seed for students (salt
    # 3), the other starts from `start`'s weights
    assert fresh is not None and started is not None and tuned is not None
    expected = client.ctx.build_model(MLP, salt=3).state_dict()
    for k, v in fresh[1].state_dict().items():
        assert torch.equal(v, expected[k]), k
    other = client.ctx.build_model(MLP, salt=4).state_dict()
    assert not all(torch.equal(v, other[k]) for k, v in fresh[1].state_dict().items())
    for k, v in started[1].state_dict().items():
        assert torch.equal(v, start[1].state_dict()[k]), k


def test_the_finalize_hands_the_guard_students_of_its_last_round(monkeypatch):
    client = _client(OWN, lr_schedule="step", lr_gamma=0.5)
    deployment, rounds = client.deployment, []
    distil = deployment.distil

    def recorded(r, teacher, start, inputs=None):
        rounds.append(r)
        return distil(r, teacher, start, inputs)

    monkeypatch.setattr(deployment, "distil", recorded)
    out = _run(client, rounds=3)
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert rounds and set(rounds) == {3}


class _MemeOnly(_Stuck):
    """The stuck client whose final model is its MLR meme alone: with the guard off, nothing it
    names is within the default budget."""

    def guard_candidates(self):
        return {"meme": (self.meme_spec, self.meme)}


def test_with_the_guard_off_a_final_model_outside_the_budget_is_distilled_into_a_student():
    # Prepare: the guard off, its student on (default epochs)
    client = _client(OWN, kind=_MemeOnly, guard=False)

    # Execute
    out = _run(client)

    # Assert: a student of its own architecture learnt from the meme, and says so
    spec, model = client.personalized_model()
    assert spec == MLP and footprint(model).params == _params(MLP)
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_outside_budget"] == (
        "Its meme (mlr), the algorithm's final model, mlr is not an architecture this device runs; "
        "a student of its own architecture learnt from it."
    )
    assert out.details["deployed_reason"] == (
        "A student (mlp) of its meme (mlr): the algorithm's final model in its budget (the guard "
        "is off)."
    )
    d = client.ctx.data
    assert _accuracy(model, d.x_test, d.y_test) > 0.9  # the meme knows the data; so does it


class _PersonalOutside(_Stuck):
    """The stuck client whose personalized model is its MLR meme (as FedeRiCo's is a mixture of
    models): the algorithm's own final model is outside the default budget; the stuck MLP is a
    candidate within it."""

    def guard_candidates(self):
        return {PERSONAL: (self.meme_spec, self.meme), "own": (MLP, self.personal)}


def test_a_personalized_model_outside_the_budget_is_the_default_as_a_student():
    # Prepare: no evidence is ever clear (z = 100), so the guard deploys its default. Without
    # fine-tuning, the candidates within the budget are the stuck MLP alone.
    client = _client(OWN, kind=_PersonalOutside, guard_z=100.0, guard_ft_epochs=0)

    # Execute
    out = _run(client)

    # Assert: the default is a student of the personalized model, not the first model within
    # the budget (the stuck one): the student knows the data and says what it learnt from.
    spec, model = client.personalized_model()
    assert spec == MLP and footprint(model).params == _params(MLP)
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_reason"].startswith(
        "A student (mlp) of its personalized model (mlr) had 32/32 right on validation; no other "
        "candidate within its budget was clearly better (the best, its own model (mlp"
    )
    assert out.details["deployed_outside_budget"] == (
        "Its personalized model (mlr) had 32/32 but mlr is not an architecture this device runs; "
        "a student of its own architecture learnt from it."
    )
    d = client.ctx.data
    assert _accuracy(model, d.x_test, d.y_test) > 0.9
    assert _accuracy(client.personal, d.x_test, d.y_test) == 0.25  # what it replaced
    # distilled once from the stuck model and once afresh; kept with its round
    cfg = client.config
    assert out.details["samples_processed"] == (
        2 * cfg.local_epochs * 64 + 2 * cfg.guard_distill_epochs * 64
    )
    kept = client.deployment.guard.deployed
    assert kept is not None and Pick.from_state(kept.to_state()).round == 2


def test_with_the_guard_off_a_personalized_model_outside_the_budget_is_deployed_as_a_student():
    # Prepare: the guard off; the stuck MLP is within the budget
    client = _client(OWN, kind=_PersonalOutside, guard=False)

    # Execute
    out = _run(client)

    # Assert: a student of the personalized model, not the stuck model, from two starts (the
    # stuck model and afresh: the client has validation data to choose between them by)
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_reason"] == (
        "A student (mlp) of its personalized model (mlr): the algorithm's final model in its "
        "budget (the guard is off)."
    )
    d, cfg = client.ctx.data, client.config
    assert _accuracy(client.personalized_model()[1], d.x_test, d.y_test) > 0.9
    assert out.details["samples_processed"] == (
        2 * cfg.local_epochs * 64 + 2 * cfg.guard_distill_epochs * 64
    )
    kept = client.deployment.guard.deployed
    assert kept is not None and Pick.from_state(kept.to_state()).round == 0

    # ... and without students, the first model within its budget, which it says
    plain = _run(_client(OWN, kind=_PersonalOutside, guard=False, guard_distill_epochs=0))
    assert plain.details["deployed"] == "own (final, mlp)"
    assert plain.details["deployed_reason"] == (
        "Its own model (mlp): the first within its budget (the guard is off)."
    )


def test_without_validation_data_a_personalized_model_outside_the_budget_is_a_student():
    # Prepare: a client without validation data (the guard cannot choose)
    d = _data()
    data = ClientData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, CLASSES)
    client = _client(OWN, kind=_PersonalOutside, data=data)

    # Execute
    out = _run(client)

    # Assert: one student (from the stuck model: nothing to choose a second by), as the guard off
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_reason"].endswith("(it has no validation data to choose by).")
    cfg = client.config
    assert out.details["samples_processed"] == (
        2 * cfg.local_epochs * 64 + cfg.guard_distill_epochs * 64
    )


def test_a_client_that_names_no_personalized_model_gets_a_student_of_the_best_outside():
    # Prepare: the guard on, the algorithm naming its meme alone (outside the budget), like the
    # global and the fine-tuned models
    client = _client(OWN, kind=_MemeOnly)

    # Execute
    out = _run(client)

    # Assert
    assert out.details["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out.details["deployed_outside_budget"].endswith(
        "; a student of its own architecture learnt from it."
    )


class _PersonalAloneOutside(_Stuck):
    """The stuck client whose only candidate, its personalized model, is its MLR meme."""

    def guard_candidates(self):
        return {PERSONAL: (self.meme_spec, self.meme)}


def test_a_guard_with_nothing_within_the_budget_and_no_student_says_what_it_refused():
    client = _client(OWN, kind=_PersonalAloneOutside, guard_distill_epochs=0, guard_ft_epochs=0)
    refused = "mlr is not an architecture this device runs"
    message = (
        "the guard found no model within the device's budget to deploy: its personalized model "
        f"(mlr): {refused}; the final global model (mlr): {refused}"
    )
    with raises_exactly(RuntimeError, message):
        _run(client)


def test_a_student_not_clearly_better_than_the_choice_does_not_replace_it():
    # Prepare: a guard choosing between the stuck MLP (its personalized model) and a global
    # MLR outside the budget that knows the data; its "student" a twin of the stuck model
    d = _data()
    cpu = torch.device("cpu")
    guard = Guard(Trainer(cpu, seed=0), d, z=2.0, budget=OWN, own=MLP)
    stuck = build(MLP, seed=1)
    with torch.no_grad():
        stuck.layers[-1].weight.zero_()
        stuck.layers[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0]))
    trained = _trained_global()["global"].build()
    made = []

    def twin(teacher, start):
        made.append(start)
        copy = build(MLP, seed=2)
        copy.load_state_dict(stuck.state_dict())
        return MLP, copy

    # Execute
    out = guard.decide(2, {PERSONAL: (MLP, stuck), "global": (MLR, trained)}, twin)

    # Assert: the global model was clearly better, so students were made (from the stuck model
    # and afresh), but they are no better than the stuck model, which stays deployed
    assert len(made) == 2
    assert out["deployed"] == "personal (final, mlp)" and guard.deployed is None
    assert out["deployed_outside_budget"] == (
        "The final global model (mlr) had 32/32 but mlr is not an architecture this device runs."
    )


class _Nudged(torch.nn.Module):
    """Predicts class 0 everywhere, like the stuck model, except class 1 on `rows` (inputs)."""

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x):
        z = torch.zeros(len(x), CLASSES)
        z[:, 0] = 1.0
        known = (x[:, None, :] == self.rows[None]).all(-1).any(1)
        z[known] = torch.tensor([0.0, 1.0, 0.0, 0.0])
        return z


def test_a_model_outside_the_budget_better_but_not_clearly_is_not_distilled():
    # Prepare: the stuck MLP (class 0 everywhere: 8/32 right) and, outside the budget, a model
    # that also gets two class-1 validation samples right: 2 wins, 0 losses, and 2 ≤ 2·√2
    d = _data()
    guard = Guard(Trainer(torch.device("cpu"), seed=0), d, z=2.0, budget=OWN, own=MLP)
    stuck = build(MLP, seed=1)
    with torch.no_grad():
        stuck.layers[-1].weight.zero_()
        stuck.layers[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0]))
    nudged = _Nudged(d.x_val[d.y_val == 1][:2])
    made = []

    def student(teacher, start):
        made.append(start)
        return MLP, build(MLP, seed=2)

    # Execute
    out = guard.decide(2, {PERSONAL: (MLP, stuck), "global": (MLR, nudged)}, student)

    # Assert: the outside model has wins but is not clearly better, so no student is made and
    # the personalized model stays, with nothing said about the outside one
    teacher = guard._score("global", (MLR, nudged), 2, final=True)
    assert guard.clearly(teacher, guard._score(PERSONAL, (MLP, stuck), 2, final=True))[1:] == (
        2,
        0,
    )
    assert made == []
    assert out["deployed"] == "personal (final, mlp)" and guard.deployed is None
    assert "deployed_outside_budget" not in out


# -- the students' shifted images --------------------------------------------------------------
def _offset(moved: torch.Tensor, image: torch.Tensor, most: int) -> tuple[int, int] | None:
    """The offset (dy, dx) within ±`most` at which `moved` (c, h, w) is `image` read with the
    edge repeated, moved[c, r, k] = image[c, clamp(r + dy), clamp(k + dx)]; None if none."""
    _, h, w = image.shape
    for dy in range(-most, most + 1):
        for dx in range(-most, most + 1):
            rows = (torch.arange(h) + dy).clamp(0, h - 1)
            cols = (torch.arange(w) + dx).clamp(0, w - 1)
            if torch.equal(moved, image[:, rows][:, :, cols]):
                return dy, dx
    return None


def test_shifted_moves_each_image_by_its_own_offset_within_the_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 5, 7).contiguous(memory_format=torch.channels_last)
    out = shifted(x, 2, g)
    offsets = [_offset(moved, image, 2) for moved, image in zip(out, x, strict=True)]
    assert None not in offsets  # each a shift of its own image within the bound
    assert len(set(offsets)) > 10  # each its own, both ways
    assert {dy for dy, _ in offsets} == {-2, -1, 0, 1, 2}
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(shifted(x, 0, g), x)


IMAGE = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(1, 6, 6), kwargs={"hidden": [8]})


class _Seen(torch.nn.Module):
    """A teacher that records every input it labels."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(features, CLASSES)
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.clone())
        return self.linear(x.flatten(1))


def _image_client(**cfg):
    g = torch.Generator().manual_seed(3)
    images = [torch.randn(n, 1, 6, 6, generator=g) for n in (24, 8, 8)]
    labels = [torch.arange(len(x)) % CLASSES for x in images]
    data = ClientData(*(t for pair in zip(images, labels, strict=True) for t in pair), CLASSES)
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", IMAGE, data, cpu, 0, Trainer(cpu, seed=0), budget=OWN)
    return FML(ctx, FMLConfig(**({"batch_size": 8, "guard_distill_epochs": 3} | cfg)))


def test_a_student_of_images_learns_from_the_teachers_labels_of_shifted_copies():
    # Prepare: a client of 24 training images, shifts of up to 2 pixels, its teacher recording
    # what it labels
    client = _image_client(guard_distill_shift=2, guard_distill_views=1)
    teacher = _Seen(36)

    # Execute
    student = client.deployment.distil(2, (MLR, teacher), None)

    # Assert: the teacher labelled every batch of the 3 epochs (8 images each), each image a
    # shift of a training image within 2 pixels, not all of them unmoved
    assert student is not None and student[0] == IMAGE
    assert [len(x) for x in teacher.seen] == [8] * 9
    x_train = client.ctx.data.x_train
    moved = 0
    for batch in teacher.seen:
        originals = torch.stack(
            [next(o for o in x_train if _offset(image, o, 2) is not None) for image in batch]
        )
        moved += sum(not torch.equal(a, b) for a, b in zip(batch, originals, strict=True))
    assert moved > 0


@pytest.mark.parametrize("images", [True, False])
def test_without_a_shift_or_images_the_teacher_labels_the_training_split_once(images):
    # Prepare: images without a shift (PFML's and FedeRiCo's default); features (12) with one
    if images:
        client, teacher = _image_client(guard_distill_shift=0), _Seen(36)
    else:
        client = _client(OWN, guard_distill_epochs=3, guard_distill_shift=2)
        teacher = _Seen(FEATURES)

    # Execute
    client.deployment.distil(2, (MLR, teacher), None)

    # Assert: once, the training split as it is
    x_train = client.ctx.data.x_train
    assert len(teacher.seen) == 1 and torch.equal(teacher.seen[0], x_train)


def test_mixed_views_mix_each_image_with_another_labelled_by_its_larger_part():
    # Prepare: 24 one-pixel images (image k lights pixel k), labels k % 4, a linear teacher
    x = torch.eye(24).view(24, 1, 4, 6)
    y = torch.arange(24) % CLASSES
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(24, CLASSES))
    trainer = Trainer(torch.device("cpu"), seed=0)

    # Execute: 2 epochs of batches of 8, mixed, unshifted
    batches = list(trainer.distillation_batches(teacher, x, y, 8, 2, mix=True))

    # Assert: each input holds two images' pixels (or one, mixed with itself), weights summing
    # to 1; its label is its larger part's; the teacher's logits are its own for it; some
    # images are mixed
    assert len(batches) == 6
    mixes = 0
    for xb, yb, zb in batches:
        flat = xb.flatten(1)
        assert torch.all(flat >= 0) and torch.allclose(flat.sum(1), torch.ones(8))
        assert all(int((row > 0).sum()) <= 2 for row in flat)
        assert torch.equal(yb, flat.argmax(1) % CLASSES)
        torch.testing.assert_close(zb, teacher(xb))
        mixes += int(((flat > 0).sum(1) == 2).sum())
    assert mixes > 24


def test_a_guard_with_mixed_views_shows_its_teacher_mixtures_of_its_images_alone():
    # Prepare: 24 training images, mixed views without a shift; and a client of features
    client = _image_client(guard_distill_shift=0, guard_distill_views=1, guard_distill_mix=True)
    teacher = _Seen(36)
    features = _client(OWN, guard_distill_epochs=3, guard_distill_mix=True)
    seen_features = _Seen(FEATURES)

    # Execute
    client.deployment.distil(2, (MLR, teacher), None)
    features.deployment.distil(2, (MLR, seen_features), None)

    # Assert: the teacher labelled every batch of the 3 epochs, images none of the training
    # split holds among them; the features were labelled once, as they are
    x_train = client.ctx.data.x_train
    assert [len(x) for x in teacher.seen] == [8] * 9
    seen = torch.cat(teacher.seen)
    assert not all(any(torch.equal(s, t) for t in x_train) for s in seen)
    assert len(seen_features.seen) == 1
    assert torch.equal(seen_features.seen[0], features.ctx.data.x_train)


@pytest.mark.parametrize("views", [1, 3])
def test_each_epoch_of_a_student_of_images_shows_it_its_views_of_every_image(views):
    # Prepare: 24 training images in batches of 8, 2 epochs, shifts of a pixel
    client = _image_client(guard_distill_epochs=2, guard_distill_shift=1, guard_distill_views=views)
    teacher, before = _Seen(36), client.ctx.trainer.samples

    # Execute
    client.deployment.distil(2, (MLR, teacher), None)

    # Assert: the teacher labelled 3 batches a pass, a pass per view of each epoch, and each
    # pass counts as processed
    assert len(teacher.seen) == 3 * 2 * views
    assert client.ctx.trainer.samples - before == 24 * 2 * views


def test_a_student_of_features_trains_its_epochs_alone_whatever_the_views():
    # Prepare: features (12), 3 epochs, four views asked for
    client = _client(OWN, guard_distill_epochs=3, guard_distill_shift=1, guard_distill_views=4)
    teacher, before = _Seen(FEATURES), client.ctx.trainer.samples

    # Execute
    client.deployment.distil(2, (MLR, teacher), None)

    # Assert: labelled once, and 3 passes over the training split processed
    assert len(teacher.seen) == 1
    assert client.ctx.trainer.samples - before == 3 * len(client.ctx.data.x_train)


# -- the two students and their starts ---------------------------------------------------------
def _stuck_mlp():
    """An MLP that predicts class 0 everywhere: 8 of the 32 validation samples right."""
    stuck = build(MLP, seed=1)
    with torch.no_grad():
        stuck.layers[-1].weight.zero_()
        stuck.layers[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0]))
    return stuck


def _knowing_mlp():
    """An MLP that knows the data: a real student of the trained MLR (32/32 on validation)."""
    client = _client(OWN)  # (kept: its deployment holds it weakly)
    _, model = client.deployment.distil(2, (MLR, _trained_global()["global"].build()), None)
    return model


def _copy_of(model):
    out = build(MLP, seed=7)
    out.load_state_dict(model.state_dict())
    return out


def _decide(distil):
    """The guard between the stuck MLP (the default) and the trained MLR outside the budget,
    whose students `distil` makes (teacher, start) -> candidate or None."""
    guard = Guard(Trainer(torch.device("cpu"), seed=0), _data(), z=2.0, budget=OWN, own=MLP)
    trained = _trained_global()["global"].build()
    return guard.decide(2, {PERSONAL: (MLP, _stuck_mlp()), "global": (MLR, trained)}, distil)


OUTSIDE = "The final global model (mlr) had 32/32 but mlr is not an architecture this device runs"


def test_where_the_student_from_its_start_fails_the_fresh_one_is_still_made():
    knowing, starts = _knowing_mlp(), []

    def diverges_from_its_start(teacher, start):
        starts.append(start is not None)
        return None if start is not None else (MLP, _copy_of(knowing))

    out = _decide(diverges_from_its_start)
    assert starts == [True, False]
    assert out["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out["deployed_outside_budget"] == (
        f"{OUTSIDE}; a student of its own architecture learnt from it."
    )


@pytest.mark.parametrize("better", ["from its start", "afresh"])
def test_of_the_two_students_the_better_on_validation_is_the_one_kept(better):
    # One of the two students knows the data (32/32), the other is stuck (8/32): whichever was
    # made first, the student that knows it replaces the stuck default.
    knowing, stuck = _knowing_mlp(), _stuck_mlp()

    def one_knows(teacher, start):
        knows = (start is not None) == (better == "from its start")
        return MLP, _copy_of(knowing if knows else stuck)

    out = _decide(one_knows)
    assert out["deployed"] == f"{DISTILLED} (final, mlp)"
    assert out["deployed_reason"] == (
        "A student (mlp) of the final global model (mlr) had 32/32 right on validation, against "
        "8/32 for its personalized model (mlp)."
    )


def test_where_no_student_can_be_made_the_choice_stays_and_the_reason_says_no_more():
    out = _decide(lambda teacher, start: None)
    assert out["deployed"] == "personal (final, mlp)"
    assert out["deployed_outside_budget"] == OUTSIDE + "."


def test_a_kept_copy_as_the_students_start_is_rebuilt_from_its_weights():
    # Prepare: the choice is a kept copy (the best of an earlier round: no live model behind it)
    guard = Guard(Trainer(torch.device("cpu"), seed=0), _data(), z=2.0, budget=OWN, own=MLP)
    earlier = build(MLP, seed=4)
    guard.observe(1, {PERSONAL: (MLP, earlier)})
    kept = guard.best
    assert kept is not None and kept.source is None
    teacher = guard._score("global", (MLR, _trained_global()["global"].build()), 2, final=True)
    starts = []

    def record(teacher, start):
        starts.append(start)
        return None

    # Execute
    assert guard._student(teacher, kept, record, 2) is None

    # Assert: a student from the kept weights (an MLP built from them), then one afresh
    (spec, model), fresh = starts
    assert spec == MLP and fresh is None
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), earlier.state_dict().values(), strict=True)
    )


def test_a_candidate_outside_the_budget_does_not_stop_the_rounds_best_from_being_kept():
    guard = Guard(Trainer(torch.device("cpu"), seed=0), _data(), z=2.0, budget=OWN, own=MLP)
    trained, personal = _trained_global()["global"].build(), build(MLP, seed=4)
    guard.observe(1, {"global": (MLR, trained), PERSONAL: (MLP, personal)})
    assert guard.best is not None and (guard.best.name, guard.best.spec) == (PERSONAL, MLP)


@pytest.mark.parametrize(("wins", "replaces"), [(2, False), (7, True)])
def test_a_student_replaces_the_choice_only_when_clearly_better(wins, replaces):
    # 2 samples more right and none fewer: 2 ≤ 2·√2, not clear; 7 > 2·√7 ≈ 5.3, clear
    guard = Guard(Trainer(torch.device("cpu"), seed=0), _data(), z=2.0, budget=OWN, own=MLP)
    chosen_hits = torch.zeros(32, dtype=torch.bool)
    student_hits = chosen_hits.clone()
    student_hits[:wins] = True
    chosen = Pick(PERSONAL, 2, True, chosen_hits, 1.0)
    student = Pick(DISTILLED, 2, True, student_hits, 1.0)
    assert guard.replaces(student, chosen) is replaces


def test_the_first_student_is_found_without_making_it_or_changing_what_is_deployed():
    guard = Guard(Trainer(torch.device("cpu"), seed=0), _data(), z=2.0, budget=OWN, own=MLP)
    stuck, trained = _stuck_mlp(), _trained_global()["global"].build()
    final = {PERSONAL: (MLP, stuck), "global": (MLR, trained)}
    before = guard.trainer.rng_state()
    earlier = Pick(PERSONAL, 1, False, torch.zeros(32, dtype=torch.bool), 1.0)
    guard.deployed = earlier

    # The global model outside the budget is clearly better than the stuck default: its
    # student starts from the stuck model (the choice)
    (teacher, start) = guard.first_student(2, final)
    assert teacher == final["global"] and start == final[PERSONAL]
    assert guard.deployed is earlier and torch.equal(guard.trainer.rng_state(), before)
    # Nothing outside the budget is better: no student
    assert guard.first_student(2, {PERSONAL: (MLP, _copy_of(_knowing_mlp()))}) is None


def test_students_trained_already_answer_the_guards_first_asks_and_the_rest_are_made():
    # A stack's students (coordinator.stacking) answer the first asks in order; a later ask
    # (a model outside the budget clearly better than the choice) is distilled as usual, with
    # its own teacher and start; without a distiller, nothing.
    made = [(MLP, build(MLP, seed=1)), (MLP, build(MLP, seed=2))]
    asked = []

    def distil(teacher, start):
        asked.append((teacher, start))
        return MLP, build(MLP, seed=3)

    served = _served(made, distil)
    teacher, start = (MLR, build(MLR)), (MLP, build(MLP))
    assert served(teacher, start) is made[0] and served(teacher, None) is made[1]
    later = served(teacher, start)
    assert later is not None and asked == [(teacher, start)]
    alone = _served([made[0]], None)
    assert alone is not None and alone(teacher, start) is made[0]
    assert alone(teacher, start) is None
    assert _served([], distil) is distil


@pytest.mark.parametrize(
    ("cfg", "asks"),
    [({}, True), ({"guard": False}, False), ({"guard_distill_epochs": 0}, False)],
    ids=["students", "guard-off", "no-students"],
)
def test_a_deployment_asks_for_a_first_student_only_where_its_guard_makes_students(cfg, asks):
    # The stuck client after its rounds: its default, the mixture, is outside the budget
    client = _client(OWN, **cfg)
    for r in (1, 2):
        client.fit(r, 2, _trained_global())
    final, _ = client.deployment.final_candidates(2, _trained_global())
    request = client.deployment.first_student(2, final)
    assert (request is not None) == asks
    if asks:  # a student of the default (the fine-tuned MLR here), from its own MLP
        teacher, start = request
        assert teacher is next(iter(final.values())) and start is final[PERSONAL]


# -- the unlabeled inputs a finalize task may carry for the students -----------------------------
def test_a_student_learns_on_the_training_split_then_the_unlabeled_inputs_the_teacher_labels():
    # Prepare: 7 unlabeled inputs, and a teacher whose classes for them are computed here
    client = _client(OWN)
    u = torch.randn(7, FEATURES, generator=torch.Generator().manual_seed(4))
    teacher = (MLR, build(MLR, seed=7))
    with torch.no_grad():
        labels = teacher[1](u).argmax(1)
    d = client.ctx.data

    # Execute: the inputs arrive in double precision, the client's are float32
    got = client.deployment.unlabeled({UNLABELED: unlabeled_model(u.double(), CLASSES)})
    x, y = client.deployment.distillation_set(teacher, got)

    # Assert: the inputs as the client's are (float32), the training split first, as it is,
    # then the inputs with the teacher's classes
    assert got is not None and got.dtype == torch.float32 and torch.equal(got, u)
    assert torch.equal(x, torch.cat([d.x_train, u])) and torch.equal(
        y, torch.cat([d.y_train, labels])
    )
    assert len(set(labels.tolist())) > 1  # (labels the teacher tells apart: not a constant)
    # ... and the training split alone without them
    alone = client.deployment.distillation_set(teacher, None)
    assert alone[0] is d.x_train and alone[1] is d.y_train


_NOT_INPUTS = (
    "c0: the finalize task's 'unlabeled' is not a set of inputs this client's students can "
    "learn on ({}); they learn on its training split alone"
)
_TOKENS = unlabeled_model(torch.zeros(3, FEATURES), CLASSES)
_IMPOSTOR = WireModel(MLR, {"inputs": torch.zeros(3, FEATURES)})  # a model's name and spec


@pytest.mark.parametrize(
    ("carried", "tokens", "logged"),
    [
        (
            unlabeled_model(torch.zeros(3, FEATURES + 1), CLASSES),
            False,
            "c0: the finalize task's unlabeled inputs are of shape (13,), this client's of "
            "(12,); its students learn on its training split alone",
        ),
        (WireModel(MLR, build(MLR).state_dict()), False, _NOT_INPUTS.format(MLR)),
        (_IMPOSTOR, False, _NOT_INPUTS.format(MLR)),
        (_TOKENS, True, _NOT_INPUTS.format(_TOKENS.spec)),
    ],
    ids=["other-shape", "a-model", "a-model-holding-inputs", "token-client"],
)
def test_unlabeled_inputs_a_client_cannot_learn_on_are_logged_and_left_out(
    carried, tokens, logged, caplog
):
    # Prepare: a client whose finalize carries inputs of another shape, or a model by that name
    # (one even holding a tensor named as the inputs are), or float inputs where its own are
    # integer tokens
    d = _data()
    if tokens:
        d = ClientData(
            d.x_train.long(), d.y_train, d.x_val, d.y_val, d.x_test, d.y_test, num_classes=CLASSES
        )
    client = _client(OWN, data=d)

    # Execute: asked twice in one finalize, as a stack's students and the member's own ask
    with caplog.at_level("WARNING"):
        got = client.deployment.unlabeled({UNLABELED: carried})
        again = client.deployment.unlabeled({UNLABELED: carried})

    # Assert: the students learn on the training split alone, and the log says why, once
    assert got is None and again is None
    assert [r.getMessage() for r in caplog.records] == [logged]


def _right(model, data):
    """How many of `data`'s validation samples `model` gets right, and its mean validation
    loss, computed here."""
    model.eval()
    with torch.no_grad():
        z = model(data.x_val)
    return int((z.argmax(1) == data.y_val).sum()), float(F.cross_entropy(z, data.y_val))


def _sharper(model):
    """`model` with its logits tripled: the same classes, another loss."""
    out = _copy_of(model)
    with torch.no_grad():
        out.layers[-1].weight.mul_(3)
        out.layers[-1].bias.mul_(3)
    return out


def test_of_two_students_the_one_taught_on_the_inputs_is_kept_only_where_it_does_better():
    # Prepare: the stuck MLP gets 8 of 32 validation samples right, the knowing one 32, and its
    # sharper copy 32 at a lower loss
    client = _client(OWN)
    d, dep = client.ctx.data, client.deployment
    stuck, knowing = (MLP, _stuck_mlp()), (MLP, _knowing_mlp())
    sharp, twin = (MLP, _sharper(knowing[1])), (MLP, _copy_of(knowing[1]))
    assert [_right(m, d)[0] for _, m in (stuck, knowing, sharp)] == [8, 32, 32]
    assert _right(sharp[1], d)[1] < _right(knowing[1], d)[1]

    # Execute and assert: the taught student wins with more right, or as many at a lower loss;
    # the same model keeps the one without the inputs; where one diverged (None), the other.
    # Every win for the inputs is counted.
    assert dep.either(stuck, knowing) is knowing and dep.unlabeled_kept == 1
    assert dep.either(knowing, stuck) is knowing and dep.unlabeled_kept == 1
    assert dep.either(knowing, sharp) is sharp and dep.unlabeled_kept == 2
    assert dep.either(sharp, knowing) is sharp and dep.unlabeled_kept == 2
    assert dep.either(knowing, twin) is knowing and dep.unlabeled_kept == 2
    assert dep.either(None, stuck) is stuck and dep.unlabeled_kept == 3
    assert dep.either(stuck, None) is stuck and dep.unlabeled_kept == 3
    assert dep.either(None, None) is None and dep.unlabeled_kept == 3


@pytest.mark.parametrize(
    ("cfg", "validation", "sets"),
    [
        ({}, True, [None, "u"]),  # the guard chooses: a student without the inputs, one with
        ({"guard": False}, True, ["u"]),  # nothing chooses: the students learn on them
        ({}, False, ["u"]),  # no validation data to choose by
    ],
    ids=["guard", "guard-off", "no-validation"],
)
def test_the_students_learn_on_the_inputs_as_the_guard_can_choose(cfg, validation, sets):
    d = _data()
    if not validation:
        d = ClientData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, CLASSES)
    client = _client(OWN, data=d, **cfg)  # (kept: its deployment holds it weakly)
    dep = client.deployment
    u = torch.randn(3, FEATURES)
    assert dep.learns_on(None) == [None]
    assert [None if s is None else "u" for s in dep.learns_on(u)] == sets
    assert all(s is None or s is u for s in dep.learns_on(u))


def _inputs(kind, d):
    """A client's data and inputs for its students: the training split cut to 4 images and the
    test split's inputs, which the teacher labels right ("helps"); or the whole training split
    and 40 inputs near its images, half of them scaled far from every class centre, where the
    teacher's classes are arbitrary ("misleads")."""
    if kind == "helps":
        few = ClientData(
            d.x_train[:4], d.y_train[:4], d.x_val, d.y_val, d.x_test, d.y_test, CLASSES
        )
        return few, d.x_test
    g = torch.Generator().manual_seed(6)
    u = torch.cat([d.x_train[:20] + 0.1 * torch.randn(20, FEATURES, generator=g)] * 2)
    u[20:] *= 6
    return d, u


@pytest.mark.parametrize("kind", ["helps", "misleads"])
def test_with_inputs_to_choose_from_both_students_start_from_one_random_state(kind):
    # Prepare: the stuck client after its rounds, its teacher the trained MLR
    data, u = _inputs(kind, _data())
    client = _client(OWN, data=data)
    for r in (1, 2):
        client.fit(r, 2, _trained_global())
    dep, trainer, d = client.deployment, client.ctx.trainer, client.ctx.data
    teacher = (MLR, _trained_global()["global"].build())
    start = (MLP, client.personal)  # both students start from the device's model
    state, samples = trainer.rng_state(), trainer.samples

    # Each student made here by hand, from that state
    alone = dep.distil(2, teacher, start, dep.distillation_set(teacher, None))
    trainer.set_rng_state(state)
    taught = dep.distil(2, teacher, start, dep.distillation_set(teacher, u))
    after, cost = trainer.rng_state(), trainer.samples - samples
    trainer.set_rng_state(state)
    trainer.samples = samples

    # Execute
    chosen = dep._distiller(2, u)(teacher, start)

    # Assert: the one of the two that does better on validation (more right, or a lower loss),
    # both trained and counted, the random stream where the taught one left it
    (a, loss_a), (t, loss_t) = _right(alone[1], d), _right(taught[1], d)
    keep = taught if t > a or (t == a and loss_t < loss_a) else alone
    assert (keep is taught) == (kind == "helps") and t != a  # (each case as it says)
    for a, b in zip(chosen[1].state_dict().values(), keep[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert dep.unlabeled_kept == (keep is taught)
    epochs = client.config.guard_distill_epochs
    assert trainer.samples - samples == cost == epochs * (2 * len(d.x_train) + len(u))
    assert torch.equal(trainer.rng_state(), after)


def test_a_finalize_done_again_counts_its_own_students_that_kept_the_inputs():
    # Prepare: the client with 4 training images, whose students do better with the test
    # split's inputs (the "helps" case above), after its rounds
    data, u = _inputs("helps", _data())
    client = _client(OWN, data=data)
    for r in (1, 2):
        client.fit(r, 2, _trained_global())
    models = _trained_global() | {UNLABELED: unlabeled_model(u, CLASSES)}

    # Execute: the finalize twice (a task sent again)
    first, again = (client.finalize(2, 2, models).details for _ in range(2))

    # Assert: each reply counts its own students, not the first's too
    assert first["guard_distill_unlabeled"] == again["guard_distill_unlabeled"] == len(u)
    assert first["guard_distill_unlabeled_kept"] == again["guard_distill_unlabeled_kept"] >= 1


def test_with_the_guard_off_the_student_learns_on_the_inputs_with_no_choice():
    # Prepare: the guard off, its final model the meme outside the budget, twice: its finalize
    # with 20 unlabeled inputs and without
    u = _data(seed=3).x_test[:20]
    sides = [_client(OWN, kind=_MemeOnly, guard=False) for _ in range(2)]
    for client in sides:
        for r in (1, 2):
            client.fit(r, 2, _trained_global())

    # Execute
    carried = _trained_global() | {UNLABELED: unlabeled_model(u, CLASSES)}
    taught, alone = (
        c.finalize(2, 2, m).details
        for c, m in zip(sides, [carried, _trained_global()], strict=True)
    )

    # Assert: one student, on the training split and the inputs: their epochs' passes alone more
    epochs = sides[0].config.guard_distill_epochs
    assert taught["deployed"] == alone["deployed"] == f"{DISTILLED} (final, mlp)"
    assert taught["guard_distill_unlabeled"] == 20 and taught["guard_distill_unlabeled_kept"] == 0
    assert taught["samples_processed"] - alone["samples_processed"] == epochs * len(u)
