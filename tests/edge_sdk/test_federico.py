"""FedeRiCo's client half, pinned against the formulas of algorithms.md written out here.

Three clients talk over an in-memory broker's peer topics, as they do in a federation. Each
test drives the real algorithm's steps (exchange, then update) and compares with an independent
computation: the whole-set summed cross-entropy, the moving-average loss table, the softmax
E-step and the M-step θ_j ← θ_j − η·Σ_i w_ij·∇L_i(θ_j) with plain SGD.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import torch

from edge_sdk.algorithms import ClientContext, TaskInfo, algorithm_class
from edge_sdk.codec import WireModel
from edge_sdk.export import export_onnx
from edge_sdk.peers import PeerChannel
from edge_sdk.state import load_state, save_state
from edge_sdk.trainer import ClientData, Trainer
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


def _federation(groups: dict[str, str], **cfg):
    """One FedeRiCo client per id, each with its own peer channel on one broker."""
    broker = InMemoryBroker()
    cls = algorithm_class("federico")
    algos = {}
    for i, cid in enumerate(IDS):
        peers = PeerChannel(broker.connect(f"peer-{cid}"), "run", cid).open()
        cpu = torch.device("cpu")
        ctx = ClientContext(
            cid, SPEC, _data(groups[cid], i), cpu, i, Trainer(cpu, seed=i), peers=peers
        )
        algos[cid] = cls(ctx, cls.config_cls(**cfg))
    return algos


def _step(algos, round_: int, step: str, params: dict[str, dict]):
    """Every client runs `step` at once, as a round's barrier-separated step does."""
    out, errors = {}, []

    def work(cid: str) -> None:
        try:
            algos[cid].ctx.task = TaskInfo(step, params[cid])
            out[cid] = algos[cid].fit(round_, 9, {})
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in params]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


def _round(algos, round_: int):
    ex = _step(algos, round_, "exchange", {c: {"members": IDS} for c in IDS})
    senders = {c: [s for s in IDS if c in str(ex[s].details["sent_to"]).split(",")] for c in IDS}
    return _step(algos, round_, "update", {c: {"from": senders[c]} for c in IDS})


# -- the reference -----------------------------------------------------------------------------
def _nll_sum(p: list[torch.Tensor], d: ClientData) -> torch.Tensor:
    z = d.x_train.flatten(1) @ p[0].T + p[1]
    return -(z.log_softmax(1)[torch.arange(len(d.y_train)), d.y_train]).sum()


def _grad(p: list[torch.Tensor], d: ClientData) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in p]
    return list(torch.autograd.grad(_nll_sum(leaves, d), leaves))


def test_federico_rounds_follow_the_loss_table_e_step_and_m_step():
    # Prepare: three clients that each sample both others (M = 2), full-set gradients (the
    # batch holds the whole set), plain SGD.
    lr, m, tau = 0.01, 0.6, 5.0
    algos = _federation(
        GROUPS,
        neighbours=2,
        optimizer="sgd",
        lr=lr,
        loss_momentum=m,
        temperature=tau,
        batch_size=N,
    )
    data = {c: algos[c].ctx.data for c in IDS}
    theta = {c: [t.detach().clone() for t in algos[c].model.state_dict().values()] for c in IDS}
    table: dict[str, dict[str, float]] = {c: {} for c in IDS}
    for round_ in (1, 2):
        # Execute
        replies = _round(algos, round_)
        # The reference round: every client observes every model, then each model takes the
        # gradients of every client, weighted by how much that client uses it.
        for i in IDS:
            for j in IDS:
                loss = float(_nll_sum(theta[j], data[i]))
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
                g = _grad(theta[j], data[i])
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
