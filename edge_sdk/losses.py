"""The losses every algorithm shares: cross-entropy, KL distillation, proximal term.

KL distillation is always KL(teacher.detach() || student) with `reduction="batchmean"`, scaled by
T² (see algorithms.md, "Common conventions"): `reduction="mean"` would divide by the class count,
a known bug in reimplementations.

On a stack of clients (coordinator.stacking) the logits carry a leading dimension of clients,
(N, B, C), and every loss gives one value per client, (N,). The trainer that drew such a batch
says, for the time of one step (`stacked_batch`), how many clients of the stack take it (a
prefix of the stack: those whose epoch has not ended) and, when their batches are padded to one
size, each sample's weight in its client's mean (zero for padding): the losses then average over
each client's own samples only, and the proximal term covers that prefix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "DistillTarget",
    "StackedBatch",
    "ce_plus_kl",
    "cross_entropy",
    "distill_target",
    "distillation_loss",
    "kl_distill",
    "mutual_losses",
    "proximal",
    "rows_of",
    "soft_cross_entropy",
    "stacked_batch",
    "weighted",
]


@dataclass(frozen=True)
class StackedBatch:
    """The step a stack of clients is taking: `rows` clients (the first of the stack) and, for
    padded batches, `weights` (rows, B): each sample's share of its client's mean, 0 for
    padding (None: every sample counts, a plain mean)."""

    rows: int
    weights: torch.Tensor | None = None


_STACKED: ContextVar[StackedBatch | None] = ContextVar("edgefl_stacked_batch", default=None)


@contextlib.contextmanager
def stacked_batch(batch: StackedBatch) -> Iterator[None]:
    """The losses computed inside this block belong to `batch` (set by a cohort's trainer)."""
    token = _STACKED.set(batch)
    try:
        yield
    finally:
        _STACKED.reset(token)


def rows_of(value: float | torch.Tensor) -> float | torch.Tensor:
    """A per-client value as this step's losses take it: a number as is; a stack's tensor of
    one value per member (N,) cut to the members taking the current stacked step (a prefix of
    the stack, `CohortTrainer`), so that it multiplies their (rows,) losses."""
    batch = _STACKED.get()
    if batch is None or not isinstance(value, torch.Tensor):
        return value
    return value[: batch.rows]


def _per_client(values: torch.Tensor) -> torch.Tensor:
    """(N, B) per-sample values → (N,) each client's mean over its own samples."""
    batch = _STACKED.get()
    if batch is None or batch.weights is None:
        return values.mean(1)
    return (values * batch.weights).sum(1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, C) against class ids (B,).

    With a leading dimension of clients, logits (N, B, C) and ids (N, B) (a cohort's stacked
    batch, coordinator.stacking; ids (B,) when every client has the same batch), one mean per
    client, shape (N,). For one client it is what F.cross_entropy computes (log-softmax, then
    NLL), to the bit.
    """
    log_p = F.log_softmax(logits.float(), dim=-1)
    if logits.dim() == 3:
        target = target.expand(logits.shape[:2])
        nll = F.nll_loss(log_p.flatten(0, 1), target.flatten(), reduction="none")
        return _per_client(nll.view(target.shape))
    return F.nll_loss(log_p, target)


def _scaled(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):  # one temperature per client of a stack, (N,)
        return logits / temperature.view(-1, 1, 1)
    return logits / temperature


def kl_distill(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """T² · KL(softmax(teacher/T) || softmax(student/T)), batch-mean; the teacher is detached.

    Student logits (N, B, C) with a leading dimension of clients give one value per client,
    (N,); the teacher's are (N, B, C), or (B, C) when it is the same for all, and `temperature`
    may then be a tensor of one temperature per client.
    """
    student, teacher = student_logits.float(), teacher_logits.detach().float()
    t = temperature if isinstance(temperature, torch.Tensor) else float(temperature)
    if isinstance(t, torch.Tensor) or t != 1.0:  # skip the no-op scaling (four ops in the loop)
        student, teacher = _scaled(student, t), _scaled(teacher, t)
    log_p_student = F.log_softmax(student, dim=-1)
    p_teacher = F.softmax(teacher, dim=-1)
    if student.dim() == 3:
        kl = _per_client(F.kl_div(log_p_student, p_teacher, reduction="none").sum(2))
    else:
        kl = F.kl_div(log_p_student, p_teacher, reduction="batchmean")
    if isinstance(t, torch.Tensor):
        return kl * (t * t)
    return kl if t == 1.0 else kl * (t * t)


class DistillTarget(NamedTuple):
    """A fixed teacher's share of `ce_plus_kl`, computed once for every step on one batch:
    `mass` = softmax(teacher) + one_hot(label), (…, B, C), and `neg_entropy` = Σ_c p log p of
    the teacher, (…, B)."""

    mass: torch.Tensor
    neg_entropy: torch.Tensor


def distill_target(teacher_logits: torch.Tensor, target: torch.Tensor) -> DistillTarget:
    """What `ce_plus_kl` needs of a teacher's logits (B, C) or (N, B, C) and the labels (B,) or
    (N, B); the teacher is detached."""
    log_t = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    p_t = log_t.exp()
    return DistillTarget(p_t + _one_hot(target, p_t), (p_t * log_t).sum(-1))


def _one_hot(target: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Class ids (…, B) as one-hot rows shaped, typed and placed as `like` (…, B, C), built by
    comparison: F.one_hot reads the labels' range on the host (a sync on CUDA)."""
    classes = torch.arange(like.shape[-1], device=like.device)
    return (target.unsqueeze(-1) == classes).to(like.dtype)


def _sample_mean(per_sample: torch.Tensor) -> torch.Tensor:
    """Per-sample values (B,) → their mean; a stack's (N, B) → each client's (`_per_client`)."""
    if per_sample.dim() == 2:
        return _per_client(per_sample)
    return per_sample.mean()


def ce_plus_kl(logits: torch.Tensor, target: DistillTarget) -> torch.Tensor:
    """`cross_entropy(logits, y) + kl_distill(logits, teacher)` (T = 1), for a teacher that stays
    fixed over several steps (PFML's inner steps): one log-softmax a step instead of two, and
    none of the teacher's.

    Per sample, −log p_y + Σ_c q_c (log q_c − log p_c) = Σ_c q_c log q_c − Σ_c (q_c + [c = y])
    log p_c, with p the student's softmax and q the teacher's. Stacked logits give one value
    per client, as the two losses do.
    """
    log_p = F.log_softmax(logits.float(), dim=-1)
    return _sample_mean(target.neg_entropy - (target.mass * log_p).sum(-1))


def mutual_losses(
    logits_a: torch.Tensor,
    logits_b: torch.Tensor,
    target: torch.Tensor,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deep mutual learning's two losses (FML's step), each model the other's detached teacher:
    α·CE(a, y) + (1 − α)·KL(b‖a) and β·CE(b, y) + (1 − β)·KL(a‖b) at T = 1, the values and
    gradients of `cross_entropy` and `kl_distill` so weighted, from one log-softmax per model
    (those two take two log-softmaxes and a softmax per model; on CUDA every operation is a
    kernel of the captured step).

    Per sample, with p the student's softmax, q the teacher's and w its weight,
    w·(−log p_y) + (1 − w)·Σ_c q_c (log q_c − log p_c)
    = (1 − w)·Σ_c q_c log q_c − Σ_c ((1 − w)·q_c + w·[c = y]) log p_c.
    α and β are numbers, or one per client (a stack's: `rows_of` takes the rows of the
    clients taking the step); stacked logits give one value per client.
    """
    log_a = F.log_softmax(logits_a.float(), dim=-1)
    log_b = F.log_softmax(logits_b.float(), dim=-1)
    hot = _one_hot(target, log_a)
    alpha, beta = rows_of(alpha), rows_of(beta)
    return _mutual(log_a, log_b.detach(), hot, alpha), _mutual(log_b, log_a.detach(), hot, beta)


def weighted(weight: float | torch.Tensor, loss: Callable[[], torch.Tensor]) -> torch.Tensor | int:
    """`weight` × `loss()`, a loss a client takes in part: a number 0 takes none (`loss` is not
    computed), 1 takes it whole; one weight per client (a stack's) multiplies each client's
    value (`rows_of`)."""
    if isinstance(weight, torch.Tensor):
        return rows_of(weight) * loss()
    if weight == 0:
        return 0
    return loss() if weight == 1 else weight * loss()


def _mutual(
    log_p: torch.Tensor, log_q: torch.Tensor, hot: torch.Tensor, w: float | torch.Tensor
) -> torch.Tensor:
    w_sample = w_class = w
    if isinstance(w, torch.Tensor) and w.dim():  # one per client: (rows,)
        w_sample, w_class = w.view(-1, 1), w.view(-1, 1, 1)
    q = log_q.exp()
    mass = torch.lerp(q, hot, w_class)  # (1 − w)·q + w·one-hot
    return _sample_mean((1 - w_sample) * (q * log_q).sum(-1) - (mass * log_p).sum(-1))


def soft_cross_entropy(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """T² · CE(softmax(teacher/T), softmax(student/T)), batch-mean; the teacher is detached.

    Stacked logits as for `kl_distill`: one value per client."""
    t = temperature if isinstance(temperature, torch.Tensor) else float(temperature)
    student = _scaled(student_logits.float(), t)
    teacher = _scaled(teacher_logits.detach().float(), t)
    log_p_student = F.log_softmax(student, dim=-1)
    p_teacher = F.softmax(teacher, dim=-1)
    if student.dim() == 3:
        return _per_client(-(p_teacher * log_p_student).sum(2)) * (t * t)
    return -(p_teacher * log_p_student).sum(dim=1).mean() * (t * t)


def proximal(
    params: Iterable[torch.Tensor], anchor: Iterable[torch.Tensor], mu: float
) -> torch.Tensor:
    """mu/2 · ||w − w_anchor||² summed over all parameters; the anchor carries no gradient.

    Inside a stacked step (parameters with a leading dimension of clients), one value per
    client taking the step, (rows,)."""
    batch = _STACKED.get()
    total: torch.Tensor | None = None
    for p, a in zip(params, anchor, strict=True):
        if batch is None:
            term = (p - a.detach()).pow(2).sum()
        else:
            rows = batch.rows
            term = (p[:rows] - a[:rows].detach()).pow(2).flatten(1).sum(1)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("proximal term over an empty parameter list")
    return 0.5 * mu * total


def distillation_loss(
    kind: Literal["kl", "gd"],
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor,
    lam: float,
    temperature: float,
) -> torch.Tensor:
    """(1−λ)·CE(z_s, y) + λ·(T²-scaled KL or soft CE of the teacher's softened outputs)."""
    hard = cross_entropy(student_logits, target)
    if lam == 0:
        return hard  # the soft term would be multiplied by zero
    soft_fn = kl_distill if kind == "kl" else soft_cross_entropy
    return (1 - lam) * hard + lam * soft_fn(student_logits, teacher_logits, temperature)
