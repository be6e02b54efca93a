"""Robust combination of updates, against values worked out by hand."""

import math

import pytest
import torch

from edge_sdk import robust
from edge_sdk.robust import (
    RobustError,
    clip_scales,
    clipped,
    coordinate_median,
    krum,
    krum_needs,
    state_norm,
    trimmed_mean,
    update_norms,
)


def _s(*values, steps=0):
    return {"w": torch.tensor(values, dtype=torch.float32), "n": torch.tensor(steps)}


def test_update_norms_are_float64_l2_norms_of_the_float_tensors_and_do_not_overflow():
    start = _s(0.0, 0.0)
    assert update_norms([_s(3.0, 4.0, steps=9)], [start]) == [5.0]  # the counter is no update
    huge = _s(3e38, 3e38)
    (norm,) = update_norms([huge], [start])
    assert math.isfinite(norm) and norm == pytest.approx(3e38 * math.sqrt(2), rel=1e-6)
    assert state_norm(_s(6.0, 8.0)) == 10.0


def test_update_norms_stack_as_many_states_as_the_limit_holds_each_once(monkeypatch):
    calls: list[int] = []
    key_norms = robust._key_norms

    def counted(states, starts, key):
        calls.append(len(states))
        return key_norms(states, starts, key)

    monkeypatch.setattr(robust, "_key_norms", counted)
    monkeypatch.setattr(robust, "_STACK_ELEMENTS", 4)
    one = [_s(float(i)) for i in range(5)]  # an element each: four at a time, then the fifth
    assert update_norms(one, [None] * 5) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert calls == [4, 1]
    calls.clear()
    three = [_s(0.0, 3.0, 4.0)] * 3  # three elements each: one at a time
    assert update_norms(three, [None] * 3) == [5.0] * 3 and calls == [1, 1, 1]
    assert update_norms([{"n": torch.tensor(3)}], [None]) == [0.0]  # no float tensor: no update


@pytest.mark.parametrize("limit", [1 << 24, 8, 1])  # all at once; a few elements at a time
def test_stacked_norms_and_order_statistics_equal_them_tensor_by_tensor(monkeypatch, limit):
    # Prepare: five states of one architecture (three starts, one of them None: zero) and two
    # of another, interleaved; the expected values computed a state and a tensor at a time.
    monkeypatch.setattr(robust, "_STACK_ELEMENTS", limit)
    g = torch.Generator().manual_seed(0)

    def state(*keys):
        shapes = {"a": (3, 4), "b": (5,), "c": (7,), "t": ()}  # t: a scalar parameter
        return {k: torch.randn(shapes[k], generator=g) for k in keys} | {"n": torch.tensor(2)}

    ab = [state("a", "b") for _ in range(5)]
    c = [state("c", "t") for _ in range(2)]
    start, other, c_start = state("a", "b"), state("a", "b"), state("c", "t")
    states = [ab[0], c[0], ab[1], ab[2], c[1], ab[3], ab[4]]
    starts = [start, c_start, start, other, c_start, None, start]

    def norm(s, st):
        total = sum(
            float(((s[k].double() - (0 if st is None else st[k].double())) ** 2).sum())
            for k in s
            if k != "n"
        )
        return math.sqrt(total)

    # Execute / Assert
    assert update_norms(states, starts) == pytest.approx(
        [norm(s, st) for s, st in zip(states, starts, strict=True)], rel=1e-12
    )
    median, trimmed = coordinate_median(ab), trimmed_mean(ab, 0.2)  # five: cut one at each end
    for k in "ab":
        values = torch.stack([s[k] for s in ab]).sort(dim=0).values
        torch.testing.assert_close(median[k], values[2])
        torch.testing.assert_close(trimmed[k], values[1:4].mean(dim=0))
    assert int(median["n"]) == int(trimmed["n"]) == 2


def test_clip_scales_bound_each_norm_at_the_factor_times_the_median():
    # median 2: the bound is 6; 60 is scaled by 6/60, the others are not touched
    assert clip_scales([1.0, 2.0, 60.0], 3.0) == [1.0, 1.0, 0.1]
    assert clip_scales([1.0, 2.0, 6.0], 3.0) == [1.0, 1.0, 1.0]  # at the bound: kept
    assert clip_scales([1.0, 2.0, 60.0], 0.0) == [1.0, 1.0, 1.0]  # 0: off
    assert clip_scales([60.0], 3.0) == [1.0]  # alone: nothing to compare with
    assert clip_scales([1.0, 3.0], 1.0) == [1.0, 2.0 / 3.0]  # two compare: median 2, bound 2
    with pytest.raises(ValueError, match="shorter"):  # a size for every norm, or none
        clip_scales([1.0, 2.0, 60.0], 3.0, sizes=[1.0, 1.0])
    # relative to each model's size: 6/3 = 2 and 1/1 = 1, 40/1 = 40; median 2, bound 6·size
    assert clip_scales([6.0, 1.0, 40.0], 3.0, sizes=[3.0, 1.0, 1.0]) == [1.0, 1.0, 6.0 / 40.0]


def test_clipped_scales_the_update_only_and_leaves_a_kept_state_as_it_is():
    start, state = _s(1.0, 1.0, steps=2), _s(5.0, -3.0, steps=7)
    out = clipped(state, start, 0.25)
    assert out["w"].tolist() == [2.0, 0.0] and out["n"].item() == 7
    assert clipped(state, start, 1.0)["w"] is state["w"]


def test_coordinate_median_and_trimmed_mean_by_hand():
    states = [_s(1.0, 10.0, steps=1), _s(2.0, -5.0, steps=4), _s(100.0, 0.0, steps=2)]
    med = coordinate_median(states)
    assert med["w"].tolist() == [2.0, 0.0] and med["n"].item() == 4
    even = coordinate_median([*states, _s(3.0, 1.0)])
    assert even["w"].tolist() == [2.5, 0.5]  # the mean of the two middle values
    four = [_s(1.0), _s(2.0), _s(3.0), _s(1000.0)]
    assert trimmed_mean(four, 0.25)["w"].tolist() == [2.5]  # one cut at each end: (2 + 3) / 2
    assert trimmed_mean(four, 0.2)["w"].tolist() == [251.5]  # ⌊0.8⌋ = 0 cut: the mean
    with pytest.raises(RobustError, match="leaves none of 2"):
        trimmed_mean([_s(1.0), _s(2.0)], 0.5)


def test_weighted_median_and_trimmed_mean_give_a_light_value_its_weight_by_hand():
    four = [_s(1.0), _s(2.0), _s(3.0), _s(1000.0)]
    light = [1.0, 1.0, 1.0, 0.01]  # 1000 weighs little: half of 3.01 lies at 2
    assert coordinate_median(four, light)["w"].tolist() == [2.0]
    assert coordinate_median(four, [1.0] * 4)["w"].tolist() == [2.5]  # equal: the usual median
    # β = 0.25 of 4: a quarter of the weight 3.1 (0.775) cut at each end: 1 keeps 0.225, 2 all,
    # 3 keeps 0.325, 1000 nothing
    got = trimmed_mean(four, 0.25, [1.0, 1.0, 1.0, 0.1])["w"].item()
    assert got == pytest.approx((0.225 * 1 + 2 + 0.325 * 3) / 1.55)
    with pytest.raises(RobustError, match="weigh nothing"):
        coordinate_median(four, [0.0] * 4)


def test_krum_chooses_the_update_nearest_to_its_neighbours():
    states = [_s(0.0), _s(1.0), _s(2.0), _s(3.0), _s(100.0)]
    # f = 1: each scores its n - f - 2 = 2 nearest: 0 -> 1 + 4 = 5, 1 -> 1 + 1 = 2, 2 -> 2,
    # 3 -> 1 + 4 = 5, 100 -> 97² + 98²; the first of the lowest is chosen
    index, state = krum(states, 1)
    assert index == 1 and state["w"].tolist() == [1.0]
    assert krum_needs(1) == 5
    with pytest.raises(RobustError, match=r"at least 7 updates \(2f \+ 3\); this round has 5"):
        krum(states, 2)
    # squared distances: of 0, 1, 5, 8, 11, 1 scores 1² + 4² = 17 and 8 scores 3² + 3² = 18
    # (cubed, 8 would win: 27 + 27 = 54 against 1 + 64 = 65)
    index, _ = krum([_s(float(v)) for v in (0, 1, 5, 8, 11)], 1)
    assert index == 1


def test_trimmed_mean_gives_a_cut_value_no_weight_at_all():
    # 49 equal weights, β = 0.03: one cut at each end; 1/49 · 49 rounds below 1 in floating
    # point, and a cut -3e38 weighing 1e-16 of a state would still move the mean by 7e20
    states = [_s(1.0)] * 47 + [_s(-3e38), _s(3e38)]
    assert trimmed_mean(states, 0.03)["w"].tolist() == [1.0]


def test_a_single_state_is_its_own_median_and_trimmed_mean_and_none_is_refused():
    only = _s(1.0, -2.0, steps=3)
    for out in (coordinate_median([only]), trimmed_mean([only], 0.2)):
        assert out["w"].tolist() == [1.0, -2.0] and out["n"].item() == 3
    for aggregate in (coordinate_median, lambda states: trimmed_mean(states, 0.2)):
        with pytest.raises(RobustError, match=r"^no updates to aggregate$"):
            aggregate([])


def test_weights_count_in_float64_and_a_zero_weight_counts_nothing():
    four = [{"w": torch.tensor([v], dtype=torch.float64)} for v in (1.0, 2.0, 3.0, 1000.0)]
    got = trimmed_mean(four, 0.25, [1.0, 1.0, 1.0, 0.1])["w"].item()
    assert got == pytest.approx((0.225 * 1 + 2 + 0.325 * 3) / 1.55, rel=1e-12)  # 0.1 as float64
    assert coordinate_median(four, [1.0, 1.0, 1.0, 0.0])["w"].item() == 2.0  # half of 3 at 2
    # 1 is cut (a quarter of the weight 3: 0.75 of it), 1000 weighs nothing: (0.25 + 2 + 0.75)/1.5
    assert trimmed_mean(four, 0.25, [1.0, 1.0, 1.0, 0.0])["w"].item() == 2.0
    assert coordinate_median(four, [0.25] * 4)["w"].item() == 2.5  # weights of sum 1 are weights


def test_a_cumulative_weight_within_a_billionth_of_half_counts_as_half():
    # weights 1 ∓ 2e-9 and the rest of 2: the weight at or below 1 is half, within the
    # tolerance (1e-9 of the total) at either end, so the median is the mean of 1 and 3
    for first in (1.0 - 2e-9, 1.0 + 2e-9):
        weights = [first, 2.0 - first]
        assert sum(weights) == 2.0
        assert coordinate_median([_s(1.0), _s(3.0)], weights)["w"].tolist() == [2.0]
    # beyond it, one value has more than half the weight
    assert coordinate_median([_s(1.0), _s(3.0)], [1.0 + 4e-9, 1.0 - 4e-9])["w"].tolist() == [1.0]


@pytest.mark.parametrize(
    ("limit", "runs"),
    [
        (34, [["a", "b"], ["c", "d"]]),  # 24 + 10 = 34 fits; 34 + 14 does not
        (30, [["a"], ["b", "c", "d"]]),  # 10 + 14 + 6 = 30 fits
        (10, [["a"], ["b"], ["c"], ["d"]]),  # each larger than the limit alone
    ],
)
def test_the_order_statistics_sort_runs_of_tensors_of_at_most_the_stack_limit(
    monkeypatch, limit, runs
):
    # over two states, tensors of 12, 5, 7 and 3 elements hold 24, 10, 14 and 6 values
    monkeypatch.setattr(robust, "_STACK_ELEMENTS", limit)
    first = {k: torch.zeros(m) for k, m in zip("abcd", (12, 5, 7, 3), strict=True)}
    assert robust._runs(first, list("abcd"), 2) == runs
