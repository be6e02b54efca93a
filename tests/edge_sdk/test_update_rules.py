"""Every client update rule, pinned against a plain implementation of algorithms.md's formulas.

Each test runs the SDK's real ClientAlgorithm (with its Trainer) for one or two rounds on a tiny
model and fixed data, and compares the weights it ends with against an independent computation
written here: models as lists of tensors with a functional forward, cross-entropy and
KL(teacher || student) written out, SGD / Adam steps written out. Only the data order is shared:
the reference draws its batches from a generator seeded like the client's Trainer, the way the
Trainer documents it (a fresh permutation per epoch; for PFML's iterations, the positions of the
largest D of fresh uniform keys).
"""

from __future__ import annotations

import pytest
import torch

from edge_sdk.algorithms import ClientContext, algorithm_class
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

SHAPE = (1, 4, 4)
CLASSES = 3
N = 24
SEED = 5
TOL = {"atol": 2e-5, "rtol": 1e-4}

Params = list[torch.Tensor]


# -- fixtures: data, specs, the algorithm under test ---------------------------------------------
def _data() -> ClientData:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(N) % CLASSES
    x = torch.randn(N, *SHAPE, generator=g) + 0.5 * y.view(-1, 1, 1, 1).float()
    return ClientData(x, y, x[:0], y[:0], x[:6], y[:6], num_classes=CLASSES)


def _spec(family: str = "mlr", **kwargs) -> ArchSpec:
    return ArchSpec(family=family, num_classes=CLASSES, input_shape=SHAPE, kwargs=kwargs)


MLR, MLP = _spec(), _spec("mlp", hidden=[5])


def _algo(name: str, spec: ArchSpec, **cfg):
    cls = algorithm_class(name)
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", spec, _data(), cpu, SEED, Trainer(cpu, seed=SEED))
    return cls(ctx, cls.config_cls(**cfg))


def _wire(spec: ArchSpec, seed: int) -> WireModel:
    return WireModel.of(spec, build(spec, seed=seed))


def _params_of(weights) -> Params:
    """A state dict as a list of leaf tensors (Linear weight, bias, weight, bias...)."""
    return [t.detach().clone().float() for t in weights.values()]


def _assert_weights(model_or_weights, expected: Params) -> None:
    got = model_or_weights
    if isinstance(got, torch.nn.Module):
        got = got.state_dict()
    got = list(got.values())
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a.float(), b, **TOL), (a - b).abs().max()


# -- the reference: forward, losses, optimizers, written out --------------------------------------
def forward(p: Params, x: torch.Tensor) -> torch.Tensor:
    """Linear layers (W, b pairs) with ReLU between them: mlr is one pair, mlp two."""
    h = x.flatten(1)
    for i in range(0, len(p), 2):
        h = h @ p[i].T + p[i + 1]
        if i + 2 < len(p):
            h = h.clamp_min(0)
    return h


def ce(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logp = z - z.logsumexp(1, keepdim=True)
    return -logp[torch.arange(len(y)), y].mean()


def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)), summed over classes, mean over the batch."""
    log_t = teacher - teacher.logsumexp(1, keepdim=True)
    log_s = student - student.logsumexp(1, keepdim=True)
    return (log_t.exp() * (log_t - log_s)).sum(1).mean()


def grad(loss_fn, p: Params) -> Params:
    leaves = [t.detach().clone().requires_grad_(True) for t in p]
    return list(torch.autograd.grad(loss_fn(leaves), leaves))


class SGD:
    """v ← μ·v + (g + wd·w) (v = g + wd·w on the first step); w ← w − lr·v."""

    def __init__(self, lr: float, momentum: float, wd: float) -> None:
        self.lr, self.mu, self.wd, self.v = lr, momentum, wd, None

    def step(self, p: Params, g: Params) -> Params:
        d = [gi + self.wd * pi for pi, gi in zip(p, g, strict=True)]
        if self.v is None or self.mu == 0:
            self.v = d
        else:
            self.v = [self.mu * v + di for v, di in zip(self.v, d, strict=True)]
        return [pi - self.lr * v for pi, v in zip(p, self.v, strict=True)]


class Adam:
    """L2 weight decay added to g; m, v moving averages with bias correction; eps 1e-8."""

    def __init__(self, lr: float, beta1: float, wd: float) -> None:
        self.lr, self.b1, self.b2, self.wd, self.t = lr, beta1, 0.999, wd, 0
        self.m: Params | None = None
        self.v: Params | None = None

    def step(self, p: Params, g: Params) -> Params:
        self.t += 1
        d = [gi + self.wd * pi for pi, gi in zip(p, g, strict=True)]
        m0 = self.m or [torch.zeros_like(x) for x in p]
        v0 = self.v or [torch.zeros_like(x) for x in p]
        self.m = [self.b1 * m + (1 - self.b1) * di for m, di in zip(m0, d, strict=True)]
        self.v = [self.b2 * v + (1 - self.b2) * di * di for v, di in zip(v0, d, strict=True)]
        out = []
        for pi, m, v in zip(p, self.m, self.v, strict=True):
            m_hat, v_hat = m / (1 - self.b1**self.t), v / (1 - self.b2**self.t)
            out.append(pi - self.lr * m_hat / (v_hat.sqrt() + 1e-8))
        return out


def epoch_batches(gen: torch.Generator, batch_size: int) -> list[torch.Tensor]:
    perm = torch.randperm(N, generator=gen)
    return [perm[i : i + batch_size] for i in range(0, N, batch_size)]


def fresh_batches(gen: torch.Generator, batch_size: int, count: int) -> list[torch.Tensor]:
    """`count` batches of distinct samples: each the positions of the largest of N uniform
    keys, the `count` rows of keys drawn at once."""
    keys = torch.rand(count, N, generator=gen)
    return list(keys.topk(min(batch_size, N), dim=1).indices)


def sgd_epochs(p, opt, gen, epochs, batch_size, extra=None) -> tuple[Params, float]:
    """Plain supervised epochs: CE (+ extra(params)) per batch, one optimizer step each.
    Returns the weights and the mean batch loss (the `train_loss` a client reports)."""
    d = _data()
    losses = []
    for _ in range(epochs):
        for idx in epoch_batches(gen, batch_size):
            x, y = d.x_train[idx], d.y_train[idx]

            def loss(q, x=x, y=y):
                return ce(forward(q, x), y) + (extra(q) if extra else 0)

            losses.append(float(loss(p)))
            p = opt.step(p, grad(loss, p))
    return p, sum(losses) / len(losses)


def accuracy(p: Params) -> int:
    d = _data()
    return int((forward(p, d.x_test).argmax(1) == d.y_test).sum())


# -- local, fedavg, fedprox, fedavg_ft ------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_local_trains_epochs_with_one_optimizer_for_the_whole_run(optimizer):
    # Prepare: 2 epochs of batches of 10 (the last short), momentum kept across rounds, the
    # step schedule (R = 3: lr × γ from round 2).
    cfg = dict(local_epochs=2, batch_size=10, lr=0.05, momentum=0.6, weight_decay=0.01)
    algo = _algo("local", MLP, optimizer=optimizer, lr_schedule="step", lr_gamma=0.5, **cfg)
    p = _params_of(algo.model.state_dict())
    gen = torch.Generator().manual_seed(SEED)
    opt = SGD(0.05, 0.6, 0.01) if optimizer == "sgd" else Adam(0.05, 0.6, 0.01)

    # Execute
    algo.fit(1, 3, {})
    result = algo.fit(2, 3, {})
    final = algo.finalize(2, 3, {})

    # Assert
    p, _ = sgd_epochs(p, opt, gen, 2, 10)
    opt.lr = 0.05 * 0.5
    p, loss = sgd_epochs(p, opt, gen, 2, 10)
    _assert_weights(algo.model, p)
    assert algo.personalized_model()[1] is algo.model
    assert result.metrics["train_loss"] == pytest.approx(loss, rel=1e-4)
    assert result.n_samples == N and not result.models
    assert final.metrics["personal_correct"] == accuracy(p) and "global_total" not in final.metrics


@pytest.mark.parametrize(
    ("name", "mu"), [("fedavg", 0.0), ("fedprox", 0.0), ("fedprox", 0.7), ("fedprox", 1.0)]
)
def test_fedavg_and_fedprox_train_from_each_round_s_global_model_with_a_fresh_optimizer(name, mu):
    # Prepare: the step schedule at R = 2 halves the lr in round 2.
    extra = {"mu": mu} if name == "fedprox" else {}
    algo = _algo(
        name, MLR, local_epochs=2, batch_size=7, lr=0.1, momentum=0.5, weight_decay=0.02,
        lr_schedule="step", lr_gamma=0.5, **extra,
    )  # fmt: skip
    g1, g2 = _wire(MLR, 1), _wire(MLR, 2)
    gen = torch.Generator().manual_seed(SEED)

    # Execute
    r1 = algo.fit(1, 2, {"global": g1})
    r2 = algo.fit(2, 2, {"global": g2})

    # Assert
    for glob, result, lr in ((g1, r1, 0.1), (g2, r2, 0.05)):
        anchor = _params_of(glob.weights)

        def prox(q, anchor=anchor):
            # μ/2·||w − w_global||², the anchor being this round's global model
            return mu / 2 * sum(((a - b) ** 2).sum() for a, b in zip(q, anchor, strict=True))

        p, loss = sgd_epochs(list(anchor), SGD(lr, 0.5, 0.02), gen, 2, 7, prox if mu else None)
        _assert_weights(result.models["model"].weights, p)
        assert result.models["model"].spec == MLR and result.n_samples == N
        assert result.metrics["train_loss"] == pytest.approx(loss, rel=1e-4)


def test_fedavg_deploys_and_scores_the_global_model_it_received():
    algo = _algo("fedavg", MLR, local_epochs=1, batch_size=8)
    g1, final = _wire(MLR, 1), _wire(MLR, 3)
    algo.fit(1, 2, {"global": g1})
    trained = _params_of(algo.model.state_dict())

    scores = algo.evaluate({})  # no global model sent: the client's own copy
    sent = algo.evaluate({"global": final})  # the global model it was sent
    result = algo.finalize(2, 2, {"global": final})

    assert sent["personal_correct"] == accuracy(_params_of(final.weights))
    assert scores["personal_correct"] == accuracy(trained)
    assert scores["global_correct"] == scores["personal_correct"]
    _assert_weights(algo.personalized_model()[1], _params_of(final.weights))
    assert result.metrics["personal_correct"] == accuracy(_params_of(final.weights))


def test_fedavg_ft_fine_tunes_the_final_global_model_at_the_last_round_s_lr():
    algo = _algo(
        "fedavg_ft", MLR, ft_epochs=3, batch_size=8, lr=0.2, momentum=0.3, weight_decay=0.0,
        lr_schedule="step", lr_gamma=0.1,
    )  # fmt: skip
    final = _wire(MLR, 3)
    gen = torch.Generator().manual_seed(SEED)

    result = algo.finalize(3, 3, {"global": final})

    # R = 3: the lr at the last round is 0.2 × 0.1²
    p, loss = sgd_epochs(_params_of(final.weights), SGD(0.2 * 0.01, 0.3, 0.0), gen, 3, 8)
    _assert_weights(algo.model, p)
    assert result.metrics["personal_correct"] == accuracy(p)  # scored after fine-tuning
    assert result.metrics["global_correct"] == accuracy(_params_of(final.weights))
    assert result.metrics["ft_loss"] == pytest.approx(loss, rel=1e-4)
    assert result.n_samples == N
    assert algo.evaluate({"global": final})["personal_correct"] == accuracy(p)


# -- FML -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [10, 64])  # three batches per epoch, or one
def test_fml_mutual_learning_step_roles_kl_direction_meme_reset_and_optimizers(bs):
    # Prepare: personalized mlp, meme mlr; α ≠ β ≠ 1/2 so that swapping them shows; two rounds
    # with different global models; the step schedule (R = 3) changes the lr in round 2.
    a, b, lr, mom, wd = 0.3, 0.8, 0.1, 0.5, 0.01
    algo = _algo(
        "fml", MLP, alpha=a, beta=b, local_epochs=1, batch_size=bs, lr=lr, momentum=mom,
        weight_decay=wd, lr_schedule="step", lr_gamma=0.5,
    )  # fmt: skip
    personal = _params_of(algo.personal.state_dict())
    g1, g2 = _wire(MLR, 1), _wire(MLR, 2)
    gen = torch.Generator().manual_seed(SEED)
    opt_p = SGD(lr, mom, wd)  # one personal optimizer for the whole run

    # Execute
    r1 = algo.fit(1, 3, {"global": g1})
    r2 = algo.fit(2, 3, {"global": g2})

    # Assert
    d = _data()
    for r, glob, result in ((1, g1, r1), (2, g2, r2)):
        rate = lr if r == 1 else lr * 0.5
        opt_p.lr = rate
        opt_m = SGD(rate, mom, wd)  # a fresh meme optimizer every round
        meme = _params_of(glob.weights)  # the meme starts the round as the global model
        sum_p = sum_m = 0.0
        batches = epoch_batches(gen, bs)
        for idx in batches:
            x, y = d.x_train[idx], d.y_train[idx]
            z_p, z_m = forward(personal, x).detach(), forward(meme, x).detach()

            # L_personal = α·CE + (1−α)·KL(meme || personal); L_meme = β·CE + (1−β)·KL(p || m)
            def loss_p(q, x=x, y=y, t=z_m):
                return a * ce(forward(q, x), y) + (1 - a) * kl(t, forward(q, x))

            def loss_m(q, x=x, y=y, t=z_p):
                return b * ce(forward(q, x), y) + (1 - b) * kl(t, forward(q, x))

            sum_p, sum_m = sum_p + float(loss_p(personal)), sum_m + float(loss_m(meme))
            g_p, g_m = grad(loss_p, personal), grad(loss_m, meme)
            personal, meme = opt_p.step(personal, g_p), opt_m.step(meme, g_m)
        out = result.models["meme"]
        assert out.spec == glob.spec and result.n_samples == N
        _assert_weights(out.weights, meme)
        assert result.metrics["loss_personal"] == pytest.approx(sum_p / len(batches), rel=1e-4)
        assert result.metrics["loss_meme"] == pytest.approx(sum_m / len(batches), rel=1e-4)
    _assert_weights(algo.personal, personal)
    assert algo.personalized_model()[1] is algo.personal
    scores = algo.evaluate({"global": g2})
    assert scores["personal_correct"] == accuracy(personal)
    assert scores["global_correct"] == accuracy(_params_of(g2.weights))


def _sure_of_class_zero(spec: ArchSpec) -> dict[str, torch.Tensor]:
    """Weights that predict class 0 for everything, surely: a high validation loss."""
    w = {k: torch.zeros_like(v) for k, v in build(spec).state_dict().items()}
    w[list(w)[-1]][0] = 10.0  # the last layer's bias
    return w


@pytest.mark.parametrize("gate", ["validation", "soft"])
@pytest.mark.parametrize("spoiled", ["personal", "global"])
def test_fml_alpha_gate_opens_once_the_meme_does_better_on_validation(spoiled, gate):
    # Prepare: a client with validation data; either its personalized model or the global model
    # is sure of one class, so the other has the lower validation loss.
    a, b, lr = 0.3, 0.8, 0.1
    d = _data()
    val = ClientData(d.x_train, d.y_train, d.x_train[:12], d.y_train[:12], d.x_test, d.y_test, 3)
    cls = algorithm_class("fml")
    cpu = torch.device("cpu")
    ctx = ClientContext("c0", MLP, val, cpu, SEED, Trainer(cpu, seed=SEED))
    cfg = {"alpha": a, "beta": b, "local_epochs": 1, "batch_size": 64, "lr": lr}
    algo = cls(
        ctx, cls.config_cls(**cfg, momentum=0.0, weight_decay=0.0, guard=False, alpha_gate=gate)
    )
    glob = _wire(MLR, 1)
    if spoiled == "personal":
        algo.personal.load_state_dict(_sure_of_class_zero(MLP))
    else:
        glob = WireModel(MLR, _sure_of_class_zero(MLR))
    personal, meme = _params_of(algo.personal.state_dict()), _params_of(glob.weights)
    xv, yv = val.x_val, val.y_val
    loss_m, loss_p = float(ce(forward(meme, xv), yv)), float(ce(forward(personal, xv), yv))
    meme_better = loss_m < loss_p
    assert meme_better == (spoiled == "personal")  # each case takes one side of the gate
    # The gate: open (the configured α) once the meme does better; below that, learn from the
    # labels alone ("validation") or from the meme in proportion to the losses ("soft").
    weight = float(meme_better) if gate == "validation" else min(1.0, loss_p / loss_m)
    assert (weight == 1.0) == meme_better and (gate == "validation" or weight > 0)
    alpha = 1 - (1 - a) * weight

    # Execute
    algo.fit(1, 1, {"global": glob})

    # Assert: one plain SGD step of each loss, with this round's α (β as configured).
    idx = epoch_batches(torch.Generator().manual_seed(SEED), 64)[0]
    x, y = d.x_train[idx], d.y_train[idx]
    z_p, z_m = forward(personal, x).detach(), forward(meme, x).detach()
    g_p = grad(
        lambda q: alpha * ce(forward(q, x), y) + (1 - alpha) * kl(z_m, forward(q, x)), personal
    )
    g_m = grad(lambda q: b * ce(forward(q, x), y) + (1 - b) * kl(z_p, forward(q, x)), meme)
    _assert_weights(algo.personal, [p - lr * g for p, g in zip(personal, g_p, strict=True)])
    _assert_weights(algo.meme, [m - lr * g for m, g in zip(meme, g_m, strict=True)])


# -- PFML ----------------------------------------------------------------------------------------
def _pfml_reference(w_global: Params, aux: Params, gen, *, E, D, K, lam, lr):
    """One round of Algorithm 1 as algorithms.md writes it; returns (w_i, m_i, mean loss)."""
    d = _data()
    w, m = list(w_global), list(aux)
    m_prev = list(aux)  # the auxiliary as the round found it
    losses = []

    def sq(q, anchor):
        return sum(((a - b) ** 2).sum() for a, b in zip(q, anchor, strict=True))

    for idx in fresh_batches(gen, D, E):
        x, y = d.x_train[idx], d.y_train[idx]
        p_w, p_m = forward(w, x).detach(), forward(m, x).detach()  # teachers of this iteration

        def loss_m(q, x=x, y=y, t=p_w):  # L(m) = CE(m) + KL(p_w || p_m)
            return ce(forward(q, x), y) + kl(t, forward(q, x))

        def loss_w(q, x=x, y=y, t=p_m):  # L(w) = CE(w) + KL(p_m || p_w)
            return ce(forward(q, x), y) + kl(t, forward(q, x))

        theta, w_hat = list(m), list(w)
        for _ in range(K):  # θ ← argmin L(θ) + λ/2||m_prev − θ||²; ŵ likewise around w_global
            g = grad(lambda q: loss_m(q) + lam / 2 * sq(q, m_prev), theta)
            theta = [t - lr * gi for t, gi in zip(theta, g, strict=True)]
            g = grad(lambda q: loss_w(q) + lam / 2 * sq(q, w_global), w_hat)
            w_hat = [t - lr * gi for t, gi in zip(w_hat, g, strict=True)]
        g_m, g_w = grad(loss_m, m), grad(loss_w, w)
        losses.append(float(loss_m(m) + loss_w(w)))
        m = [p - lr * gi - lr * lam * (p - t) for p, gi, t in zip(m, g_m, theta, strict=True)]
        w = [p - lr * gi - lr * lam * (p - t) for p, gi, t in zip(w, g_w, w_hat, strict=True)]
    return w, m, sum(losses) / max(1, len(losses))


def _initial_aux(aux_spec: ArchSpec, glob: WireModel) -> Params:
    """m_i before its first round: the global model, or its own seeded init (other arch)."""
    if aux_spec == glob.spec:
        return _params_of(glob.weights)
    return _params_of(build(aux_spec, seed=SEED * 1009 + 1).state_dict())


@pytest.mark.parametrize(
    ("aux_spec", "aux_init", "E"),
    [(MLR, "persist", 3), (MLR, "global", 3), (MLP, "persist", 3), (MLR, "persist", 1)],
)
def test_pfml_round_inner_steps_anchors_outer_step_and_personalized_model(aux_spec, aux_init, E):
    # Prepare: K = 2 inner steps, λ = 0.7, E iterations of D = 10; two rounds with
    # different global models so that the two anchors (m_prev, w_global) differ in round 2.
    hp = dict(E=E, D=10, K=2, lam=0.7, lr=0.1)
    algo = _algo(
        "pfml", aux_spec, local_iterations=E, batch_size=10, k_steps=2, lam=0.7, lr=0.1,
        aux_init=aux_init,
    )  # fmt: skip
    g1, g2 = _wire(MLR, 1), _wire(MLR, 2)
    gen = torch.Generator().manual_seed(SEED)

    # Execute
    r1 = algo.fit(1, 2, {"global": g1})
    r2 = algo.fit(2, 2, {"global": g2})

    # Assert
    aux = _initial_aux(aux_spec, g1)
    for r, glob, result in ((1, g1, r1), (2, g2, r2)):
        if r == 2 and aux_init == "global":
            aux = _params_of(g2.weights)  # the literal Algorithm 1: m_i re-initialised each round
        w, aux, loss = _pfml_reference(_params_of(glob.weights), aux, gen, **hp)
        out = result.models["local"]
        assert out.spec == MLR and result.n_samples == N  # w_i goes to the server
        _assert_weights(out.weights, w)
        assert result.metrics["train_loss"] == pytest.approx(loss, rel=1e-4)
    spec, model = algo.personalized_model()  # the personalized model is the auxiliary m_i
    assert spec == aux_spec
    _assert_weights(model, aux)
    scores = algo.evaluate({"global": g2})
    assert scores["personal_correct"] == accuracy(aux)
    assert scores["global_correct"] == accuracy(_params_of(g2.weights))


@pytest.mark.parametrize("aux_spec", [MLR, MLP])
def test_pfml_client_never_trained_deploys_the_auxiliary_its_first_round_would_start_from(
    aux_spec,
):
    algo = _algo("pfml", aux_spec, local_iterations=1, batch_size=10, lam=1.0)
    final = _wire(MLR, 4)
    with pytest.raises(RuntimeError, match=r"^pfml: no auxiliary model before the first round$"):
        algo.personalized_model()

    scores = algo.evaluate({"global": final})
    result = algo.finalize(3, 3, {"global": final})

    initial = _initial_aux(aux_spec, final)
    assert scores["personal_correct"] == accuracy(initial)
    assert scores["global_correct"] == accuracy(_params_of(final.weights))
    assert result.metrics == algo.evaluate({"global": final})
    _assert_weights(algo.personalized_model()[1], initial)


def test_pfml_finalize_keeps_the_trained_auxiliary():
    algo = _algo("pfml", MLR, local_iterations=2, batch_size=10, lam=1.0)
    algo.fit(1, 2, {"global": _wire(MLR, 1)})
    trained = _params_of(algo.aux.state_dict())
    algo.finalize(2, 2, {"global": _wire(MLR, 2)})
    _assert_weights(algo.personalized_model()[1], trained)
