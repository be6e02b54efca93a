"""Tests for coordinator.metrics: the PersFL thesis's QoI, performance and fairness metrics."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from coordinator.metrics import (
    FAIRNESS_KEYS,
    METRIC_DESCRIPTIONS,
    METRIC_KEYS,
    fairness,
    personalization_metrics,
    qoi,
)

# Thesis Table 5.1 ("Example scenario to help motivate the need for alternative metrics"),
# in percent as printed; 9 users, columns Local Model, FedAvg, Alg.1 .. Alg.4.
TABLE_5_1_LOCAL = [73, 71, 61, 55, 69, 65, 74, 68, 75]
TABLE_5_1_FEDAVG = [78, 75, 69, 71, 74, 77, 80, 82, 85]
TABLE_5_1_ALGS = {
    "Alg.1": [82, 82, 82, 75, 74, 75, 77, 77, 78],
    "Alg.2": [79, 74, 75, 79, 78, 89, 74, 76, 79],
    "Alg.3": [76, 72, 68, 82, 85, 87, 78, 79, 79],
    "Alg.4": [75, 72, 68, 96, 97, 75, 76, 78, 77],
}
# The table's "Avg Acc" row.
TABLE_5_1_AVG = {
    "Local Model": 67.89,
    "FedAvg": 76.78,
    "Alg.1": 78.0,
    "Alg.2": 78.11,
    "Alg.3": 78.44,
    "Alg.4": 79.33,
}


def _fractions(percent: list[int]) -> np.ndarray:
    return np.asarray(percent, dtype=float) / 100.0


def _table_5_1_metrics(alg: str) -> dict:
    return personalization_metrics(
        _fractions(TABLE_5_1_ALGS[alg]), _fractions(TABLE_5_1_FEDAVG), _fractions(TABLE_5_1_LOCAL)
    )


# --- thesis worked example (Table 5.1) -----------------------------------------------------


def test_table_5_1_average_row_matches_transcribed_accuracies() -> None:
    # Prepare
    columns = {"Local Model": TABLE_5_1_LOCAL, "FedAvg": TABLE_5_1_FEDAVG, **TABLE_5_1_ALGS}

    # Execute
    averages = {name: round(float(np.mean(acc)), 2) for name, acc in columns.items()}

    # Assert
    assert averages == TABLE_5_1_AVG


def test_table_5_1_alg4_improves_only_two_of_nine_users() -> None:
    # "Alg.4 only leads to an increase in performance for 2 out of 9 users."
    metrics = _table_5_1_metrics("Alg.4")

    assert metrics["PUI"] == pytest.approx(200 / 9)
    assert metrics["PUD"] == pytest.approx(700 / 9)
    assert metrics["MPI"] == pytest.approx(24.0)
    assert metrics["API"] == pytest.approx(24.0)


def test_table_5_1_alg2_is_best_performing_by_improved_users() -> None:
    # "Although Alg.2 is the best performing algorithm, Alg.1 is the fairest".
    pui = {alg: _table_5_1_metrics(alg)["PUI"] for alg in TABLE_5_1_ALGS}

    assert max(pui, key=pui.__getitem__) == "Alg.2"
    assert pui["Alg.2"] == pytest.approx(500 / 9)


def test_table_5_1_alg1_is_fairest_on_every_fairness_metric() -> None:
    # Prepare
    metrics = {alg: _table_5_1_metrics(alg) for alg in TABLE_5_1_ALGS}

    # Execute
    lowest_av = min(metrics, key=lambda alg: metrics[alg]["AV"])
    highest = {key: max(metrics, key=lambda alg, k=key: metrics[alg][k]) for key in FAIRNESS_KEYS}

    # Assert
    assert lowest_av == "Alg.1"
    assert highest["CS"] == highest["Entropy"] == highest["JI"] == "Alg.1"


def test_table_5_1_alg1_all_metrics_hand_computed() -> None:
    # QoI (pp) = [4, 7, 13, 4, 0, -2, -3, -5, -7]; User4 ties with FedAvg and is in neither set.
    metrics = _table_5_1_metrics("Alg.1")
    acc = np.asarray(TABLE_5_1_ALGS["Alg.1"], dtype=float)

    assert metrics["PUI"] == pytest.approx(400 / 9)
    assert metrics["PUD"] == pytest.approx(400 / 9)
    assert metrics["MPI"] == pytest.approx(5.5)
    assert metrics["API"] == pytest.approx(7.0)
    assert metrics["MPD"] == pytest.approx(-4.0)
    assert metrics["APD"] == pytest.approx(-4.25)
    assert metrics["AV"] == pytest.approx(84 / 9)
    assert metrics["CS"] == pytest.approx(acc.mean() / math.sqrt(np.mean(acc**2)))
    assert metrics["JI"] == pytest.approx(702**2 / (9 * float(np.sum(acc**2))))
    assert metrics["Entropy"] == pytest.approx(-np.sum(acc / 702 * np.log(acc / 702)))
    improved = metrics["fairness_improved"]  # over U+ = [4, 7, 13, 4]
    assert improved["AV"] == pytest.approx(13.5)
    assert improved["JI"] == pytest.approx(28**2 / (4 * 250))
    worsened = metrics["fairness_worsened"]  # over |U-| = [2, 3, 5, 7]
    assert worsened["AV"] == pytest.approx(3.6875)
    assert worsened["JI"] == pytest.approx(17**2 / (4 * 87))


# --- hand-computed cases --------------------------------------------------------------------


def test_personalization_metrics_all_improved() -> None:
    # QoI = [0.9 - 0.7, 0.8 - 0.6] = 20 pp each.
    metrics = personalization_metrics([0.9, 0.8], [0.5, 0.6], [0.7, 0.4])

    assert metrics["PUI"] == pytest.approx(100.0)
    assert metrics["PUD"] == 0.0
    assert metrics["MPI"] == pytest.approx(20.0)
    assert metrics["API"] == pytest.approx(20.0)
    assert metrics["MPD"] is None
    assert metrics["APD"] is None
    assert metrics["fairness_improved"]["JI"] == pytest.approx(1.0)
    assert metrics["fairness_worsened"] is None


def test_personalization_metrics_all_worsened() -> None:
    # QoI = [0.5 - 0.7, 0.3 - 0.6, 0.2 - 0.6] = [-20, -30, -40] pp.
    metrics = personalization_metrics([0.5, 0.3, 0.2], [0.6, 0.6, 0.6], [0.7, 0.4, 0.5])

    assert metrics["PUI"] == 0.0
    assert metrics["PUD"] == pytest.approx(100.0)
    assert metrics["MPI"] is None
    assert metrics["API"] is None
    assert metrics["MPD"] == pytest.approx(-30.0)
    assert metrics["APD"] == pytest.approx(-30.0)
    assert metrics["fairness_improved"] is None
    worsened = metrics["fairness_worsened"]  # over [20, 30, 40]
    assert worsened["AV"] == pytest.approx(200 / 3)
    assert worsened["JI"] == pytest.approx(90**2 / (3 * 2900))
    # Fairness over accuracies [50, 30, 20] percent.
    mean = 100 / 3
    assert metrics["AV"] == pytest.approx(
        ((50 - mean) ** 2 + (30 - mean) ** 2 + (20 - mean) ** 2) / 3
    )
    assert metrics["JI"] == pytest.approx(100**2 / (3 * 3800))


def test_personalization_metrics_mixed_with_a_tie() -> None:
    # QoI = [+10, -10, 0, +30] pp: 2 improved, 1 worsened, 1 tied (in neither set).
    metrics = personalization_metrics(
        [0.8, 0.5, 0.6, 0.9], [0.7, 0.6, 0.6, 0.5], [0.6, 0.4, 0.2, 0.6]
    )

    assert metrics["PUI"] == pytest.approx(50.0)
    assert metrics["PUD"] == pytest.approx(25.0)
    assert metrics["MPI"] == pytest.approx(20.0)
    assert metrics["API"] == pytest.approx(20.0)
    assert metrics["MPD"] == pytest.approx(-10.0)
    assert metrics["APD"] == pytest.approx(-10.0)
    assert metrics["fairness_improved"]["AV"] == pytest.approx(100.0)
    assert metrics["fairness_worsened"] == pytest.approx(
        {"AV": 0.0, "CS": 1.0, "Entropy": 0.0, "JI": 1.0}
    )


def test_personalization_metrics_keys_and_json_ready() -> None:
    metrics = personalization_metrics([0.8, 0.5], [0.7, 0.6], [0.6, 0.4])

    assert set(METRIC_KEYS) <= set(metrics)
    assert set(metrics) - set(METRIC_KEYS) == {"fairness_improved", "fairness_worsened"}
    assert set(METRIC_DESCRIPTIONS) == set(METRIC_KEYS)
    assert all(type(metrics[key]) is float for key in METRIC_KEYS)
    assert json.loads(json.dumps(metrics)) == metrics


def test_personalization_metrics_all_zero_accuracies_leave_fairness_undefined(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="coordinator.metrics"):
        metrics = personalization_metrics([0.0, 0.0], [0.1, 0.2], [0.0, 0.3])

    assert metrics["AV"] == 0.0
    assert metrics["CS"] is None and metrics["Entropy"] is None and metrics["JI"] is None
    assert metrics["PUD"] == pytest.approx(100.0)
    assert "undefined" in caplog.text


def test_qoi_is_on_the_input_fraction_scale() -> None:
    result = qoi([0.9, 0.5, 0.6], [0.7, 0.6, 0.6], [0.8, 0.4, 0.2])

    np.testing.assert_allclose(result, [0.1, -0.1, 0.0])
    assert result[2] == 0.0


def test_fairness_equal_values_are_perfectly_fair() -> None:
    result = fairness([0.7] * 5)

    assert result["AV"] == pytest.approx(0.0)
    assert result["CS"] == pytest.approx(1.0)
    assert result["JI"] == pytest.approx(1.0)
    assert result["Entropy"] == pytest.approx(math.log(5))


def test_fairness_single_value() -> None:
    result = fairness([0.4])

    assert result == pytest.approx({"AV": 0.0, "CS": 1.0, "Entropy": 0.0, "JI": 1.0})
    assert math.copysign(1.0, result["Entropy"]) == 1.0  # no "-0.0" in reports


def test_fairness_hand_computed_with_a_zero() -> None:
    # [0, 1, 3]: mean 4/3, sum of squares 10, shares [0, 1/4, 3/4] (0 log 0 taken as 0).
    result = fairness([0.0, 1.0, 3.0])

    assert result["AV"] == pytest.approx((16 / 9 + 1 / 9 + 25 / 9) / 3)
    assert result["CS"] == pytest.approx((4 / 3) / math.sqrt(10 / 3))
    assert result["JI"] == pytest.approx(16 / 30)
    assert result["Entropy"] == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_fairness_scale_free_except_variance() -> None:
    small = fairness([0.2, 0.5, 0.9])
    large = fairness([20.0, 50.0, 90.0])

    for key in ("CS", "Entropy", "JI"):
        assert large[key] == pytest.approx(small[key])
    assert large["AV"] == pytest.approx(small["AV"] * 1e4)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("personal", "global_", "local", "message"),
    [
        ([0.5, 0.6], [0.5], [0.5, 0.6], "lengths 2, 1 and 2"),
        ([], [], [], "at least one client"),
        ([0.5, float("nan")], [0.5, 0.5], [0.5, 0.5], r"non-finite .* \[1\]"),
        ([0.5, 0.5], [0.5, float("inf")], [0.5, 0.5], "global_ has non-finite"),
        ([0.5, 85.0], [0.5, 0.5], [0.5, 0.5], r"fractions in \[0, 1\].*divide percentages"),
        ([0.5, 0.5], [0.5, 0.5], [-0.1, 0.5], r"local must hold accuracies as fractions"),
        ([0.5, None], [0.5, 0.5], [0.5, 0.5], r"missing \(None\) values at client positions \[1\]"),
        ([[0.5, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], "one-dimensional"),
        ([0.5, "x"], [0.5, 0.5], [0.5, 0.5], "personal must be a sequence of numbers"),
    ],
)
def test_personalization_metrics_rejects_bad_input(personal, global_, local, message) -> None:
    with pytest.raises(ValueError, match=message):
        personalization_metrics(personal, global_, local)
    with pytest.raises(ValueError, match=message):
        qoi(personal, global_, local)


def test_fairness_rejects_negative_values_pointing_to_the_split() -> None:
    with pytest.raises(ValueError, match="absolute worsened values"):
        fairness([4.0, -2.0])


def test_fairness_rejects_all_zero_and_empty() -> None:
    with pytest.raises(ValueError, match="every value is 0"):
        fairness([0.0, 0.0])
    with pytest.raises(ValueError, match="at least one client"):
        fairness([])


def test_accuracy_bounds_are_inclusive_at_one_and_refuse_above_it() -> None:
    assert qoi([1.0], [0.5], [0.5]).tolist() == [0.5]
    with pytest.raises(
        ValueError, match=r"^personal must hold accuracies as fractions in \[0, 1\]"
    ):
        qoi([1.5], [0.5], [0.5])
    with pytest.raises(ValueError, match=r"^personal, global_ and local must have one value per"):
        qoi([0.5], [0.5, 0.5], [0.5])


def test_improvements_below_one_percentage_point_still_count() -> None:
    # QoI of +0.5 and −0.5 percentage points: one improved, one worsened.
    m = personalization_metrics([0.505, 0.495], [0.5, 0.5], [0.4, 0.4])
    assert m["PUI"] == pytest.approx(50.0) and m["PUD"] == pytest.approx(50.0)
    assert m["API"] == pytest.approx(0.5) and m["APD"] == pytest.approx(-0.5)


def test_fairness_is_computed_when_every_accuracy_is_below_one_percent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="coordinator.metrics"):
        m = personalization_metrics([0.005, 0.005], [0.001, 0.001], [0.001, 0.001])
    assert m["JI"] == pytest.approx(1.0) and not caplog.text
    with caplog.at_level(logging.WARNING, logger="coordinator.metrics"):
        personalization_metrics([0.0, 0.0], [0.1, 0.2], [0.0, 0.3])
    assert caplog.messages == [
        "every personalized accuracy is 0: AV is 0 and CS, Entropy and JI are undefined"
    ]


def test_error_messages_name_the_input_and_the_remedy() -> None:
    with pytest.raises(ValueError, match=r"^values has non-finite values at client positions"):
        fairness([1.0, float("nan")])
    with pytest.raises(
        ValueError,
        match=r"to the improved values and to the absolute worsened values separately "
        r"\(see personalization_metrics\)$",
    ):
        fairness([4.0, -2.0])
    with pytest.raises(ValueError, match=r"For QoI, apply it"):
        fairness([4.0, -2.0])
    with pytest.raises(
        ValueError,
        match=r"^fairness is undefined when every value is 0 "
        r"\(CS, Entropy and JI divide by zero\)$",
    ):
        fairness([0.0])
    with pytest.raises(
        ValueError,
        match=r"; every client needs a number \(run the local and global baselines for all "
        r"clients\)$",
    ):
        personalization_metrics([0.5, None], [0.5, 0.5], [0.5, 0.5])
