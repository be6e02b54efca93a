"""PersFL's device half: teacher selection, the two distillation losses, the λ/T grid search,
stage 1's FedAvg update and stage 2's distillation update, each against a computation of its own.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from tests_helpers import raises_exactly

from edge_sdk.algorithms import AlgorithmError, ClientContext
from edge_sdk.algorithms.persfl import (
    GridPoint,
    PersFL,
    PersFLConfig,
    archive_name,
    archive_round,
    distillation_loss,
)
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.state import load_state, save_state
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

FEATURES, CLASSES = 4, 3
MLR = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))
MLP = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,), kwargs={"hidden": [8]})


def _data(n_train=24, n_val=12, n_test=12, seed=0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val + n_test
    y = torch.arange(n) % CLASSES
    centres = torch.randn(CLASSES, FEATURES, generator=g)
    x = centres[y] + 0.7 * torch.randn(n, FEATURES, generator=g)
    a, b = n_train, n_train + n_val
    return ClientData(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], num_classes=CLASSES)


def _client(spec=MLR, data=None, **cfg) -> PersFL:
    data = data or _data()
    ctx = ClientContext("c0", spec, data, torch.device("cpu"), 0, Trainer(torch.device("cpu")))
    return PersFL(ctx, PersFLConfig(**cfg))


def _mlr(w: torch.Tensor, b: torch.Tensor) -> WireModel:
    return WireModel(MLR, {"linear.weight": w.clone(), "linear.bias": b.clone()})


def _val_ce(model: WireModel, data: ClientData) -> float:
    """Mean cross-entropy of an MLR on the validation split, written out by hand."""
    z = data.x_val @ model.weights["linear.weight"].T + model.weights["linear.bias"]
    log_p = z - torch.logsumexp(z, dim=1, keepdim=True)
    return float(-log_p[torch.arange(len(data.y_val)), data.y_val].mean())


def _test_scores(prefix: str, model: WireModel, data: ClientData) -> dict[str, float]:
    """An MLR's correct count, total and mean cross-entropy on the test split, by hand."""
    z = data.x_test @ model.weights["linear.weight"].T + model.weights["linear.bias"]
    log_p = z - torch.logsumexp(z, dim=1, keepdim=True)
    return {
        f"{prefix}_correct": int((z.argmax(1) == data.y_test).sum()),
        f"{prefix}_total": len(data.y_test),
        f"{prefix}_loss": float(-log_p[torch.arange(len(data.y_test)), data.y_test].mean()),
    }


def _assert_scores(got: dict[str, float], *want: dict[str, float]) -> None:
    expected = {k: v for w in want for k, v in w.items()}
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-5), k


# -- stage 1: teacher selection --------------------------------------------------------------
def test_persfl_teacher_selection_keeps_the_lowest_validation_loss():
    # Prepare: five global models of varying quality; the hand-computed validation CE decides.
    data = _data()
    client = _client(data=data)
    g = torch.Generator().manual_seed(3)
    candidates = [
        _mlr(torch.randn(CLASSES, FEATURES, generator=g), torch.randn(CLASSES, generator=g))
        for _ in range(5)
    ]
    losses = [_val_ce(m, data) for m in candidates]

    # Execute: the rounds arrive in order, as the global models of rounds 0..4
    kept = [client.consider_teacher(r, m) for r, m in enumerate(candidates)]

    # Assert: the kept teacher is the argmin, and each model was kept exactly when it beat all
    # the earlier ones.
    best = min(range(5), key=lambda i: losses[i])
    assert client.teacher_round == best
    assert client.teacher_loss == pytest.approx(losses[best], rel=1e-5)
    assert kept == [losses[i] < min(losses[:i], default=math.inf) for i in range(5)]
    assert torch.equal(
        client.teacher.linear.weight.detach(), candidates[best].weights["linear.weight"]
    )


def test_persfl_teacher_is_not_replaced_by_an_equally_good_later_model():
    client = _client()
    m = _mlr(torch.ones(CLASSES, FEATURES), torch.zeros(CLASSES))
    assert client.consider_teacher(2, m)
    assert not client.consider_teacher(5, m)  # strictly lower only: the earlier round stays
    assert client.teacher_round == 2


def test_persfl_fit_scores_the_received_model_as_the_previous_rounds_global_model():
    client = _client(local_epochs=1, batch_size=8)
    good = _mlr(torch.zeros(CLASSES, FEATURES), torch.zeros(CLASSES))
    client.fit(4, 5, {"global": good})
    assert client.teacher_round == 3  # round 4's task carries the global model of round 3


def test_persfl_never_takes_the_untrained_initial_model_as_its_teacher():
    # Round 1 carries the initial model: however low its validation loss, it is not a candidate.
    client = _client(local_epochs=1, batch_size=8)
    uniform = _mlr(torch.zeros(CLASSES, FEATURES), torch.zeros(CLASSES))  # CE = ln 3
    client.fit(1, 3, {"global": uniform})
    assert client.teacher is None
    confident_wrong = _mlr(torch.zeros(CLASSES, FEATURES), torch.tensor([9.0, 0.0, 0.0]))
    client.fit(2, 3, {"global": confident_wrong})
    assert client.teacher_round == 1  # the only trained global model so far, although worse


def test_persfl_without_validation_data_is_a_clear_error():
    d = _data()
    no_val = ClientData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, CLASSES)
    client = _client(data=no_val)
    msg = (
        "persfl picks its teacher (and λ, T) on the validation split and this client has none; "
        "give it validation data (e.g. data.split = [0.6, 0.2, 0.2])"
    )
    with raises_exactly(AlgorithmError, msg):
        client.fit(2, 2, {"global": WireModel.of(MLR, build(MLR))})


def test_persfl_refuses_a_global_model_of_other_classes_as_its_teacher():
    four = ArchSpec(family="mlr", num_classes=4, input_shape=(FEATURES,))
    msg = "persfl: the global model predicts 4 classes, this client has 3"
    with raises_exactly(AlgorithmError, msg):
        _client().consider_teacher(1, WireModel.of(four, build(four)))


def test_archive_round_reads_the_round_of_an_archived_name_only():
    assert archive_round(archive_name(12)) == 12
    assert archive_round("global") is None and archive_round("model") is None
    msg = "persfl: archived model name 'global@x' does not end in a round"
    with raises_exactly(AlgorithmError, msg):
        archive_round("global@x")


# -- the two distillation losses ---------------------------------------------------------------
def _by_hand(kind, z_s, z_t, y, lam, t):
    """(1−λ)·CE + λ·T²·(KL(p_t || p_s) or −Σ p_t·log p_s), batch mean, from the definitions."""
    log_q = z_s - torch.logsumexp(z_s, 1, keepdim=True)
    ce = -log_q[torch.arange(len(y)), y].mean()
    log_ps = z_s / t - torch.logsumexp(z_s / t, 1, keepdim=True)
    log_pt = z_t / t - torch.logsumexp(z_t / t, 1, keepdim=True)
    p_t = log_pt.exp()
    if kind == "kl":
        soft = (p_t * (log_pt - log_ps)).sum(1).mean()
    else:
        soft = -(p_t * log_ps).sum(1).mean()
    return (1 - lam) * ce + lam * t * t * soft


@pytest.mark.parametrize("kind", ["kl", "gd"])
@pytest.mark.parametrize(("lam", "t"), [(0.0, 4.0), (0.25, 1.0), (0.75, 4.0), (1.0, 16.0)])
def test_persfl_distillation_loss_matches_its_definition(kind, lam, t):
    g = torch.Generator().manual_seed(1)
    z_s, z_t = torch.randn(6, 5, generator=g), 3 * torch.randn(6, 5, generator=g)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    got = distillation_loss(kind, z_s, z_t, y, lam, t)
    assert float(got) == pytest.approx(float(_by_hand(kind, z_s, z_t, y, lam, t)), rel=1e-5)


def test_persfl_gd_exceeds_kl_by_the_teachers_scaled_entropy():
    # CE(p_t, p_s) = KL(p_t || p_s) + H(p_t): the variants differ by λ·T²·H(p_t), a constant.
    g = torch.Generator().manual_seed(2)
    z_s, z_t, y = (
        torch.randn(4, 3, generator=g),
        torch.randn(4, 3, generator=g),
        torch.arange(4) % 3,
    )
    lam, t = 0.5, 2.0
    p_t = F.softmax(z_t / t, 1)
    entropy = float(-(p_t * p_t.log()).sum(1).mean())
    gap = distillation_loss("gd", z_s, z_t, y, lam, t) - distillation_loss(
        "kl", z_s, z_t, y, lam, t
    )
    assert float(gap) == pytest.approx(lam * t * t * entropy, rel=1e-5)


# -- stage 2: the grid search --------------------------------------------------------------------
def test_grid_point_ranks_by_validation_accuracy_then_loss():
    a = GridPoint(0.1, 1.0, val_correct=7, val_total=10, val_loss=0.9)
    b = GridPoint(0.5, 2.0, val_correct=8, val_total=10, val_loss=2.0)
    c = GridPoint(0.9, 4.0, val_correct=8, val_total=10, val_loss=1.0)
    assert b.beats(a) and not a.beats(b)  # accuracy first, however bad the loss
    assert c.beats(b) and not b.beats(c)  # equal accuracy: lower loss
    assert not GridPoint(0.25, 1.0, 8, 10, 1.0).beats(c)  # a full tie keeps the earlier point


def test_persfl_grid_search_keeps_the_student_with_the_best_validation_accuracy():
    # Prepare: an MLP student (not the teacher's architecture, so it starts from scratch).
    data = _data(n_train=30, n_val=30)
    client = _client(
        spec=MLP,
        data=data,
        distill_lambdas=[0.0, 0.5, 0.9],
        distill_temperatures=[1.0, 8.0],
        distill_epochs=3,
        batch_size=10,
        lr=0.2,
    )
    teacher = _mlr(torch.randn(CLASSES, FEATURES), torch.zeros(CLASSES))

    # Execute
    out = client.personalize([(7, teacher)])

    # Assert: λ = 0 ran once (T is irrelevant there), every other pair once
    assert [(p.lam, p.temperature) for p in client.grid] == [
        (0.0, 1.0),
        (0.5, 1.0),
        (0.5, 8.0),
        (0.9, 1.0),
        (0.9, 8.0),
    ]
    # ...the kept student has the highest validation accuracy of the grid, measured here...
    z = client.student(data.x_val)
    acc = float((z.argmax(1) == data.y_val).float().mean())
    assert acc == pytest.approx(max(p.val_acc for p in client.grid))
    # ...and the reply reports the chosen point and the teacher.
    assert (out.details["distill_lambda"], out.details["distill_T"]) == (
        client.choice.lam,
        client.choice.temperature,
    )
    assert out.details["teacher_round"] == 7 and out.details["student_init"] == "scratch"


def test_persfl_each_grid_point_starts_from_the_same_student_and_batch_order():
    # A grid point's outcome must not depend on which points ran before it.
    teacher = _mlr(torch.randn(CLASSES, FEATURES), torch.zeros(CLASSES))
    common = {"spec": MLP, "distill_temperatures": [2.0], "batch_size": 8, "lr": 0.2}
    alone = _client(distill_lambdas=[0.9], **common)
    alone.personalize([(1, teacher)])
    after_others = _client(distill_lambdas=[0.0, 0.5, 0.9], **common)
    after_others.personalize([(1, teacher)])
    assert after_others.grid[-1] == alone.grid[0]


class _DivergesAtHalf(PersFL):
    """A client whose distillation blows up at λ = 0.5 (as a too-large λ·T step would)."""

    def distill(self, student, teacher, lam, temperature):
        if lam == 0.5:
            raise FloatingPointError("training loss became nan; lower the learning rate")
        return super().distill(student, teacher, lam, temperature)


def test_persfl_grid_search_skips_a_point_that_diverges(caplog):
    data = _data()
    ctx = ClientContext("c0", MLR, data, torch.device("cpu"), 0, Trainer(torch.device("cpu")))
    client = _DivergesAtHalf(
        ctx, PersFLConfig(distill_lambdas=[0.0, 0.5, 0.9], distill_temperatures=[2.0])
    )
    with caplog.at_level(logging.WARNING, logger="edge_sdk.algorithms.persfl"):
        out = client.personalize([(1, _mlr(torch.randn(CLASSES, FEATURES), torch.zeros(CLASSES)))])
    assert [p.lam for p in client.grid] == [0.0, 0.9]
    assert client.diverged == [(0.5, 2.0)]
    assert out.details["diverged_points"] == 1 and out.details["distill_lambda"] in (0.0, 0.9)
    assert caplog.messages == [
        "c0: distillation at λ=0.5, T=2 diverged "
        "(training loss became nan; lower the learning rate)"
    ]


def test_persfl_grid_search_where_every_point_diverges_says_to_lower_the_lr():
    client = _client(lr=1e30, distill_lambdas=[0.5], distill_temperatures=[2.0])
    msg = (
        "persfl: distillation diverged at every (λ, T) of the grid [(0.5, 2.0)]; "
        "lower the learning rate"
    )
    with raises_exactly(AlgorithmError, msg):
        client.personalize([(1, _mlr(torch.randn(CLASSES, FEATURES), torch.zeros(CLASSES)))])


def test_persfl_student_starts_from_the_teacher_when_the_architecture_matches():
    # λ = 1, T = 1 and no weight decay: a student equal to its teacher has zero loss and zero
    # gradient, so it stays the teacher exactly. A random start would move.
    client = _client(distill_lambdas=[1.0], distill_temperatures=[1.0], weight_decay=0.0)
    teacher = _mlr(torch.randn(CLASSES, FEATURES), torch.randn(CLASSES))
    out = client.personalize([(1, teacher)])
    assert out.details["student_init"] == "teacher"
    w = client.student.linear.weight.detach()
    assert torch.allclose(w, teacher.weights["linear.weight"], atol=1e-6)


def test_persfl_new_participant_picks_its_teacher_among_the_archived_models():
    # Prepare: a client that never trained receives the archive in its finalize task.
    data = _data()
    client = _client(data=data, distill_lambdas=[0.5], distill_temperatures=[2.0])
    g = torch.Generator().manual_seed(5)
    archive = {
        archive_name(r): _mlr(
            torch.randn(CLASSES, FEATURES, generator=g), torch.randn(CLASSES, generator=g)
        )
        for r in (3, 4, 5)
    }
    best = min((3, 4, 5), key=lambda r: _val_ce(archive[archive_name(r)], data))

    # Execute
    out = client.finalize(5, 5, archive)

    # Assert
    assert out.details["teacher_round"] == best
    assert client.personalized_model()[0] == MLR
    assert out.metrics["personal_total"] == len(data.y_test)


def test_persfl_finalize_without_any_global_model_is_a_clear_error():
    msg = "persfl: no teacher to distil from; the finalize task carried no global model"
    with raises_exactly(AlgorithmError, msg):
        _client().finalize(3, 3, {})


# -- pinned update rules -------------------------------------------------------------------------
def _sgd(params, grads, bufs, lr, momentum, wd):
    """torch.optim.SGD written out: b ← μ·b + (g + wd·w), first b = g + wd·w; w ← w − lr·b."""
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        d = g + wd * p
        bufs[i] = d if bufs[i] is None else momentum * bufs[i] + d
        p.sub_(lr * bufs[i])


def test_persfl_stage1_round_is_plain_sgd_on_cross_entropy():
    # Prepare: one full batch per epoch, so the batch order cannot matter; the last of three
    # rounds with a step schedule (one decay per third of the rounds): lr = 0.3 · 0.5².
    data = _data()
    client = _client(
        local_epochs=3,
        batch_size=1000,
        lr=0.3,
        momentum=0.9,
        weight_decay=0.01,
        lr_schedule="step",
        lr_gamma=0.5,
    )
    start = _mlr(torch.randn(CLASSES, FEATURES), torch.randn(CLASSES))

    # Execute
    out = client.fit(3, 3, {"global": start})

    # Assert: the same three steps, by hand, and their mean loss reported
    w = start.weights["linear.weight"].clone().requires_grad_(True)
    b = start.weights["linear.bias"].clone().requires_grad_(True)
    bufs = [None, None]
    losses = []
    for _ in range(3):
        z = data.x_train @ w.T + b
        log_p = z - torch.logsumexp(z, 1, keepdim=True)
        loss = -log_p[torch.arange(len(data.y_train)), data.y_train].mean()
        losses.append(float(loss.detach()))
        grads = torch.autograd.grad(loss, [w, b])
        with torch.no_grad():
            _sgd([w, b], grads, bufs, 0.3 * 0.5**2, 0.9, 0.01)
    sent = out.models["model"].weights
    assert torch.allclose(sent["linear.weight"], w.detach(), atol=1e-5)
    assert torch.allclose(sent["linear.bias"], b.detach(), atol=1e-5)
    assert out.metrics == {"train_loss": pytest.approx(sum(losses) / 3, rel=1e-5)}
    assert out.n_samples == len(data.y_train)


def test_persfl_stage1_follows_a_change_of_the_global_architecture():
    client = _client(local_epochs=1, batch_size=8)
    client.fit(1, 3, {"global": WireModel.of(MLR, build(MLR, seed=1))})
    mlp = WireModel.of(MLP, build(MLP, seed=2))
    out = client.fit(2, 3, {"global": mlp})
    assert out.models["model"].spec == MLP
    assert out.models["model"].weights.keys() == mlp.weights.keys()


@pytest.mark.parametrize("kind", ["kl", "gd"])
def test_persfl_stage2_distillation_steps_match_a_hand_written_loop(kind):
    # Prepare: teacher logits fixed, student an MLR, full batches.
    data = _data()
    lam, t = 0.75, 4.0
    client = _client(
        distill_loss=kind, distill_epochs=2, batch_size=1000, lr=0.1, weight_decay=1e-3
    )
    g = torch.Generator().manual_seed(9)
    student = build(MLR, seed=4)
    w0, b0 = student.linear.weight.detach().clone(), student.linear.bias.detach().clone()
    w_t, b_t = 2 * torch.randn(CLASSES, FEATURES, generator=g), torch.randn(CLASSES, generator=g)
    teacher = build(MLR, seed=5)
    teacher.load_state_dict({"linear.weight": w_t, "linear.bias": b_t})
    z_t = data.x_train @ w_t.T + b_t

    # Execute
    mean_loss = client.distill(student, teacher, lam, t)

    # Assert: the same steps, and the mean of their losses returned
    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    bufs = [None, None]
    losses = []
    for _ in range(2):
        z = data.x_train @ w.T + b
        loss = _by_hand(kind, z, z_t, data.y_train, lam, t)
        losses.append(float(loss.detach()))
        grads = torch.autograd.grad(loss, [w, b])
        with torch.no_grad():
            _sgd([w, b], grads, bufs, 0.1, 0.9, 1e-3)
    assert torch.allclose(student.linear.weight.detach(), w.detach(), atol=1e-5)
    assert torch.allclose(student.linear.bias.detach(), b.detach(), atol=1e-5)
    assert mean_loss == pytest.approx(sum(losses) / 2, rel=1e-5)


class _Seen(torch.nn.Module):
    """A teacher of 1×5×5 images that records every input it labels."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(25, CLASSES)
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.clone())
        return self.linear(x.flatten(1))


def _within_a_pixel(image: torch.Tensor, of: torch.Tensor) -> bool:
    """`image` is `of` moved by at most a pixel each way, its edge repeated."""
    _, h, w = of.shape
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            rows, cols = (
                (torch.arange(h) + dy).clamp(0, h - 1),
                (torch.arange(w) + dx).clamp(0, w - 1),
            )
            if torch.equal(image, of[:, rows][:, :, cols]):
                return True
    return False


@pytest.mark.parametrize("shift", [0, 1])
def test_persfl_stage2_on_images_shifts_each_batch_for_the_teacher_to_label_with_a_shift(shift):
    # Prepare: 16 training images of 5×5 in batches of 8, 2 epochs
    g = torch.Generator().manual_seed(1)
    x = [torch.rand(n, 1, 5, 5, generator=g) for n in (16, 6, 6)]
    y = [torch.arange(n) % CLASSES for n in (16, 6, 6)]
    data = ClientData(x[0], y[0], x[1], y[1], x[2], y[2], num_classes=CLASSES)
    image = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(1, 5, 5))
    client = _client(image, data, distill_epochs=2, batch_size=8, distill_shift=shift)
    teacher = _Seen()

    # Execute
    client.distill(build(image, seed=1), teacher, 0.5, 2.0)

    # Assert: without a shift the teacher labels the training split once, as it is; with one,
    # every batch of the 2 epochs (4), each image within a pixel of a training image, not all
    # of them where they were
    if shift == 0:
        assert len(teacher.seen) == 1 and torch.equal(teacher.seen[0], data.x_train)
        return
    assert [len(b) for b in teacher.seen] == [8] * 4
    seen = torch.cat(teacher.seen)
    assert all(any(_within_a_pixel(a, o) for o in data.x_train) for a in seen)
    assert any(not any(torch.equal(a, o) for o in data.x_train) for a in seen)


# -- what it evaluates and deploys ---------------------------------------------------------------
def _two_mlrs(seed: int) -> tuple[WireModel, WireModel]:
    g = torch.Generator().manual_seed(seed)
    return tuple(  # type: ignore[return-value]
        _mlr(torch.randn(CLASSES, FEATURES, generator=g), torch.randn(CLASSES, generator=g))
        for _ in range(2)
    )


def test_persfl_deploys_the_teacher_before_stage_2_and_nothing_before_any_global_model():
    client = _client()
    msg = "persfl: no model before the first global model arrived"
    with raises_exactly(RuntimeError, msg):
        client.personalized_model()
    client.consider_teacher(1, _mlr(torch.randn(CLASSES, FEATURES), torch.zeros(CLASSES)))
    spec, model = client.personalized_model()
    assert spec == MLR and model is client.teacher


def test_persfl_evaluates_a_global_model_that_beats_the_teacher_as_its_personal_model():
    # Prepare: no teacher yet, then a teacher and a global model on either side of it.
    data = _data()
    a, b = _two_mlrs(11)
    better, worse = (a, b) if _val_ce(a, data) < _val_ce(b, data) else (b, a)
    client = _client(data=data)

    # Execute / Assert: the global model alone is both
    got = client.evaluate({"global": worse})
    _assert_scores(got, _test_scores("personal", worse, data), _test_scores("global", worse, data))

    # ...a kept teacher with a lower validation CE is the personal model...
    client.consider_teacher(1, better)
    got = client.evaluate({"global": worse})
    _assert_scores(got, _test_scores("personal", better, data), _test_scores("global", worse, data))

    # ...and one with a higher CE gives way to the global model, which the next task keeps.
    client = _client(data=data)
    client.consider_teacher(1, worse)
    got = client.evaluate({"global": better})
    _assert_scores(
        got, _test_scores("personal", better, data), _test_scores("global", better, data)
    )

    # Without a global model: the teacher alone.
    _assert_scores(client.evaluate({}), _test_scores("personal", worse, data))


def test_persfl_evaluation_keeps_the_teacher_when_the_global_model_only_ties_it():
    # Prepare: validation inputs whose last feature is 0, and two MLRs that differ only in the
    # weights of that feature: the same validation CE, different test predictions.
    d = _data()
    x_val = d.x_val.clone()
    x_val[:, -1] = 0.0
    data = ClientData(d.x_train, d.y_train, x_val, d.y_val, d.x_test, d.y_test, CLASSES)
    w = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(4))
    other = w.clone()
    other[:, -1] = torch.tensor([6.0, -6.0, 0.0])
    teacher, tie = _mlr(w, torch.zeros(CLASSES)), _mlr(other, torch.zeros(CLASSES))
    assert _val_ce(teacher, data) == _val_ce(tie, data)
    assert _test_scores("p", teacher, data) != _test_scores("p", tie, data)
    client = _client(data=data)
    client.consider_teacher(1, teacher)

    # Execute
    got = client.evaluate({"global": tie})

    # Assert: strictly lower only, as for the teacher itself
    _assert_scores(got, _test_scores("personal", teacher, data), _test_scores("global", tie, data))


def test_persfl_evaluates_the_student_after_stage_2_and_a_global_model_of_its_classes_only():
    # Prepare: stage 2 has run (λ = 0.5 moves the student away from its teacher).
    data = _data()
    teacher, glob = _two_mlrs(12)
    client = _client(data=data, distill_lambdas=[0.5], distill_temperatures=[2.0], lr=0.3)
    client.personalize([(1, teacher)])
    student = WireModel.of(MLR, client.student)
    assert _test_scores("p", student, data) != _test_scores("p", teacher, data)
    four = ArchSpec(family="mlr", num_classes=4, input_shape=(FEATURES,))

    # Execute / Assert: the student, plus the global model when it predicts this client's classes
    _assert_scores(
        client.evaluate({"global": glob}),
        _test_scores("personal", student, data),
        _test_scores("global", glob, data),
    )
    _assert_scores(
        client.evaluate({"global": WireModel.of(four, build(four))}),
        _test_scores("personal", student, data),
    )


def test_persfl_evaluation_before_any_global_model_is_a_clear_error():
    msg = "persfl: nothing to evaluate before the first global model"
    with raises_exactly(AlgorithmError, msg):
        _client().evaluate({})


def test_persfl_finalize_distils_from_the_final_global_model_and_scores_it():
    # Prepare: a client that never trained; its finalize task carries the final global model.
    data = _data()
    glob, _ = _two_mlrs(13)
    # (No fine-tuned candidate: the guard keeps the student it distilled.)
    client = _client(
        data=data, distill_lambdas=[0.5], distill_temperatures=[2.0], guard_ft_epochs=0
    )

    # Execute
    out = client.finalize(5, 5, {"global": glob})

    # Assert: the global model of round 5 is the teacher; the reply scores student and global.
    assert out.details["teacher_round"] == 5
    assert out.details["teacher_val_loss"] == pytest.approx(_val_ce(glob, data), rel=1e-5)
    assert out.n_samples == len(data.y_train)
    student = WireModel.of(MLR, client.student)
    _assert_scores(
        out.metrics, _test_scores("personal", student, data), _test_scores("global", glob, data)
    )


def test_persfl_finalize_takes_the_archive_and_the_global_model_of_the_same_round():
    # The last archived model and "global" both belong to the final round (each decoded from
    # its own message).
    data = _data()
    old, glob = _two_mlrs(14)
    same = WireModel(glob.spec, {k: v.clone() for k, v in glob.weights.items()})
    client = _client(data=data, distill_lambdas=[0.5], distill_temperatures=[2.0])
    out = client.finalize(5, 5, {archive_name(4): old, archive_name(5): glob, "global": same})
    best = 4 if _val_ce(old, data) < _val_ce(glob, data) else 5
    assert out.details["teacher_round"] == best


def test_persfl_grid_and_choice_survive_a_restart(tmp_path):
    # Prepare: stage 2 ran, one grid point diverged.
    data = _data()
    ctx = ClientContext("c0", MLR, data, torch.device("cpu"), 0, Trainer(torch.device("cpu")))
    config = PersFLConfig(distill_lambdas=[0.0, 0.5, 0.9], distill_temperatures=[2.0])
    client = _DivergesAtHalf(ctx, config)
    client.personalize([(1, _mlr(torch.randn(CLASSES, FEATURES), torch.zeros(CLASSES)))])
    save_state(tmp_path / "c0.state", client.state_dict())

    # Execute: a new instance of the same client loads it.
    fresh = PersFL(ctx, config)
    fresh.load_state_dict(load_state(tmp_path / "c0.state"))

    # Assert
    assert fresh.grid == client.grid and len(fresh.grid) == 2
    assert fresh.choice == client.choice and fresh.choice is not None
    assert fresh.diverged == [(0.5, 2.0)]
