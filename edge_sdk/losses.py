"""The losses every algorithm shares: cross-entropy, KL distillation, proximal term.

KL distillation is always KL(teacher.detach() || student) with `reduction="batchmean"`, scaled by
T² (see algorithms.md, "Common conventions"): `reduction="mean"` would divide by the class count,
a known bug in reimplementations.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy", "kl_distill", "proximal", "soft_cross_entropy"]


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, C) against class ids (B,).

    With a leading dimension of clients, logits (N, B, C) and ids (N, B) (a cohort's stacked
    batch, edge_sdk.cohort), one mean per client, shape (N,). For one client it is what
    F.cross_entropy computes (log-softmax, then NLL), to the bit.
    """
    log_p = F.log_softmax(logits.float(), dim=-1)
    if logits.dim() == 3:
        nll = F.nll_loss(log_p.flatten(0, 1), target.flatten(), reduction="none")
        return nll.view(target.shape).mean(1)
    return F.nll_loss(log_p, target)


def kl_distill(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """T² · KL(softmax(teacher/T) || softmax(student/T)), batch-mean; the teacher is detached.

    Logits (N, B, C) with a leading dimension of clients give one value per client, (N,).
    """
    t = float(temperature)
    student, teacher = student_logits.float(), teacher_logits.detach().float()
    if t != 1.0:  # skip the no-op scaling: it costs four extra ops per call in the hot loop
        student, teacher = student / t, teacher / t
    log_p_student = F.log_softmax(student, dim=-1)
    p_teacher = F.softmax(teacher, dim=-1)
    if student.dim() == 3:
        kl = F.kl_div(log_p_student, p_teacher, reduction="none").sum(2).mean(1)
    else:
        kl = F.kl_div(log_p_student, p_teacher, reduction="batchmean")
    return kl if t == 1.0 else kl * (t * t)


def soft_cross_entropy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """T² · CE(softmax(teacher/T), softmax(student/T)), batch-mean; the teacher is detached."""
    t = float(temperature)
    log_p_student = F.log_softmax(student_logits.float() / t, dim=1)
    p_teacher = F.softmax(teacher_logits.detach().float() / t, dim=1)
    return -(p_teacher * log_p_student).sum(dim=1).mean() * (t * t)


def proximal(
    params: Iterable[torch.Tensor], anchor: Iterable[torch.Tensor], mu: float
) -> torch.Tensor:
    """mu/2 · ||w − w_anchor||² summed over all parameters; the anchor carries no gradient."""
    total: torch.Tensor | None = None
    for p, a in zip(params, anchor, strict=True):
        term = (p - a.detach()).pow(2).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("proximal term over an empty parameter list")
    return 0.5 * mu * total
