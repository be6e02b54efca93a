"""FedeRiCo's client half, pinned against the formulas of algorithms.md written out here.

Three clients talk over an in-memory broker's peer topics, as they do in a federation. Each
test drives the real algorithm's steps (exchange, then update) and compares with an independent
computation: the whole-set summed cross-entropy, the moving-average loss table, the softmax
E-step and the M-step θ_j ← θ_j − η·Σ_i w_ij·∇L_i(θ_j) with plain SGD.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tests_helpers import raises_exactly

from edge_sdk.algorithms import AlgorithmError, ClientContext, TaskInfo, algorithm_class
from edge_sdk.algorithms.federico import posterior_weights
from edge_sdk.budget import DeployBudget
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.export import export_onnx
from edge_sdk.peers import PeerChannel
from edge_sdk.state import load_state, save_state
from edge_sdk.trainer import Trainer
from edge_sdk.transport.memory import InMemoryBroker
from model_zoo import ArchSpec, build

SHAPE, CLASSES, N = (1, 4, 4), 4, 60
SPEC = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=SHAPE)
IDS = ["a", "b", "c"]
GROUPS = {"a": "y", "b": "y", "c": "n"}  # a and b agree on the labels; c disagrees
TOL = {"atol": 1e-5, "rtol": 1e-4}


def _data(group: str, seed: int) -> ClientData:
    """Two classes, each a noisy mean image; group "y" labels them 0 and 1, group "n" labels
    the same images the other way round, so the groups' models contradict each other."""
    g = torch.Generator().manual_seed(seed)
    k = torch.arange(N) % 2
    means = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(99))
    x = means[k] + 0.5 * torch.randn(N, *SHAPE, generator=g)
    y = k if group == "y" else 1 - k
    return ClientData(x, y, x[:0], y[:0], x[:8], y[:8], num_classes=CLASSES)


def _federation(
    groups: dict[str, str],
    specs: dict[str, ArchSpec] | None = None,
    budget: DeployBudget | None = None,
    **cfg,
):
    """One FedeRiCo client per id, each with its own peer channel on one broker; the devices
    deploy what the paper's do, their mixture, unless `budget` says otherwise."""
    broker = InMemoryBroker()
    cls = algorithm_class("federico")
    algos = {}
    for i, cid in enumerate(IDS):
        peers = PeerChannel(broker.connect(f"peer-{cid}"), "run", cid).open()
        cpu = torch.device("cpu")
        spec = (specs or {}).get(cid, SPEC)
        ctx = ClientContext(
            cid,
            spec,
            _data(groups[cid], i),
            cpu,
            i,
            Trainer(cpu, seed=i),
            peers=peers,
            budget=budget or DeployBudget(allow=("any",)),
        )
        algos[cid] = cls(ctx, cls.config_cls(**cfg))
    return algos


def _step(algos, round_: int, step: str, params: dict[str, dict], limit_s: float = 60.0):
    """Every client runs `step` at once, as a round's barrier-separated step does: first every
    client's `before_fit` (as a runtime calls it), then the fits together (within `limit_s`: a
    wait that outlasts it fails the test instead of hanging it)."""
    out, errors = {}, []
    for cid in params:
        algos[cid].ctx.task = TaskInfo(step, params[cid])
        algos[cid].before_fit(round_, 9)

    def work(cid: str) -> None:
        try:
            out[cid] = algos[cid].fit(round_, 9, {})
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in params]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
    assert not any(t.is_alive() for t in threads), f"{step} still waiting after {limit_s} s"
    assert not errors, errors
    return out


def _senders(exchanged) -> dict[str, list[str]]:
    """Whom each client waits for in the update: the clients whose exchange reply sent it one."""
    return {
        c: [s for s in IDS if c in str(exchanged[s].details["sent_to"]).split(",")] for c in IDS
    }


def _round(algos, round_: int):
    ex = _step(algos, round_, "exchange", {c: {"members": IDS} for c in IDS})
    senders = _senders(ex)
    return _step(algos, round_, "update", {c: {"from": senders[c]} for c in IDS})


# -- the reference -----------------------------------------------------------------------------
def _params(algo) -> list[torch.Tensor]:
    """A client's weights now, in its state_dict's order (the reference's p)."""
    return [t.detach().clone() for t in algo.model.state_dict().values()]


def _nll_sum(p: list[torch.Tensor], d: ClientData, reduction: str = "sum") -> torch.Tensor:
    z = d.x_train.flatten(1) @ p[0].T + p[1]
    nll = -(z.log_softmax(1)[torch.arange(len(d.y_train)), d.y_train]).sum()
    return nll if reduction == "sum" else nll / len(d.y_train)


def _grad(p: list[torch.Tensor], d: ClientData, reduction: str = "sum") -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in p]
    return list(torch.autograd.grad(_nll_sum(leaves, d, reduction), leaves))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_federico_rounds_follow_the_loss_table_e_step_and_m_step(reduction):
    # Prepare: three clients that each sample both others (M = 2), full-set gradients (the
    # batch holds the whole set), plain SGD; L_i the whole set's summed or mean NLL.
    lr, m, tau = 0.01, 0.6, 5.0
    algos = _federation(
        GROUPS,
        neighbours=2,
        optimizer="sgd",
        lr=lr,
        loss_momentum=m,
        temperature=tau,
        batch_size=N,
        loss_reduction=reduction,
    )
    data = {c: algos[c].ctx.data for c in IDS}
    theta = {c: _params(algos[c]) for c in IDS}
    table: dict[str, dict[str, float]] = {c: {} for c in IDS}
    for round_ in (1, 2):
        # Execute
        replies = _round(algos, round_)
        # The reference round: every client observes every model, then each model takes the
        # gradients of every client, weighted by how much that client uses it.
        for i in IDS:
            for j in IDS:
                loss = float(_nll_sum(theta[j], data[i], reduction))
                old = table[i].get(j)
                table[i][j] = loss if old is None else (1 - m) * old + m * loss
        w = {
            i: dict(
                zip(
                    IDS,
                    torch.softmax(-torch.tensor([table[i][j] for j in IDS]) / tau, 0),
                    strict=True,
                )
            )
            for i in IDS
        }
        new = {}
        for j in IDS:
            total = [torch.zeros_like(t) for t in theta[j]]
            for i in IDS:
                g = _grad(theta[j], data[i], reduction)
                total = [t + float(w[i][j]) * gi for t, gi in zip(total, g, strict=True)]
            new[j] = [t - lr * g for t, g in zip(theta[j], total, strict=True)]
        theta = new
        # Assert: the weights each client reports and the models it ends the round with
        for i in IDS:
            for j in IDS:
                assert abs(replies[i].details[f"w:{j}"] - float(w[i][j])) < 1e-5
            for got, want in zip(algos[i].model.state_dict().values(), theta[i], strict=True):
                assert torch.allclose(got, want, **TOL), (got - want).abs().max()


def test_federico_weights_favour_the_models_of_clients_with_the_same_labels():
    # Prepare: a and b label the images alike; c the other way round.
    algos = _federation(GROUPS, neighbours=2, lr=0.05)
    # Execute
    for round_ in range(1, 6):
        _round(algos, round_)
    # Assert: every client puts its weight on models of its own group (the paper's Figure 3
    # blocks: which of the group's models they share is the latent variable's free label), so
    # a and b weigh the same models, and c others.
    w = {c: algos[c].weights for c in IDS}
    for i in IDS:
        same = sum(v for j, v in w[i].items() if GROUPS[j] == GROUPS[i])
        assert same > 0.99, (i, w[i])

    def overlap(i: str, k: str) -> float:
        return sum(min(w[i][j], w[k][j]) for j in IDS)

    assert overlap("a", "b") > 0.9 > 0.1 > overlap("a", "c") + overlap("b", "c"), w


def test_federico_mixture_export_equals_the_weighted_mixture_of_its_collaborators(tmp_path):
    # Prepare: trained clients; a's predictor mixes its top models with its weights.
    algos = _federation(GROUPS, neighbours=2, lr=0.05)
    for round_ in (1, 2, 3):
        _round(algos, round_)
    a = algos["a"]
    spec, mixture = a.personalized_model()
    x = a.ctx.data.x_test
    # The mixture written out: Σ_j w_j·softmax(f_j(x)) over the members, weights normalised.
    w = a.weights
    top = sorted(w, key=lambda c: -w[c])[: a.config.mixture_top]
    # Its own model as it is now; the peers' as it last fetched them (its cache).
    held = {c: a.peer_models[c] for c in a.peer_models} | {"a": WireModel.of(SPEC, a.model)}
    probs = torch.zeros(len(x), CLASSES)
    total = sum(w[c] for c in top)
    for c in top:
        member = build(SPEC)
        member.load_state_dict(held[c].weights)
        probs += w[c] / total * member(x).softmax(1)
    # Execute: export to ONNX (verified against PyTorch by the exporter) and run onnxruntime.
    path = export_onnx(mixture, spec, tmp_path / "a.onnx", sample_inputs=x)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"input": x.numpy()})
    # Assert: its softmax is the mixture's probabilities; the members are a's collaborators.
    assert spec.family == "mixture" and len(spec.kwargs["members"]) == len(top)
    got = torch.from_numpy(out).softmax(1)
    assert torch.allclose(got, probs.detach(), atol=1e-5), (got - probs).abs().max()
    np.testing.assert_allclose(mixture(x).detach().exp().numpy(), probs.detach().numpy(), atol=1e-5)


def _after_one_round(monkeypatch):
    """A federation after a round in which a fetched both others, a, and the families of the
    networks a builds from here on."""
    algos = _federation(GROUPS, neighbours=2, lr=0.05, guard=False)
    _round(algos, 1)
    a = algos["a"]
    built: list[str] = []
    materialize = a.ctx.materialize
    monkeypatch.setattr(
        a.ctx, "materialize", lambda wire: built.append(wire.spec.family) or materialize(wire)
    )
    return algos, a, built


def test_federico_builds_a_network_per_peer_once_and_reloads_it_with_newer_models(monkeypatch):
    # Prepare: a round in which a fetched both others; what it builds from here on, counted.
    algos, a, built = _after_one_round(monkeypatch)
    x = a.ctx.data.x_test
    top = sorted(a.weights, key=lambda c: -a.weights[c])[: a.config.mixture_top]
    assert set(top) == {"a", "b", "c"}  # both neighbours are in its predictor

    # Execute: the round's predictor; as after a restart, without the networks; then a second
    # round, whose neighbours sent newer models
    _, mixture = a.trained_model()
    reused = mixture(x).detach()
    a._nets = {}
    _, rebuilt = a.trained_model()
    again, hand, after_restart = rebuilt(x).detach(), _hand_mixture(a, top, x), list(built)
    round_1 = {c: dict(a.peer_models[c].weights) for c in ("b", "c")}
    _round(algos, 2)
    _, second = a.trained_model()

    # Assert: no network built for the round's neighbours (two after a restart, none in the
    # next round), the same predictions either way, and those of the mixture computed by hand
    # from the models last fetched; in round 2 each network holds its peer's newer model
    assert after_restart == ["mlr", "mlr"] and built == after_restart
    assert torch.equal(again, reused)
    assert torch.allclose(reused.exp(), hand, atol=1e-6)
    top = sorted(a.weights, key=lambda c: -a.weights[c])[: a.config.mixture_top]
    for c in ("b", "c"):
        net = dict(second.named_modules())[f"members.{top.index(c)}"]
        fetched = a.peer_models[c].weights
        assert not torch.equal(fetched["linear.weight"], round_1[c]["linear.weight"])
        for k, v in net.state_dict().items():
            assert torch.equal(v, fetched[k]), (c, k)


def test_federico_keeps_the_network_of_a_mixture_member_it_did_not_fetch_this_round(monkeypatch):
    # Prepare: a round in which a fetched both others, then one in which its strategy offers it
    # b only (c stays in its predictor, as last fetched); what a builds from then on, counted
    algos, a, built = _after_one_round(monkeypatch)
    members = {c: {"members": IDS} for c in IDS} | {"a": {"members": ["a", "b"]}}

    # Execute
    ex = _step(algos, 2, "exchange", members)
    _step(algos, 2, "update", {c: {"from": s} for c, s in _senders(ex).items()})
    _, mixture = a.trained_model()

    # Assert: c, not fetched, is still a member; no network was built for it or for b
    assert ex["a"].details["sent_to"] == "b"
    assert len(mixture.members) == 3 and built == []


def test_federico_state_survives_a_restart(tmp_path):
    # Prepare: two rounds trained, the state of a written to disk.
    algos = _federation(GROUPS, neighbours=2, lr=0.05)
    for round_ in (1, 2):
        _round(algos, round_)
    a = algos["a"]
    save_state(tmp_path / "a.state", a.state_dict())
    # Execute: a new instance of the same client (as after a restart) loads it.
    cls = algorithm_class("federico")
    fresh = cls(a.ctx, a.config)
    fresh.load_state_dict(load_state(tmp_path / "a.state"))
    # Assert: the loss table, the weights, the peers' models it holds, its Adam moments, and
    # so its predictions.
    assert fresh.losses == a.losses and fresh.published == a.published == 3
    assert fresh.peer_models.keys() == a.peer_models.keys() == {"b", "c"}
    x = a.ctx.data.x_test
    assert torch.equal(fresh.personalized_model()[1](x), a.personalized_model()[1](x))
    sa, sb = a.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)


# -- the E-step's weights and the choice of neighbours -------------------------------------------
MEMBERS = ["a", "b", "c", "d", "e"]  # d and e: members this client has never heard from


def test_posterior_weights_are_a_double_precision_softmax_of_minus_loss_over_tau():
    # Summed NLLs differ by hundreds: a far worse model keeps a tiny weight (float32 would
    # round it to 0 and the others to 7 digits).
    losses, tau = {"b": 3.0, "a": 0.0, "c": 200.0}, 2.0
    e = {k: math.exp(-v / tau) for k, v in losses.items()}
    got = posterior_weights(losses, tau)
    assert list(got) == ["a", "b", "c"]
    for k, v in e.items():
        assert got[k] == pytest.approx(v / sum(e.values()), rel=1e-12), k


def test_federico_exploits_the_highest_weights_then_unseen_clients():
    a = _federation(GROUPS, epsilon=0.0, neighbours=2)["a"]
    a.losses = {"a": 1.0, "b": 9.0, "c": 2.0, "d": 5.0}  # e unseen
    assert a._sample(MEMBERS) == ["c", "d"]  # the two highest weights, not the first ids
    a.losses = {"a": 1.0, "c": 2.0}  # then c, and one of b, d, e at random
    picks = [a._sample(MEMBERS) for _ in range(30)]
    assert all(len(p) == 2 and "c" in p for p in picks)
    assert {x for p in picks for x in p} == {"b", "c", "d", "e"}


@pytest.mark.parametrize("epsilon", [0.0, 0.5, 1.0])
def test_federico_neighbour_draws_come_from_the_clients_own_generator(epsilon):
    def draws(global_seed: int) -> list[list[str]]:
        torch.manual_seed(global_seed)  # torch's global generator must not matter
        a = _federation(GROUPS, epsilon=epsilon, neighbours=2)["a"]
        a.losses = {"a": 1.0, "b": 2.0}  # exploit: b and one of c, d, e; explore: any two
        return [a._sample(MEMBERS) for _ in range(20)]

    assert draws(1) == draws(2)


def test_federico_explores_only_on_a_draw_below_epsilon():
    # A draw u explores exactly when u < ε (probability ε). With ε set to the very draw that
    # comes next, the client exploits: its single neighbour is the highest weight, b.
    for seed in range(5):
        a = _federation(GROUPS, neighbours=1)["a"]
        a.losses = {"a": 1.0, "b": 2.0, "c": 9.0, "d": 9.0, "e": 9.0}
        g = a.ctx.trainer.generator
        g.manual_seed(seed)
        probe = torch.Generator()
        probe.set_state(g.get_state())
        a.config = a.config.model_copy(update={"epsilon": float(torch.rand((), generator=probe))})
        assert a._sample(MEMBERS) == ["b"], seed


# -- the steps' replies and waits ----------------------------------------------------------------
def test_federico_replies_report_losses_neighbours_gradients_and_rounded_weights():
    # Prepare: a short wait, so a peer that never published would show as a missing neighbour.
    algos = _federation(GROUPS, neighbours=2, batch_size=N, peer_timeout_s=2.0)
    data = {c: algos[c].ctx.data for c in IDS}
    theta = {c: _params(algos[c]) for c in IDS}

    # Execute / Assert: round 1's exchange fetches both peers' initial models...
    ex = _step(algos, 1, "exchange", {c: {"members": IDS} for c in IDS})
    for c in IDS:
        own = float(_nll_sum(theta[c], data[c]))
        assert ex[c].metrics == {"loss_self": pytest.approx(own, rel=1e-5), "neighbours": 2.0}
        assert ex[c].n_samples == N
        assert ex[c].details == {"sent_to": ",".join(o for o in IDS if o != c)}
    # ...and the update counts the gradients and reports the weights to 6 decimals.
    up = _step(algos, 1, "update", {c: {"from": [o for o in IDS if o != c]} for c in IDS})
    for c in IDS:
        assert up[c].metrics == {"gradients_received": 2.0}
        assert up[c].n_samples == N
        assert set(up[c].details) == {f"w:{o}" for o in IDS}
        w = algos[c].weights
        for o in IDS:
            assert up[c].details[f"w:{o}"] == round(w[o], 6)


def test_federico_publishes_each_version_of_its_model_once(monkeypatch):
    algos = _federation(GROUPS, neighbours=2)
    versions: dict[str, list[int]] = {c: [] for c in IDS}
    for c in IDS:
        peers = algos[c].ctx.peers

        def publish(name, model, version, c=c, original=peers.publish):
            versions[c].append(version)
            original(name, model, version)

        monkeypatch.setattr(peers, "publish", publish)
    for round_ in (1, 2):
        _round(algos, round_)
    assert versions == {c: [1, 2, 3] for c in IDS}  # round r's update publishes version r + 1


def test_federico_skips_a_peer_whose_model_is_not_current_and_fetches_the_others():
    # Prepare: round 1 complete except that b never ran its update, so b's publication is still
    # version 1 when round 2's exchange wants version 2.
    algos = _federation(GROUPS, neighbours=2, peer_timeout_s=0.5)
    ex = _step(algos, 1, "exchange", {c: {"members": IDS} for c in IDS})
    senders = _senders(ex)
    _step(algos, 1, "update", {c: {"from": senders[c]} for c in ("a", "c")})

    # Execute: a's exchange waits peer_timeout_s for b, not longer.
    out = _step(algos, 2, "exchange", {"a": {"members": IDS}}, limit_s=10)["a"]

    # Assert: b's stale model is not used; c's current one is.
    assert out.metrics["neighbours"] == 1.0 and out.details == {"sent_to": "c"}
    assert algos["a"].peer_models["b"] is not None and set(algos["a"].peer_models) == {"b", "c"}


def test_federico_update_waits_for_a_missing_gradient_only_peer_timeout_s():
    algos = _federation(GROUPS, peer_timeout_s=0.5)
    out = _step(algos, 1, "update", {"a": {"from": ["b"]}}, limit_s=10)["a"]
    assert out.metrics == {"gradients_received": 0.0}


def test_federico_refuses_a_peer_model_of_other_classes():
    other = ArchSpec(family="mlr", num_classes=CLASSES + 1, input_shape=SHAPE)
    algos = _federation(GROUPS, specs={"b": other}, neighbours=1)
    b, a = algos["b"], algos["a"]
    b.ctx.task = TaskInfo("exchange", {"members": ["b"]})
    b.before_fit(1, 9)  # b publishes its model
    a.ctx.task = TaskInfo("exchange", {"members": ["a", "b"]})
    with pytest.raises(
        AlgorithmError, match=r"^federico: b's model predicts other classes than ours$"
    ):
        a.fit(1, 9, {})


def test_federico_refuses_a_gradient_that_does_not_fit_its_model():
    algos = _federation(GROUPS)
    weight_only = {"linear.weight": torch.zeros(CLASSES, 16)}
    algos["b"].ctx.peers.send("a", "grad", 1, WireModel(SPEC, weight_only))
    a = algos["a"]
    a.ctx.task = TaskInfo("update", {"from": ["b"]})
    with pytest.raises(AlgorithmError, match=r"^federico: b's gradient does not fit our model$"):
        a.fit(1, 9, {})


def test_federico_steps_without_parameters_and_an_unknown_step():
    a = _federation(GROUPS)["a"]
    a.ctx.task = TaskInfo("exchange", {})  # no members: nobody to fetch
    assert a.fit(1, 9, {}).metrics["neighbours"] == 0.0
    a.ctx.task = TaskInfo("update", {})  # no senders: its own gradient only
    assert a.fit(1, 9, {}).metrics == {"gradients_received": 0.0}
    a.ctx.task = TaskInfo("merge", {})
    msg = "federico has no step 'merge' (exchange, then update)"
    with raises_exactly(AlgorithmError, msg):
        a.fit(1, 9, {})


# -- the M-step's optimizer ----------------------------------------------------------------------
def test_federico_update_before_any_exchange_is_a_full_sgd_step_on_its_own_loss():
    # No loss table yet: its own gradient counts with weight 1.
    a = _federation(GROUPS, optimizer="sgd", lr=0.01, batch_size=N)["a"]
    before = _params(a)
    a.ctx.task = TaskInfo("update", {"from": []})
    out = a.fit(1, 9, {})
    want = [p - 0.01 * g for p, g in zip(before, _grad(before, a.ctx.data), strict=True)]
    for got, w in zip(_params(a), want, strict=True):
        assert torch.allclose(got, w, **TOL)
    assert out.details == {} and a.published == 2


def test_federico_adam_first_update_moves_each_weight_by_lr_against_its_gradient():
    # Adam's bias-corrected first step: lr·g / (|g| + 1e-8).
    a = _federation(GROUPS, optimizer="adam", lr=0.01, batch_size=N)["a"]
    before = _params(a)
    a.ctx.task = TaskInfo("update", {"from": []})
    a.fit(1, 9, {})
    grads = _grad(before, a.ctx.data)
    for got, p, g in zip(_params(a), before, grads, strict=True):
        assert torch.allclose(got, p - 0.01 * g / (g.abs() + 1e-8), atol=1e-6)


def test_federico_sets_each_gradient_in_its_parameters_layout():
    # A CNN's convolution weights are channels_last on the client (Trainer.prepare).
    cnn = ArchSpec(family="cnn1", num_classes=CLASSES, input_shape=SHAPE, kwargs={"hidden": 8})
    a = _federation(GROUPS, specs={c: cnn for c in IDS}, optimizer="sgd", lr=0.01)["a"]
    assert any(p.dim() == 4 and not p.is_contiguous() for p in a.model.parameters())
    a.ctx.task = TaskInfo("update", {"from": []})
    a.fit(1, 9, {})
    for k, p in a.model.named_parameters():
        assert p.grad is not None and p.grad.stride() == p.stride(), k


# -- the predictor -------------------------------------------------------------------------------
def _hand_mixture(algo, top: list[str], x: torch.Tensor) -> torch.Tensor:
    """Σ_j w_j·softmax(f_j(x)) over `top`, weights normalised; its own model as it is now."""
    w = algo.weights
    held = dict(algo.peer_models) | {algo.ctx.client_id: WireModel.of(SPEC, algo.model)}
    total = sum(w[c] for c in top)
    return sum(w[c] / total * held[c].build()(x).softmax(1) for c in top).detach()


def test_federico_predictor_before_any_exchange_is_its_own_model_alone():
    a = _federation(GROUPS)["a"]
    spec, mixture = a.personalized_model()
    assert spec.kwargs["weights"] == [1.0] and len(spec.kwargs["members"]) == 1
    x = a.ctx.data.x_test
    assert torch.allclose(mixture(x).exp(), a.model(x).softmax(1), atol=1e-6)


def test_federico_mixes_evaluates_and_finalizes_its_highest_weight_models_only():
    # Prepare: two rounds; c's two highest weights are not its first two ids (a guard on the
    # case, so that taking the first ids or the lowest weights would show).
    algos = _federation(GROUPS, neighbours=2, lr=0.05, mixture_top=2, guard=False)
    for round_ in (1, 2):
        _round(algos, round_)
    c = algos["c"]
    w = c.weights
    top = sorted(w, key=lambda k: -w[k])[:2]
    assert set(top) != {"a", "b"} and min(w, key=lambda k: w[k]) not in top
    x, y = c.ctx.data.x_test, c.ctx.data.y_test
    probs = _hand_mixture(c, top, x)

    # Execute
    spec, mixture = c.personalized_model()
    scores = c.evaluate({})
    out = c.finalize(2, 2, {})

    # Assert: the mixture of those two; its scores; the collaborators by weight.
    assert len(spec.kwargs["members"]) == 2
    assert torch.allclose(mixture(x).exp(), probs, atol=1e-5)
    want = {
        "personal_correct": int((probs.argmax(1) == y).sum()),
        "personal_total": len(y),
        "personal_loss": pytest.approx(
            float(-probs[torch.arange(len(y)), y].log().mean()), rel=1e-4
        ),
    }
    assert scores == want and out.metrics == want
    # Each round drew one batch per neighbour (their gradients) and one for its own.
    drawn = 2 * (2 + 1) * min(c.config.batch_size, N)
    assert {k: out.details[k] for k in ("collaborators", "mixture_size", "samples_processed")} == {
        "collaborators": ",".join(top),
        "mixture_size": 2,
        "samples_processed": drawn,
    }
    assert out.details["deployed"] == "personal (final, mixture)"
    assert out.details["deployed_arch"] == "mixture of mlr+mlr"
    assert out.n_samples == N


@pytest.mark.parametrize("kind", ["scaled", "huge"])
def test_a_peers_absurd_model_gets_no_weight_and_its_gradients_are_bounded(kind, caplog):
    # Prepare: three clients of one label group; c publishes an absurd model (its weights
    # x1000, or 3e38 everywhere) and sends x1000 gradients to whoever it samples.
    algos = _federation({c: "y" for c in IDS}, neighbours=2, lr=0.05, optimizer="sgd")
    c = algos["c"]
    publish, send = c.peers.publish, c.peers.send

    def absurd(model):
        fill = (lambda t: t * 1000) if kind == "scaled" else (lambda t: torch.full_like(t, 3e38))
        return WireModel(model.spec, {k: fill(t) for k, t in model.weights.items()})

    c.peers.publish = lambda name, model, version: publish(name, absurd(model), version)
    c.peers.send = lambda to, name, r, grad: send(to, name, r, WireModel(
        grad.spec, {k: 1000 * t for k, t in grad.weights.items()}))  # fmt: skip
    for i, other in (("a", "b"), ("b", "a")):  # each fetches c's model first, then the other's
        algos[i]._sample = lambda members, other=other: ["c", other]
    # Execute
    sent_to = []
    for round_ in (1, 2, 3):
        ex = _step(algos, round_, "exchange", {c: {"members": IDS} for c in IDS})
        sent_to.append({i: ex[i].details["sent_to"] for i in ("a", "b")})
        senders = _senders(ex)
        replies = _step(algos, round_, "update", {c: {"from": senders[c]} for c in IDS})
    # Assert: c's model has no weight with a and b, is not held, gets no gradient from them,
    # and a and b go on to the peer after it every round; c's gradients were bounded, and a
    # and b still predict their labels.
    assert sent_to == [{"a": "b", "b": "a"}] * 3
    for i in ("a", "b"):
        algo = algos[i]
        assert algo.losses["c"] == math.inf and algo.weights["c"] == 0.0
        assert "c" not in algo.peer_models and "c" not in algo._top(algo.weights)
        assert replies[i].details["w:c"] == 0.0
        d = algo.ctx.data
        assert (
            algo.ctx.trainer.evaluate(algo.personalized_model()[1], d.x_test, d.y_test).accuracy
            == 1.0
        )
    said = {r.getMessage() for r in caplog.records}
    assert {f"{i}: c's model is absurd on our data: no weight" for i in ("a", "b")} <= said
    assert "'s gradient (norm" in caplog.text


def test_under_a_budget_federico_offers_and_tunes_the_model_of_its_architecture_it_weighs_most():
    # Prepare: a and b hold the MLR, c another architecture. After a round, a's loss table is
    # set by hand: c's model fits a's data best, then b's, then a's own.
    other = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=SHAPE, kwargs={"hidden": [4]})
    algos = _federation(GROUPS, specs={"c": other}, budget=DeployBudget(), neighbours=2)
    _round(algos, 1)
    a = algos["a"]
    assert set(a.peer_models) == {"b", "c"}
    a.losses = {"a": 30.0, "b": 20.0, "c": 10.0}

    # Execute
    candidates = a.guard_candidates()
    spec, base = a.finetune_base({})

    # Assert: b's model (c's is of another architecture), offered before a's own, and the
    # fine-tuning starts from a copy of it
    assert list(candidates) == ["personal", "peer", "own"]
    b_weights = a.peer_models["b"].weights
    for k, v in candidates["peer"][1].state_dict().items():
        assert torch.equal(v, b_weights[k]), k
    assert spec == SPEC
    for k, v in base.state_dict().items():
        assert torch.equal(v, b_weights[k]), k
        assert v.data_ptr() != candidates["peer"][1].state_dict()[k].data_ptr()

    # ... and where its own model weighs most, no peer is offered and its own is the base
    a.losses = {"a": 5.0, "b": 20.0, "c": 10.0}
    assert list(a.guard_candidates()) == ["personal", "own"]
    _, base = a.finetune_base({})
    for k, v in base.state_dict().items():
        assert torch.equal(v, a.model.state_dict()[k]), k


def test_federico_offers_the_highest_weight_peer_of_its_architecture_not_the_last_id():
    # Prepare: every client of one architecture; a weighs b's model above c's (ids in the
    # other order), and the same as its own in the last case
    algos = _federation(GROUPS, budget=DeployBudget(), neighbours=2)
    _round(algos, 1)
    a = algos["a"]
    a.losses = {"a": 30.0, "b": 10.0, "c": 20.0}

    # Execute, assert: b's model
    peer = a.guard_candidates()["peer"][1]
    for k, v in peer.state_dict().items():
        assert torch.equal(v, a.peer_models["b"].weights[k]), k
    # ... none where its own model weighs as much as the best peer's (its own is preferred)
    a.losses = {"a": 10.0, "b": 10.0, "c": 20.0}
    assert "peer" not in a.guard_candidates()


# -- bounds on peers: absurd models, clipped gradients -------------------------------------------
def _lone(data: ClientData, **cfg):
    """One FedeRiCo client on `data` (an mlr of its classes), its peer channel on a broker of
    its own: what it receives is put in by the test."""
    spec = ArchSpec(family="mlr", num_classes=data.num_classes, input_shape=SHAPE)
    peers = PeerChannel(InMemoryBroker().connect("peer-a"), "run", "a").open()
    cpu = torch.device("cpu")
    ctx = ClientContext("a", spec, data, cpu, 0, Trainer(cpu, seed=0), peers=peers)
    cls = algorithm_class("federico")
    return cls(ctx, cls.config_cls(**cfg))


def _two_class_data(val_flipped: bool) -> ClientData:
    """Two classes (log 2 nats at chance); the validation split the training one's first 16
    samples, their labels flipped or not."""
    d = _data("y", 0)
    y_val = 1 - d.y_train[:16] if val_flipped else d.y_train[:16]
    return ClientData(
        d.x_train, d.y_train, d.x_train[:16], y_val, d.x_test, d.y_test, num_classes=2
    )


def test_a_peer_model_is_absurd_above_absurd_nats_times_log_classes_on_validation_data():
    # Prepare: a model that fits the training labels; on 2 classes a chance model scores
    # log 2 nats, so the bound is absurd_nats × log 2.
    fit = _lone(_two_class_data(False), optimizer="sgd", lr=0.002, batch_size=N)
    for r in range(3):
        fit.ctx.task = TaskInfo("update", {"from": []})
        fit.fit(r + 1, 99, {})
    model = fit.model
    on = {
        flipped: fit.ctx.trainer.evaluate(
            model, *(lambda d: (d.x_val, d.y_val))(_two_class_data(flipped))
        ).loss
        for flipped in (False, True)
    }
    assert on[False] < math.log(2) < on[True]
    fits = on[False] / math.log(2)  # its validation loss in units of log 2: below 1

    def absurd(nats: float, flipped: bool = False) -> bool:
        return _lone(_two_class_data(flipped), absurd_nats=nats)._absurd(model)

    # Execute, assert: just below the bound and just above it. The bound is absurd_nats
    # (here below 1) times log 2 (2 classes, not 3), multiplied, not divided.
    assert absurd(0.95 * fits) and not absurd(1.05 * fits)
    # The validation split decides where a client has one: the flipped labels are far above
    # twice the bound, the training labels (which the model fits) below it.
    assert absurd(2 * fits, flipped=True) and not absurd(2 * fits)
    # absurd_nats = 0 turns the bound off: only a loss that is not finite is absurd
    assert not absurd(0.0, flipped=True)


def _update_with(a, peer: list[torch.Tensor]) -> list[torch.Tensor]:
    """`a`'s update step (no weights yet: its own gradient at weight 1) with `peer` received
    from b; its parameters after it."""
    names = [k for k, _ in a.model.named_parameters()]
    sent = WireModel(a.ctx.spec, dict(zip(names, peer, strict=True)))
    a.peers.receive = lambda *args, **kw: {"b": sent}
    a.ctx.task = TaskInfo("update", {"from": ["b"]})
    a.fit(1, 9, {})
    return _params(a)


def _norm(ts: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))


@pytest.mark.parametrize(
    ("clip", "times", "clipped"),
    [(0.5, 100.0, True), (10.0, 0.1, False), (0.0, 100.0, False)],
    ids=["above the bound", "below it", "peer_clip 0: off"],
)
def test_a_peers_gradient_above_peer_clip_times_the_rounds_lower_median_norm_is_scaled_to_it(
    clip, times, clipped, caplog
):
    # Prepare: a's own gradient g on its whole set, and b's: `times` × a fixed draw of g's
    # shapes. With two norms the lower median is the smaller one.
    a = _lone(_data("y", 0), optimizer="sgd", lr=0.01, batch_size=N, peer_clip=clip)
    before = _params(a)
    own = _grad(before, a.ctx.data)
    g = torch.Generator().manual_seed(5)
    peer = [times * _norm(own) * torch.randn(t.shape, generator=g) for t in own]
    bound = clip * min(_norm(own), _norm(peer))
    scale = bound / _norm(peer) if clipped else 1.0
    # Execute
    with caplog.at_level("WARNING", logger="edge_sdk.algorithms.federico"):
        after = _update_with(a, peer)
    # Assert: one SGD step on g + scale · b's gradient; the warning names both, in numbers
    want = [p - 0.01 * (o + scale * q) for p, o, q in zip(before, own, peer, strict=True)]
    for got, w in zip(after, want, strict=True):
        assert torch.allclose(got, w, **TOL), (got - w).abs().max()
    said = [r.getMessage() for r in caplog.records]
    assert said == ([f"a: b's gradient (norm {_norm(peer):.3g}) clipped to {bound:.3g}"] * clipped)


def test_the_typical_norm_counts_a_client_of_weight_zero_as_norm_zero():
    # Its own gradient was scaled by its weight: unscaled, it is unknown at weight 0.
    fed = algorithm_class("federico")
    total = {"w": torch.full((2,), 3.0)}  # norm 4.24..., at weight 0.5 unscaled: 8.49
    small, large = (WireModel(SPEC, {"w": torch.full((2,), v)}) for v in (0.25, 4.0))
    assert fed._typical(total, 0.0, {"b": small, "c": large}) == pytest.approx(0.25 * 2**0.5)
    assert fed._typical(total, 0.0, {"b": large}) == 0.0
    assert fed._typical(total, 0.5, {"b": small, "c": large}) == pytest.approx(4.0 * 2**0.5)
