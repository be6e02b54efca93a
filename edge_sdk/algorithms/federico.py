"""federico: Find Your Friends: personalized FL with the Right Collaborators (paper 003).

Decentralized: no model or gradient passes through the coordinator, which keeps only
membership and the round clock. Client i keeps its model θ_i, a moving-average loss table
ℓ_ij over the models it has seen and weights w_ij = softmax(−ℓ_i· / τ) (the E-step's posterior
under a uniform prior). Each round has two steps with a barrier between them:

exchange  (before it, in `before_fit`, every client publishes θ_i retained on its own peer topic
          if not yet current) update ℓ_ii; sample M neighbours (ε-greedy: uniformly with
          probability ε, else the M highest w_ij); fetch each θ_j from its publication and update
          ℓ_ij ← (1−m)·ℓ_ij + m·L_i(θ_j); recompute w_i; send w_ij·∇L_i(θ_j) to each j on the
          peer topic naming both.
update    θ_i ← θ_i − η·(w_ii·∇L_i(θ_i) + Σ_j w_ji·∇L_j(θ_i)) with the gradients received (the
          M-step, eq. 8), then publish θ_i for the next round.

L_i is the negative log-likelihood of the client's whole training set: the *sum* of per-sample
losses by default (`loss_reduction`, see algorithms.md: with mean losses the weights stay near
uniform). Gradients are taken on one mini-batch, scaled to the whole set (an unbiased estimate
of ∇ of the sum). The predictor is the mixture p_i(y|x) = Σ_j w_ij·p(y|x; θ_j) over the
`mixture_top` highest-weight models the client holds (its own and the peers' it fetched), which
is what it evaluates and exports to ONNX (the zoo's `mixture` family, one graph).

No peer can wreck a client: a fetched model that is absurd on the client's validation data (a
mean cross-entropy not finite or above `absurd_nats` × log(classes), far worse than a uniform
guess) gets no weight (ℓ_ij = ∞) and is neither kept nor sent a gradient; a gradient a peer sends
is bounded at `peer_clip` × the lower median of the round's gradient norms, the client's own
(unweighted) among them (docs/security.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from edge_sdk.algorithms.base import (
    AlgorithmError,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.algorithms.candidates import PERSONAL, Candidate
from edge_sdk.algorithms.guard_config import MixingGuardConfig
from edge_sdk.codec import WireModel
from edge_sdk.losses import cross_entropy
from edge_sdk.optim import SGD, Adam
from edge_sdk.optim_config import OptimConfig
from edge_sdk.peers import Peers
from edge_sdk.robust import state_norm
from model_zoo import ArchSpec
from model_zoo.models.mixture import Mixture, mixture_spec

__all__ = ["FedeRiCo", "FedeRiCoConfig", "posterior_weights"]

MODEL, GRAD = "model", "grad"

log = logging.getLogger(__name__)


class FedeRiCoConfig(BaseAlgorithmConfig, MixingGuardConfig):
    # preset = "paper": Adam at 1e-3 on batches of 50 [paper]; M = 3 is the paper's too. ε, m,
    # τ and the mixture's size are lost from the paper's text: ours stay.
    paper: ClassVar[dict[str, Any]] = {"lr": 1e-3, "batch_size": 50}

    neighbours: int = Field(3, ge=1)  # M, neighbours sampled per round [ours, algorithms.md]
    epsilon: float = Field(0.3, ge=0, le=1)  # ε-greedy exploration [ours]
    loss_momentum: float = Field(0.6, gt=0, le=1)  # m of the moving-average loss table [ours]
    temperature: float = Field(1.0, gt=0)  # τ dividing ℓ in the E-step
    loss_reduction: Literal["sum", "mean"] = "sum"  # L_i: the whole set's NLL (sum) [ours]
    optimizer: Literal["adam", "sgd"] = "adam"  # [paper]
    # [ours] 3e-3 and batches of 16 [paper: 1e-3 and 50, with 150 rounds on CIFAR]. FedeRiCo
    # takes one small step per round; given the passes over the data that local training gets,
    # the paper's values left it 2-10 points below local training on most clients, these above
    # (benchmarks/personalization.py).
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(16, ge=1)  # the M-step's mini-batch
    mixture_top: int = Field(3, ge=1)  # models in the predictor (highest weights)
    peer_timeout_s: float = Field(60.0, gt=0)  # waiting for a peer's model or gradient
    # A peer's gradient is bounded at this × the lower median of the round's gradient norms,
    # the client's own among them (0: no bound).
    peer_clip: float = Field(10.0, ge=0)
    # A peer's model whose mean cross-entropy on our validation data is above this × log(classes)
    # (10: far worse than a uniform guess), or not finite, gets no weight (0: any finite one).
    absurd_nats: float = Field(10.0, ge=0)


def posterior_weights(losses: Mapping[str, float], temperature: float) -> dict[str, float]:
    """w = softmax(−ℓ / τ) over the models with a loss (the E-step, uniform prior)."""
    ids = sorted(losses)
    z = torch.tensor([-losses[i] / temperature for i in ids], dtype=torch.float64)
    return dict(zip(ids, torch.softmax(z, 0).tolist(), strict=True))


@register_algorithm
class FedeRiCo(ClientAlgorithm):
    name = "federico"
    exchanges_models = True
    config_cls = FedeRiCoConfig
    config: FedeRiCoConfig
    persistent = ("model", "optimizer", "losses", "peer_models", "published")

    def __init__(self, ctx: ClientContext, config: BaseAlgorithmConfig) -> None:
        super().__init__(ctx, config)
        cfg = self.config
        self.model = self._build(ctx.spec)
        params = self.model.parameters()
        self.optimizer: torch.optim.Optimizer = (
            Adam(params, lr=cfg.lr) if cfg.optimizer == "adam" else SGD(params, lr=cfg.lr)
        )
        self.losses: dict[str, float] = {}  # ℓ_ij over the models seen (self included)
        self.peer_models: dict[str, WireModel] = {}  # the latest θ_j fetched, for the mixture
        self.published = 0  # the version of θ_i on its peer topic
        # A network per peer in use (this round's neighbours, the mixture's members) and the
        # model it holds: built once, overwritten when a newer model comes (building one
        # initialises weights only to overwrite them: a tenth of a FedeRiCo run's CPU time).
        # Not persistent: a restart builds them again from peer_models.
        self._nets: dict[str, tuple[WireModel, nn.Module]] = {}

    # -- pieces ------------------------------------------------------------------------------
    @property
    def peers(self) -> Peers:
        if self.ctx.peers is None:
            raise AlgorithmError("federico talks to other clients and this client has no peers")
        return self.ctx.peers

    @property
    def weights(self) -> dict[str, float]:
        return posterior_weights(self.losses, self.config.temperature)

    def _nll(self, model: nn.Module) -> float:
        """L_i(θ): the negative log-likelihood of the whole training set (sum or mean)."""
        d = self.ctx.data
        r = self.ctx.trainer.evaluate(model, d.x_train, d.y_train)
        return r.loss_sum if self.config.loss_reduction == "sum" else r.loss

    def _observe(self, who: str, loss: float) -> None:
        m = self.config.loss_momentum
        old = self.losses.get(who)
        if old is None or not math.isfinite(old):  # a model once absurd starts over
            self.losses[who] = loss
        else:
            self.losses[who] = (1 - m) * old + m * loss

    @staticmethod
    def _typical(
        total: Mapping[str, torch.Tensor], own: float, received: Mapping[str, WireModel]
    ) -> float:
        """The lower median of this round's gradient norms: the client's own (unweighted) and
        those it was sent. One sender alone cannot set it, however large it claims to be."""
        norms = sorted(
            [state_norm(total) / own if own > 0 else 0.0]
            + [state_norm(g.weights) for g in received.values()]
        )
        return norms[(len(norms) - 1) // 2]

    def _absurd(self, model: nn.Module) -> bool:
        """Whether a peer's model is absurd here: on the validation data (the training data
        without any), a mean cross-entropy not finite or above `absurd_nats` × log(classes)."""
        d, limit = self.ctx.data, self.config.absurd_nats
        x, y = (d.x_val, d.y_val) if len(d.y_val) else (d.x_train, d.y_train)
        loss = self.ctx.trainer.evaluate(model, x, y).loss
        return not math.isfinite(loss) or (
            limit > 0 and loss > limit * math.log(max(2, d.num_classes))
        )

    def _gradient(self, model: nn.Module, scale: float) -> dict[str, torch.Tensor]:
        """scale·∇L_i(θ) on one mini-batch, L_i as the whole set's sum (or mean) of losses."""
        d, trainer = self.ctx.data, self.ctx.trainer
        x, y = trainer.sample_batch(d.x_train, d.y_train, self.config.batch_size)
        n = d.n_train if self.config.loss_reduction == "sum" else 1
        model.train()
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        with trainer.autocast():
            loss = cross_entropy(model(x), y) * (n * scale)
        grads = torch.autograd.grad(loss, [p for _, p in named])
        return {k: g.detach().to("cpu") for (k, _), g in zip(named, grads, strict=True)}

    def _sample(self, members: list[str]) -> list[str]:
        """M neighbours: uniformly with probability ε, else the highest weights (then unseen)."""
        others = [c for c in members if c != self.ctx.client_id]
        k = min(self.config.neighbours, len(others))
        g = self.ctx.trainer.generator
        if float(torch.rand((), generator=g, device=g.device)) < self.config.epsilon:
            pick = torch.randperm(len(others), generator=g, device=g.device)[:k].tolist()
            return sorted(others[i] for i in pick)
        w = self.weights
        seen = sorted((c for c in others if c in w), key=lambda c: -w[c])
        unseen = [c for c in others if c not in w]
        order = torch.randperm(len(unseen), generator=g, device=g.device).tolist()
        return sorted((seen + [unseen[i] for i in order])[:k])

    def _publish(self, version: int) -> None:
        self.peers.publish(MODEL, WireModel.of(self.ctx.spec, self.model), version)
        self.published = version

    # -- the round ---------------------------------------------------------------------------
    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        step, params = self.ctx.task.step, self.ctx.task.params
        if step == "exchange":
            return self._exchange(round_, list(params.get("members", [])))
        if step == "update":
            return self._update(round_, list(params.get("from", [])))
        raise AlgorithmError(f"federico has no step {step!r} (exchange, then update)")

    def before_fit(self, round_: int, rounds: int) -> None:
        """θ_i goes out before any client of the exchange step reads a peer's model (round 1,
        or after a restart; the update step publishes it for the next round otherwise)."""
        if self.ctx.task.step == "exchange" and self.published < round_:
            self._publish(round_)

    def _exchange(self, round_: int, members: list[str]) -> FitResult:
        me = self.ctx.client_id
        self._observe(me, self._nll(self.model))
        fetched: dict[str, nn.Module] = {}
        for j in self._sample(members):
            wire = self.peers.fetch(
                j, MODEL, min_version=round_, timeout=self.config.peer_timeout_s
            )
            if wire is None:
                continue
            if wire.spec.num_classes != self.ctx.data.num_classes:
                raise AlgorithmError(f"federico: {j}'s model predicts other classes than ours")
            self.peer_models[j] = wire
            _, net = self._net(j)
            if self._absurd(net):  # no weight, not kept, no gradient
                log.warning("%s: %s's model is absurd on our data: no weight", me, j)
                self.losses[j] = math.inf
                del self.peer_models[j], self._nets[j]
                continue
            fetched[j] = net
            self._observe(j, self._nll(net))
        w = self.weights  # the E-step, with the losses just observed
        # The M-step's share this client owes each model it fetched
        for j, model in fetched.items():
            grads = self._gradient(model, w[j])
            self.peers.send(j, GRAD, round_, WireModel(self.peer_models[j].spec, grads))
        # Networks kept: for the peers the mixture may take, and the next round's neighbours
        in_use = set(fetched) | set(self._top(w))
        self._nets = {c: held for c, held in self._nets.items() if c in in_use}
        return FitResult(
            metrics={"loss_self": self.losses[me], "neighbours": float(len(fetched))},
            n_samples=self.ctx.data.n_train,
            details={"sent_to": ",".join(sorted(fetched))},
        )

    def _update(self, round_: int, senders: list[str]) -> FitResult:
        me = self.ctx.client_id
        own = self.weights.get(me, 1.0)
        total = self._gradient(self.model, own)
        received = self.peers.receive(GRAD, round_, senders, timeout=self.config.peer_timeout_s)
        bound = self.config.peer_clip * self._typical(total, own, received)
        for sender, grad in received.items():
            if set(grad.weights) != set(total):
                raise AlgorithmError(f"federico: {sender}'s gradient does not fit our model")
            norm = state_norm(grad.weights)
            scale = bound / norm if self.config.peer_clip > 0 and norm > bound else 1.0
            if scale < 1.0:
                log.warning("%s: %s's gradient (norm %.3g) clipped to %.3g", me, sender, norm,
                            bound)  # fmt: skip
            for k, g in grad.weights.items():
                total[k] = total[k] + (g * scale if scale < 1.0 else g)
        self.optimizer.zero_grad(set_to_none=True)
        for k, p in self.model.named_parameters():
            if k in total:
                p.grad = total[k].to(p.device, p.dtype).contiguous(memory_format=_format(p))
        self.optimizer.step()
        self._publish(round_ + 1)  # θ_i for the next round's exchange
        w = self.weights
        return FitResult(
            metrics={"gradients_received": float(len(received))},
            n_samples=self.ctx.data.n_train,
            details={f"w:{c}": round(v, 6) for c, v in sorted(w.items())},
        )

    # -- prediction --------------------------------------------------------------------------
    def _mixture(self) -> tuple[ArchSpec, nn.Module]:
        """p_i(y|x) = Σ_j w_ij·p(y|x; θ_j) over the `mixture_top` highest-weight models held."""
        me, w = self.ctx.client_id, self.weights
        top = self._top(w)
        # Around the networks themselves, not copies: its own model and the peers' (what holds
        # it, the guard or an export, copies what it keeps).
        members = [(self.ctx.spec, self.model) if c == me else self._net(c) for c in top]
        weights = [max(w.get(c, 1.0), 1e-12) for c in top]
        spec = mixture_spec([s for s, _ in members], weights)
        return spec, Mixture([m for _, m in members], weights).to(self.ctx.device)

    def _top(self, w: Mapping[str, float]) -> list[str]:
        """The mixture's members under weights `w`: the `mixture_top` highest-weight models
        held (self alone until it holds any weights)."""
        me = self.ctx.client_id
        if me not in w:
            return [me]
        held = [c for c in w if c == me or c in self.peer_models]
        return sorted(held, key=lambda c: -w[c])[: self.config.mixture_top]

    def _net(self, peer: str) -> tuple[ArchSpec, nn.Module]:
        """Peer's latest model (as last fetched) as a network: the one built for that peer
        before, its weights overwritten when a newer model came, where it is of the same
        architecture (nothing else holds it: a mixture is built around it anew each time, and
        what is kept is copied); else a new one."""
        wire = self.peer_models[peer]
        held = self._nets.get(peer)
        if held is None or held[0].spec != wire.spec:
            held = (wire, self._materialize(wire))
        elif held[0] is not wire:
            held[1].load_state_dict(wire.weights)
            held = (wire, held[1])
        self._nets[peer] = held
        return wire.spec, held[1]

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        _, mixture = self._mixture()
        return self._scores("personal", mixture)

    def finish(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        w = self.weights
        top = sorted(w, key=lambda c: -w[c])[: self.config.mixture_top]
        return FitResult(
            metrics=self.evaluate(models),
            n_samples=self.ctx.data.n_train,
            details={"collaborators": ",".join(top), "mixture_size": len(top)},
        )

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        return self._mixture()

    def _kin(self) -> str | None:
        """The peer whose model, of this client's own architecture, has the highest weight
        here of all such models the client holds, where it is higher than its own model's
        (None otherwise). Its own model is trained by the neighbours that weigh it, to their
        labels: on a label-skewed split it can end good for them and useless here (0% on the
        client's validation data at the long size of benchmarks/personalization.py), while a
        peer's model of the same architecture is what its mixture relies on."""
        w, me = self.weights, self.ctx.client_id
        same = [c for c, m in self.peer_models.items() if m.spec == self.ctx.spec and c in w]
        best = max(same, key=lambda c: w[c], default=None)
        return best if best is not None and w[best] > w.get(me, 0.0) else None

    def guard_candidates(self) -> dict[str, Candidate]:
        # After the update step (the exchange step changes no model): the mixture, this
        # client's own model alone, and the peer's model of its architecture it weighs most.
        if self.ctx.task.step == "exchange":
            return {}
        out = {PERSONAL: self.trained_model()}
        kin = self._kin()
        if kin is not None:  # first: the model of its architecture it weighs most
            out["peer"] = self._net(kin)
        return out | {"own": (self.ctx.spec, self.model)}

    def finetune_base(self, models: Mapping[str, WireModel]) -> Candidate | None:
        # No model is shared: what the guard fine-tunes is a copy of the model of this client's
        # architecture it weighs most, its own or a peer's (`_kin`).
        kin = self._kin()
        wire = self.peer_models[kin] if kin is not None else WireModel.of(self.ctx.spec, self.model)
        return self.ctx.spec, self._materialize(wire)

    def finetune_optim(self) -> OptimConfig:
        # FedeRiCo's own optimizer and rate (Adam's β1 is 0.9 there, as torch's default).
        cfg = self.config
        momentum = 0.9 if cfg.optimizer == "adam" else 0.0
        return OptimConfig(
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            batch_size=cfg.batch_size,
            momentum=momentum,
            weight_decay=0.0,
        )


def _format(p: torch.Tensor) -> torch.memory_format:
    if p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
