import math

import pytest
import torch
import torch.nn.functional as F

from edge_sdk.losses import (
    StackedBatch,
    ce_plus_kl,
    cross_entropy,
    distill_target,
    kl_distill,
    mutual_losses,
    proximal,
    rows_of,
    soft_cross_entropy,
    stacked_batch,
    weighted,
)


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_kl_distill_is_teacher_to_student_batchmean_by_hand():
    # Prepare: two samples, 3 classes; softmax by hand.
    student = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    teacher = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    ps = [F.softmax(student[i], 0).tolist() for i in range(2)]
    pt = [F.softmax(teacher[i], 0).tolist() for i in range(2)]
    expected = (_kl(pt[0], ps[0]) + _kl(pt[1], ps[1])) / 2  # KL(teacher || student), / batch

    # Execute
    got = kl_distill(student, teacher).item()

    # Assert: batchmean (not divided by the class count) and the right direction
    assert got == pytest.approx(expected, rel=1e-6)
    reverse = (_kl(ps[0], pt[0]) + _kl(ps[1], pt[1])) / 2
    assert abs(got - reverse) > 1e-3
    assert got != pytest.approx(expected / 3, rel=1e-3)


def test_kl_distill_scales_by_temperature_squared():
    student = torch.tensor([[2.0, -1.0, 0.5]])
    teacher = torch.tensor([[0.0, 1.0, 3.0]])
    t = 4.0
    soft_s = F.softmax(student[0] / t, 0).tolist()
    soft_t = F.softmax(teacher[0] / t, 0).tolist()
    assert kl_distill(student, teacher, t).item() == pytest.approx(
        t * t * _kl(soft_t, soft_s), rel=1e-6
    )


def test_kl_distill_sends_no_gradient_to_the_teacher():
    student = torch.randn(4, 5, requires_grad=True)
    teacher = torch.randn(4, 5, requires_grad=True)
    kl_distill(student, teacher).backward()
    assert student.grad is not None and teacher.grad is None


def test_kl_distill_is_zero_for_identical_logits():
    z = torch.randn(3, 7)
    assert kl_distill(z, z.clone()).item() == pytest.approx(0.0, abs=1e-6)


def test_soft_cross_entropy_equals_kl_plus_teacher_entropy():
    student, teacher = torch.randn(5, 4), torch.randn(5, 4)
    p_t = F.softmax(teacher, 1)
    entropy = -(p_t * p_t.log()).sum(1).mean()
    assert soft_cross_entropy(student, teacher).item() == pytest.approx(
        (kl_distill(student, teacher) + entropy).item(), rel=1e-5
    )


def test_cross_entropy_matches_negative_log_likelihood():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = (1/4, 3/4)
    assert cross_entropy(logits, torch.tensor([1])).item() == pytest.approx(-math.log(0.75))


def test_proximal_term_by_hand():
    w = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    anchor = [torch.tensor([0.0, 0.0]), torch.tensor([[1.0]])]
    # mu/2 * (1 + 4 + 4) with mu = 0.5
    assert proximal(w, anchor, 0.5).item() == pytest.approx(0.25 * 9)


def test_proximal_rejects_mismatched_lists():
    with pytest.raises(ValueError):
        proximal([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], 1.0)


def test_soft_cross_entropy_with_temperature_by_hand():
    student = torch.tensor([[2.0, -1.0, 0.5]])
    teacher = torch.tensor([[0.0, 1.0, 3.0]])
    t = 3.0
    soft_s = F.softmax(student[0] / t, 0).tolist()
    soft_t = F.softmax(teacher[0] / t, 0).tolist()
    expected = -t * t * sum(a * math.log(b) for a, b in zip(soft_t, soft_s, strict=True))
    assert soft_cross_entropy(student, teacher, t).item() == pytest.approx(expected, rel=1e-6)


def test_kl_distill_at_temperature_two_takes_the_scaled_path():
    student, teacher = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    soft_s = F.softmax(student[0] / 2, 0).tolist()
    soft_t = F.softmax(teacher[0] / 2, 0).tolist()
    assert kl_distill(student, teacher, 2.0).item() == pytest.approx(4 * _kl(soft_t, soft_s))


def test_proximal_over_no_parameters_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^proximal term over an empty parameter list$"):
        proximal([], [], 1.0)


@pytest.mark.parametrize(("batch", "classes"), [(1, 2), (20, 10), (128, 10), (500, 100)])
def test_cross_entropy_and_its_gradient_equal_torchs_to_the_bit(batch, classes):
    # The simulator's pinned results depend on it (tests/coordinator/test_simulator_results.py).
    g = torch.Generator().manual_seed(batch)
    z = torch.randn(batch, classes, generator=g, requires_grad=True)
    y = torch.randint(0, classes, (batch,), generator=g)

    ours, theirs = cross_entropy(z, y), F.cross_entropy(z, y)

    assert torch.equal(ours, theirs)
    assert torch.equal(torch.autograd.grad(ours, z)[0], torch.autograd.grad(theirs, z)[0])


def _hand_soft_losses(student, teacher, temperature):
    """One client's T²·KL(teacher‖student) and T²·CE(teacher, student), batch means at
    temperature T, written out from the probabilities."""
    p = F.softmax(teacher / temperature, dim=1)
    log_q = F.log_softmax(student / temperature, dim=1)
    kl = (p * (p.log() - log_q)).sum(1).mean() * temperature**2
    ce = -(p * log_q).sum(1).mean() * temperature**2
    return kl, ce


@pytest.mark.parametrize("shared_teacher", [False, True], ids=["own-teachers", "one-teacher"])
def test_a_stacks_soft_losses_are_each_clients_own_at_its_own_temperature(shared_teacher):
    # Three clients' logits stacked (N, B, C), one temperature per client; the teacher is each
    # client's own (N, B, C) or the same (B, C) for all. Each client's value is its own losses.
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 5, 4, generator=g)
    teacher = torch.randn(5, 4, generator=g) if shared_teacher else torch.randn(3, 5, 4)
    temps = torch.tensor([1.0, 2.0, 4.0])

    kl, ce = kl_distill(student, teacher, temps), soft_cross_entropy(student, teacher, temps)

    assert kl.shape == ce.shape == (3,)
    for i, t in enumerate(temps.tolist()):
        want_kl, want_ce = _hand_soft_losses(
            student[i], teacher if shared_teacher else teacher[i], t
        )
        assert kl[i].item() == pytest.approx(want_kl.item(), rel=1e-5), i
        assert ce[i].item() == pytest.approx(want_ce.item(), rel=1e-5), i


def test_rows_of_cuts_a_stacks_values_to_the_clients_taking_the_step():
    per_client = torch.tensor([1.0, 2.0, 3.0])
    assert rows_of(per_client) is per_client and rows_of(0.5) == 0.5  # no stacked step
    with stacked_batch(StackedBatch(rows=2)):
        assert torch.equal(rows_of(per_client), per_client[:2])
        assert rows_of(0.5) == 0.5  # a number is everyone's


def test_weighted_takes_a_loss_in_part_and_computes_none_it_does_not_take():
    # Prepare: a loss that counts its calls; a stack's weights, one per client
    calls = []
    value = torch.tensor([2.0, 4.0, 8.0])

    def loss():
        calls.append(1)
        return value

    # Execute, Assert: 0 takes none and computes nothing; 1 the loss itself; a number a share
    assert weighted(0.0, loss) == 0 and not calls
    assert weighted(1.0, loss) is value and len(calls) == 1
    assert torch.equal(weighted(0.25, loss), torch.tensor([0.5, 1.0, 2.0]))
    # one weight per client: each client's value, of the clients taking the step
    per_client = torch.tensor([0.0, 0.5, 1.0])
    assert torch.equal(weighted(per_client, loss), torch.tensor([0.0, 2.0, 8.0]))
    with stacked_batch(StackedBatch(rows=2)):
        value = torch.tensor([2.0, 4.0])
        assert torch.equal(weighted(per_client, loss), torch.tensor([0.0, 2.0]))


def _hand_ce_plus_kl(student, teacher, y):
    """One client's CE + KL(teacher‖student) per sample, written out from the probabilities."""
    p = F.softmax(teacher, dim=-1)
    log_q = F.log_softmax(student, dim=-1)
    ce = -log_q.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return ce + (p * (p.log() - log_q)).sum(-1)


def test_ce_plus_kl_is_cross_entropy_plus_kl_by_hand_with_its_gradient():
    g = torch.Generator().manual_seed(1)
    student = torch.randn(6, 5, generator=g, requires_grad=True)
    teacher = torch.randn(6, 5, generator=g, requires_grad=True)
    y = torch.randint(0, 5, (6,), generator=g)

    got = ce_plus_kl(student, distill_target(teacher, y))
    want = _hand_ce_plus_kl(student, teacher.detach(), y).mean()

    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    (g_got,) = torch.autograd.grad(got, student)
    (g_want,) = torch.autograd.grad(want, student)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-7)
    assert not distill_target(teacher, y).mass.requires_grad  # the teacher is detached


def test_a_stacks_ce_plus_kl_is_each_clients_own_over_its_own_samples():
    # Three clients, batches of 4 padded to 4, 3 and 2 real samples (weights 0 for padding).
    g = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    y = torch.randint(0, 5, (3, 4), generator=g)
    real = [4, 3, 2]
    weights = torch.stack([(torch.arange(4) < k) / k for k in real])

    with stacked_batch(StackedBatch(rows=3, weights=weights)):
        got = ce_plus_kl(student, distill_target(teacher, y))

    assert got.shape == (3,)
    for i, k in enumerate(real):
        want = _hand_ce_plus_kl(student[i, :k], teacher[i, :k], y[i, :k]).mean()
        assert got[i].item() == pytest.approx(want.item(), rel=1e-6), i


def test_distill_target_builds_its_one_hot_on_the_teachers_device():
    # The "meta" device stands in for CUDA: a one-hot built on the CPU would not mix with it.
    teacher = torch.randn(2, 4, 3, device="meta")
    y = torch.zeros(2, 4, dtype=torch.long, device="meta")
    target = distill_target(teacher, y)
    assert target.mass.device.type == "meta" and target.mass.shape == (2, 4, 3)


def _hand_mutual(student, teacher, y, w):
    """One client's w·CE + (1 − w)·KL(teacher‖student) per sample, written out."""
    p = F.softmax(teacher, dim=-1)
    log_q = F.log_softmax(student, dim=-1)
    ce = -log_q.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return w * ce + (1 - w) * (p * (p.log() - log_q)).sum(-1)


def test_mutual_losses_are_each_models_weighted_ce_plus_kl_with_their_gradients():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 5, generator=g, requires_grad=True)
    b = torch.randn(6, 5, generator=g, requires_grad=True)
    y = torch.randint(0, 5, (6,), generator=g)

    got_a, got_b = mutual_losses(a, b, y, 0.3, 0.8)
    want_a = _hand_mutual(a, b.detach(), y, 0.3).mean()
    want_b = _hand_mutual(b, a.detach(), y, 0.8).mean()

    assert got_a.item() == pytest.approx(want_a.item(), rel=1e-6)
    assert got_b.item() == pytest.approx(want_b.item(), rel=1e-6)
    got = torch.autograd.grad(got_a + got_b, [a, b])
    want = torch.autograd.grad(want_a + want_b, [a, b])
    for g_got, g_want in zip(got, want, strict=True):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-7)
    # each model is the other's teacher only: a's loss sends b no gradient
    (to_b,) = torch.autograd.grad(mutual_losses(a, b, y, 0.3, 0.8)[0], b, allow_unused=True)
    assert to_b is None or not to_b.any()


def test_a_stacks_mutual_losses_are_each_clients_own_at_its_own_alpha():
    # Three clients, batches of 4 padded to 4, 3 and 2 real samples; α one per client
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    y = torch.randint(0, 5, (3, 4), generator=g)
    real, alpha = [4, 3, 2], torch.tensor([0.5, 1.0, 0.2])
    weights = torch.stack([(torch.arange(4) < k) / k for k in real])

    with stacked_batch(StackedBatch(rows=3, weights=weights)):
        got_a, got_b = mutual_losses(a, b, y, alpha, 0.6)

    assert got_a.shape == got_b.shape == (3,)
    for i, k in enumerate(real):
        want_a = _hand_mutual(a[i, :k], b[i, :k], y[i, :k], alpha[i].item()).mean()
        want_b = _hand_mutual(b[i, :k], a[i, :k], y[i, :k], 0.6).mean()
        assert got_a[i].item() == pytest.approx(want_a.item(), rel=1e-6), i
        assert got_b[i].item() == pytest.approx(want_b.item(), rel=1e-6), i


def test_mutual_losses_build_their_one_hot_on_the_logits_device():
    # The "meta" device stands in for CUDA: a one-hot built on the CPU would not mix with it.
    a, b = torch.randn(2, 4, 3, device="meta"), torch.randn(2, 4, 3, device="meta")
    y = torch.zeros(2, 4, dtype=torch.long, device="meta")
    loss_a, loss_b = mutual_losses(a, b, y, 0.5, 0.5)
    assert loss_a.device.type == loss_b.device.type == "meta" and loss_a.shape == (2,)
