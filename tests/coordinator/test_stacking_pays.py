"""Whether a group trains stacked is timed on the run: stacked first, one by one once, then the
faster way, the other timed again now and then while they are close.

Issue 48 measured stacking losing to client by client (three small groups of small models on
two worker threads: 1.19× the time) with nothing to turn it off but a whole-run setting.
"""

from __future__ import annotations

import logging
import time

import pytest
from tests_helpers import tiny_config

import coordinator.stacking.groups as groups
from coordinator.simulator import simulate
from coordinator.stacking.pays import RETRY_EVERY, RETRY_WITHIN, WINDOW, Pays


def _ways(pays: Pays, per_sample: dict[bool, float], fits: int) -> list[bool]:
    """The way each of `fits` fits runs, each timed at `per_sample[way]` for 100 samples."""
    out = []
    for _ in range(fits):
        way = pays.stacked("g", "fml's mlp clients")
        pays.record("g", way, per_sample[way] * 100, 100)
        out.append(way)
    return out


def test_a_group_runs_stacked_then_one_by_one_then_the_faster_way():
    # Stacked takes 0.8 of one by one's time: two fits each way, then stacked every fit, one by
    # one again for two fits every RETRY_EVERY (they are within RETRY_WITHIN)
    ways = _ways(Pays(), {True: 0.8, False: 1.0}, 2 * RETRY_EVERY + 2)
    assert ways[:5] == [True, True, False, False, True]
    again = [i + 1 for i, w in enumerate(ways) if not w]
    assert again == [3, 4, RETRY_EVERY, RETRY_EVERY + 1, 2 * RETRY_EVERY, 2 * RETRY_EVERY + 1]


def test_a_group_that_is_slower_stacked_runs_one_by_one():
    ways = _ways(Pays(), {True: 1.2, False: 1.0}, 2 * RETRY_EVERY)
    assert ways[:5] == [True, True, False, False, False]
    assert [i + 1 for i, w in enumerate(ways) if w] == [1, 2, RETRY_EVERY, RETRY_EVERY + 1, 20]


def test_the_slower_way_is_not_timed_again_when_it_is_far_slower():
    far = RETRY_WITHIN * 1.01
    ways = _ways(Pays(), {True: far, False: 1.0}, 3 * RETRY_EVERY)
    assert [i + 1 for i, w in enumerate(ways) if w] == [1, 2]


def test_only_a_ways_second_fit_in_a_row_counts_and_a_later_timing_turns_the_choice(caplog):
    pays = Pays()
    label = "fml's mlp clients"
    # The first fit each way pays for the switch (the stacks built, the tensors laid out
    # again): ignored, however slow
    assert pays.stacked("g", label)
    pays.record("g", True, 100.0, 100)
    assert pays.stacked("g", label)
    pays.record("g", True, 0.5, 100)
    assert not pays.stacked("g", label)
    pays.record("g", False, 100.0, 100)
    assert pays.ratio("g") is None
    assert not pays.stacked("g", label)
    pays.record("g", False, 1.0, 100)
    assert pays.ratio("g") == 0.5
    assert pays.settled("g") is True  # (not yet said: the next fit settles it)

    # A load comes: stacked is timed slower (its first fit after the switch not counted), and
    # once the mean of its timings, (0.5 + 2.5) / 2 = 1.5 of one by one's, is the slower, the
    # choice turns (each said once); the other phases follow
    with caplog.at_level(logging.INFO, logger="coordinator.stacking.pays"):
        assert pays.stacked("g", label)
        pays.record("g", True, 9.0, 100)  # after the switch: not counted
        assert pays.stacked("g", label)
        pays.record("g", True, 2.5, 100)
        assert not pays.stacked("g", label)
    assert pays.ratio("g") == 1.5 and pays.settled("g") is False
    assert [r.getMessage() for r in caplog.records] == [
        "fml's mlp clients train stacked: stacked, a training sample took 0.50× its time one "
        "by one",
        "fml's mlp clients train one by one: stacked, a training sample took 1.50× its time "
        "one by one",
    ]


def test_the_ways_are_compared_by_the_mean_of_their_last_timings():
    pays = Pays()
    ways = []
    # stacked 1.0, 1.0 per sample; one by one 0.9, then one noisy 1.3: mean 1.1 > 1.0 turns
    # it back to stacked; only the last WINDOW count
    for per in [1.0, 1.0, 0.9, 0.9, 1.3]:
        way = pays.stacked("g", "x")
        ways.append(way)
        pays.record("g", way, per, 1)
    assert ways == [True, True, False, False, False]
    assert pays.ratio("g") == pytest.approx(1.0 / ((0.9 + 1.3) / 2))
    assert pays.stacked("g", "x")
    for _ in range(WINDOW + 1):
        pays.record("g", True, 2.0, 1)
        pays._groups["g"].streak = 2  # (as if each were a second fit in a row)
    assert pays.ratio("g") == pytest.approx(2.0 / 1.1)


def test_a_fleet_trains_a_group_one_by_one_where_stacking_is_slower(monkeypatch):
    # Prepare: stacking made slow (a sleep per stacked call, far beyond its clients' work)
    calls = []
    run_stacked = groups.run_stacked

    def slow(algos, phase, *args, **kwargs):
        calls.append(phase)
        time.sleep(0.3)
        return run_stacked(algos, phase, *args, **kwargs)

    monkeypatch.setattr(groups, "run_stacked", slow)
    flags = dict(algorithm="fedavg", rounds=6, local_epochs=1, threads=1, parallel=1, baselines=[])

    # Execute
    timed = simulate(tiny_config(**flags), progress=False)
    fits_timed = calls.count("fit")
    calls.clear()
    pinned = simulate(tiny_config(**flags, cohort_auto=False), progress=False)
    alone = simulate(tiny_config(**flags, cohort=False), progress=False)

    # Assert: timed, it stacked only its first and third fits; pinned, every fit; the same
    # accuracies every way (mlr: to the bit)
    assert fits_timed == 2
    assert calls.count("fit") == 6
    acc = [c.personal_acc for c in alone.clients]
    assert [c.personal_acc for c in timed.clients] == acc
    assert [c.personal_acc for c in pinned.clients] == acc


@pytest.mark.parametrize("auto", [True, False])
def test_evaluation_and_finalize_follow_the_fits_choice(monkeypatch, auto):
    # Prepare: stacked fits made slow
    calls = []
    run_stacked = groups.run_stacked

    def slow(algos, phase, *args, **kwargs):
        calls.append((phase, args[0]))
        time.sleep(0.3 if phase == "fit" else 0)
        return run_stacked(algos, phase, *args, **kwargs)

    monkeypatch.setattr(groups, "run_stacked", slow)
    flags = dict(algorithm="fedavg", rounds=6, local_epochs=1, threads=1, parallel=1)
    cfg = tiny_config(**flags, baselines=[], cohort_auto=auto)

    # Execute
    simulate(cfg, progress=False)

    # Assert: timed, the evaluations stack until the fits settle one by one (after fit 4),
    # and the finalize runs one by one; pinned, everything stacks
    evaluated = sorted(r for phase, r in calls if phase == "evaluate")
    finalized = [r for phase, r in calls if phase == "finalize"]
    if auto:
        assert evaluated and max(evaluated) <= 4 and finalized == []
    else:
        assert len(evaluated) >= 6 and finalized == [6]
