"""pfml: Regularized Mutual Learning for personalized FL (ACML 2021; paper 000, Algorithm 1).

Client i holds a *local* model w_i (the global architecture; it is what goes to the server) and an
*auxiliary* model m_i (its own architecture allowed; it is the personalized model and never leaves
the device). Each local iteration draws one fresh batch and runs

    θ ← argmin_m L(m) + λ/2·||m_prev − m||²      (K gradient steps from m_i, lr η)
    ŵ ← argmin_w L(w) + λ/2·||w_global − w||²    (K gradient steps from w_i, lr η)
    m_i ← m_i − η∇L(m_i) − ηλ(m_i − θ)
    w_i ← w_i − η∇L(w_i) − ηλ(w_i − ŵ)

with L(w) = CE(w) + KL(p_m.detach() || p_w) and L(m) = CE(m) + KL(p_w.detach() || p_m).
m_prev is the auxiliary model as it was at the start of the round [ours, algorithms.md].
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from edge_sdk.algorithms.base import (
    SPEC_ATTR,
    AlgorithmError,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    register_algorithm,
)
from edge_sdk.algorithms.candidates import PERSONAL, Candidate
from edge_sdk.algorithms.guard_config import SHARED, MixingGuardConfig
from edge_sdk.codec import WireModel
from edge_sdk.losses import DistillTarget, ce_plus_kl, distill_target
from edge_sdk.optim_config import OptimConfig
from model_zoo import ArchSpec

__all__ = ["PFML", "PFMLConfig"]


_PLAIN_STEPS = "pfml takes the plain gradient steps of Algorithm 1 (lr η only)"


class PFMLConfig(BaseAlgorithmConfig, MixingGuardConfig):
    # preset = "paper": E = 10 iterations of batches of 200 (the figure captions), η = 0.01 and
    # λ = 20 [paper]. The auxiliary model persists (`aux_init`): re-initialising it from the
    # global model, as the literal Algorithm 1 does, is undefined for one of another
    # architecture, which the paper allows.
    paper: ClassVar[dict[str, Any]] = {
        "local_epochs": None,
        "local_iterations": 10,
        "batch_size": 200,
        "lr": 0.01,
        "lam": 20.0,
    }
    trusted: ClassVar[dict[str, Any]] = SHARED

    # E: local *iterations*, each on one fresh batch of batch_size samples [paper: 10]. Used when
    # local_epochs is None (setting local_iterations alone sets it so).
    local_iterations: int = Field(10, ge=0)
    # [ours] E = ⌈local_epochs·n/batch_size⌉ for a client with n training samples: the passes
    # over its data that an algorithm training whole epochs makes (5: their default), so that
    # PFML and its baselines run on the same budget by default.
    local_epochs: int | None = Field(5, ge=0)
    # D: the paper's captions say 200, pFedMe (which PFML builds on) used 20 [paper]. 20: on
    # clients with a few hundred samples, 200 is a step or two per epoch.
    batch_size: int = Field(20, ge=1)
    # η, for the K inner steps and the outer step alike [paper: 0.01, with T = 800 rounds].
    # [ours] 0.05: plain steps without momentum at 0.01 left the auxiliary models of short runs
    # far below local training (benchmarks/personalization.py).
    lr: float = Field(0.05, gt=0)
    k_steps: int = Field(3, ge=1)  # K personalization steps
    # λ, proximal strength [paper: 20, with T = 800]. Each step pulls the auxiliary model back to
    # where its round started with strength η·λ, so it learns little per round: [ours] 1 for the
    # runs of tens of rounds this SDK is used with (benchmarks/personalization.py).
    lam: float = Field(1.0, ge=0)
    beta: float = Field(2.0, gt=0)  # server step: w ← (1−β)·w + β·mean(w_i); β = 1 is FedAvg
    aux_init: Literal["persist", "global"] = "persist"  # [ours] keep m_i, or reset it each round
    participation: Literal["sampled", "all"] = "sampled"  # "all": everyone trains, |U| aggregate
    weighting: Literal["uniform", "by_samples"] = "uniform"  # [paper]; pFedMe's code: by_samples

    refused: ClassVar[dict[str, str]] = {
        "optimizer": _PLAIN_STEPS,
        "momentum": _PLAIN_STEPS + "; no momentum",
        "weight_decay": _PLAIN_STEPS + "; its regularizer is the proximal term λ (lam)",
        "lr_schedule": _PLAIN_STEPS + "; η is constant",
        "lr_gamma": _PLAIN_STEPS + "; η is constant",
    }

    @model_validator(mode="before")
    @classmethod
    def _iterations_alone(cls, data: Any) -> Any:
        # Setting the paper's iterations without epochs asks for iterations (epochs win when both
        # are given, e.g. a config that was written out whole).
        if isinstance(data, Mapping) and "local_iterations" in data and "local_epochs" not in data:
            return {**data, "local_epochs": None}
        return data

    @model_validator(mode="after")
    def _stable(self) -> PFMLConfig:
        if not _pull_bounded(self.lr * self.lam, self.k_steps):
            raise ValueError(
                f"pfml diverges when lr·lam >= {_pull_bound(self.k_steps):.3f} with k_steps = "
                f"{self.k_steps} (got {self.lr}·{self.lam}); lower lr or lam"
            )
        return self


def _pull_bounded(x: float, k: int) -> bool:
    """Whether the proximal pull alone (the loss's gradient left out) does not grow at η·λ = x
    (at 0 there is none).

    Each inner step maps θ − a to (1 − x)(θ − a), so K of them from w end at
    (1 − x)^K (w − a), and the outer step w ← w − x·(w − θ_K) maps w − a to
    (1 − x(1 − (1 − x)^K))(w − a). The first factor must be below 1 in size, the second at most
    1: x < 2, and x ≤ √2 for K = 1, about 1.62 for K = 3. Near the bound the loss's own
    curvature can still tip it over (lr 0.05, λ 30, K 3 drifted about 200× further than without
    λ on a tiny MLR)."""
    return 0 <= x < 2 and abs(1 - x * (1 - (1 - x) ** k)) <= 1


def _pull_bound(k: int) -> float:
    """The largest η·λ at which the pull does not grow for K steps (to 1e-6)."""
    lo, hi = 0.0, 2.0
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _pull_bounded(mid, k) else (lo, mid)
    return lo


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _copied(kept: list[torch.Tensor] | None, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of `params`: written into `kept` when it holds tensors laid out as they
    are, else new ones."""
    with torch.no_grad():
        values = [p.detach() for p in params]
        if kept is not None and [_layout(k) for k in kept] == [_layout(v) for v in values]:
            torch._foreach_copy_(kept, values)
            return kept
        return [v.clone() for v in values]


def _shaped_as(kept: nn.Module | None, model: nn.Module) -> nn.Module:
    """A model of `model`'s kind and parameter layout: `kept` when it is one, else a copy."""
    if (
        kept is not None
        and type(kept) is type(model)
        and [_layout(p) for p in kept.parameters()] == [_layout(p) for p in model.parameters()]
    ):
        return kept.train(model.training)
    return copy.deepcopy(model)


@register_algorithm
class PFML(ClientAlgorithm):
    name = "pfml"
    persistent = ("local", "aux")
    # The round's anchors and work models (not persistent), rewritten in place from round to
    # round: a captured step (a device's, or the simulator's for many clients) reads them.
    config_cls = PFMLConfig
    config: PFMLConfig
    anchor_local: list[torch.Tensor] | None = None
    anchor_aux: list[torch.Tensor] | None = None
    work_local: nn.Module | None = None
    work_aux: nn.Module | None = None

    def __init__(self, ctx: ClientContext, config: BaseAlgorithmConfig) -> None:
        super().__init__(ctx, config)
        self.local: nn.Module | None = None
        self.aux: nn.Module | None = None

    def _initial_aux(self, glob: WireModel) -> nn.Module:
        """m_i before its first round: the global model when the architecture is the global
        one, otherwise this client's seeded random initialisation (the same every time)."""
        if self.ctx.spec == glob.spec:
            return self._materialize(glob)
        return self._build(self.ctx.spec, 1)

    def _prepare(self, glob: WireModel) -> None:
        if self.local is None:
            self.local = self._materialize(glob)
        self.local.load_state_dict(glob.weights)  # w_i starts the round at the global model
        if self.aux is None:
            self.aux = self._initial_aux(glob)
        elif self.config.aux_init == "global":
            if self.ctx.spec != glob.spec:
                raise AlgorithmError(
                    f"pfml: aux_init='global' re-initialises the auxiliary model from the global "
                    f"model ({glob.spec}), but this client's auxiliary is {self.ctx.spec}; use "
                    "aux_init='persist' or the global architecture on this client"
                )
            self.aux.load_state_dict(glob.weights)

    def _inner(
        self,
        start: nn.Module,
        work: nn.Module,
        anchor: list[torch.Tensor],
        x: torch.Tensor,
        target: DistillTarget,
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor]:
        """K gradient steps on CE + KL(teacher||·) + λ/2·||anchor − ·||², starting from `start`
        (`target`: the labels and the teacher, fixed for the K steps).

        Returns where they end, and the gradient and value of CE + KL at `start` (the first
        step's, taken there): the outer step needs exactly those, so it computes neither again.
        """
        cfg = self.config
        params = _params(work)
        with torch.no_grad():
            for p, q in zip(params, _params(start), strict=True):
                p.copy_(q)
        first: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None
        for _ in range(cfg.k_steps):
            grads, loss = self.ctx.trainer.value_and_grad(work, ce_plus_kl, x, target)
            if first is None:
                first = (grads, loss)
            with torch.no_grad():
                # + ∇ λ/2·||anchor − ·||² = λ·(· − anchor), written out: through autograd it cost
                # five ops and their backward per parameter, most of a step of a small model.
                step = torch._foreach_sub(params, anchor)
                torch._foreach_mul_(step, cfg.lam)
                torch._foreach_add_(step, grads)
                torch._foreach_add_(params, step, alpha=-cfg.lr)
        assert first is not None  # k_steps >= 1 (the config's bound)
        return [p.detach() for p in params], *first

    def train_round(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        glob = self._require(models, "global")
        self._prepare(glob)
        assert self.local is not None and self.aux is not None
        cfg, trainer, data = self.config, self.ctx.trainer, self.ctx.data
        eta, lam = cfg.lr, cfg.lam
        local, aux = self.local, self.aux
        local.train()
        aux.train()
        w_global = self.anchor_local = _copied(self.anchor_local, _params(local))
        m_prev = self.anchor_aux = _copied(self.anchor_aux, _params(aux))
        # (what the work models hold does not matter: each inner loop starts from a copy)
        theta_net = self.work_aux = _shaped_as(self.work_aux, aux)
        w_hat_net = self.work_local = _shaped_as(self.work_local, local)
        params = _params(aux) + _params(local)

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
            with torch.no_grad(), trainer.autocast():  # each model is the other's teacher
                z_m, z_w = aux(x), local(x)
            to_m, to_w = distill_target(z_w, y), distill_target(z_m, y)
            # ∇L(m_i) and ∇L(w_i) are the first inner steps' gradients (they start there).
            theta, grads_m, loss_m = self._inner(aux, theta_net, m_prev, x, to_m)
            w_hat, grads_w, loss_w = self._inner(local, w_hat_net, w_global, x, to_w)
            with torch.no_grad():
                for p, g, anchor in zip(params, grads_m + grads_w, theta + w_hat, strict=True):
                    p.sub_(eta * (g + lam * (p - anchor)))
            return (loss_m + loss_w,)

        batches = trainer.fresh_batches(
            data.x_train, data.y_train, cfg.batch_size, self.iterations()
        )
        keep = (aux, local, theta_net, w_hat_net, *w_global, *m_prev, eta, lam, cfg.k_steps)
        (loss,) = trainer.run(step, batches, keep=keep)
        return FitResult(
            models={"local": WireModel.of(glob.spec, local)},
            metrics={"train_loss": loss},
            n_samples=data.n_train,
        )

    def iterations(self) -> int:
        """E for this round: `local_iterations`, or the iterations of `local_epochs` epochs."""
        cfg = self.config
        if cfg.local_epochs is None:
            return cfg.local_iterations
        its = self._per_client(
            lambda n: math.ceil(cfg.local_epochs * n / cfg.batch_size), self.ctx.data.n_train
        )
        return int(self._one_for_all(its, "pfml: the clients' epochs differ in iterations"))

    def evaluate(self, models: Mapping[str, WireModel]) -> dict[str, float]:
        if self.aux is not None:
            return super().evaluate(models)
        # Not trained yet: score the auxiliary model the first round would start from, without
        # keeping it. Evaluation changes no state, so how often it runs cannot change a result.
        glob = self._require(models, "global")
        out = self._scores("personal", self._initial_aux(glob))
        if glob.spec.num_classes == self.ctx.data.num_classes:
            out |= self._scores("global", self._materialize(glob))
        return out

    def finish(self, round_: int, rounds: int, models: Mapping[str, WireModel]) -> FitResult:
        if self.aux is None and "global" in models:  # never trained: deploy the initial m_i
            self.aux = self._initial_aux(models["global"])
        return super().finish(round_, rounds, models)

    def trained_model(self) -> tuple[ArchSpec, nn.Module]:
        if self.aux is None:
            raise RuntimeError("pfml: no auxiliary model before the first round")
        return self.ctx.spec, self.aux

    def guard_candidates(self) -> dict[str, Candidate]:
        # The local model w_i after this round: the global model trained on this client's data.
        out: dict[str, Candidate] = {PERSONAL: self.trained_model()}
        local = self.local
        if local is not None:
            out["local"] = (getattr(local, SPEC_ATTR), local)
        return out

    def finetune_optim(self) -> OptimConfig:
        # The guard fine-tunes with PFML's own plain gradient steps at η.
        cfg = self.config
        return OptimConfig(lr=cfg.lr, batch_size=cfg.batch_size, momentum=0.0, weight_decay=0.0)
