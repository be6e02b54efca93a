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
from coordinator.stacking.pays import RETRY_EVERY, RETRY_WITHIN, Pays


def _ways(pays: Pays, per_sample: dict[bool, float], fits: int) -> list[bool]:
    """The way each of `fits` fits runs, each timed at `per_sample[way]` for 100 samples."""
    out = []
    for _ in range(fits):
        way = pays.stacked("g", "fml's mlp clients")
        pays.record("g", way, per_sample[way] * 100, 100)
        out.append(way)
    return out


def test_a_group_runs_stacked_then_one_by_one_then_the_faster_way():
    # Stacked takes 0.8 of one by one's time: after the two timings, stacked every fit, one
    # by one again every RETRY_EVERY-th (they are within RETRY_WITHIN)
    ways = _ways(Pays(), {True: 0.8, False: 1.0}, 2 * RETRY_EVERY + 1)
    assert ways[:3] == [True, False, True]
    again = [i + 1 for i, w in enumerate(ways) if not w]
    assert again == [2, RETRY_EVERY, 2 * RETRY_EVERY]


def test_a_group_that_is_slower_stacked_runs_one_by_one():
    ways = _ways(Pays(), {True: 1.2, False: 1.0}, 2 * RETRY_EVERY)
    assert ways[:3] == [True, False, True]
    assert [i + 1 for i, w in enumerate(ways) if w] == [1, 3, RETRY_EVERY, 2 * RETRY_EVERY]


def test_the_slower_way_is_not_timed_again_when_it_is_far_slower():
    far = RETRY_WITHIN * 1.01
    ways = _ways(Pays(), {True: far, False: 1.0}, 3 * RETRY_EVERY)
    assert [i + 1 for i, w in enumerate(ways) if w] == [1, 3]


def test_the_first_fit_is_not_counted_and_a_later_timing_turns_the_choice(caplog):
    pays = Pays()
    # The first (stacked) fit is slow, as one-off costs make it: ignored
    assert pays.stacked("g", "fml's mlp clients")
    pays.record("g", True, 100.0, 100)
    assert not pays.stacked("g", "fml's mlp clients")
    pays.record("g", False, 1.0, 100)
    assert pays.stacked("g", "fml's mlp clients")
    pays.record("g", True, 0.5, 100)
    assert pays.ratio("g") == 0.5

    # A load comes: the retried way is timed faster, and the choice turns (said once)
    with caplog.at_level(logging.INFO, logger="coordinator.stacking.pays"):
        while pays.stacked("g", "fml's mlp clients"):
            pays.record("g", True, 1.5, 100)  # stacked slows down under the load
        pays.record("g", False, 1.0, 100)
        assert not pays.stacked("g", "fml's mlp clients")
    assert [r.getMessage() for r in caplog.records] == [
        "fml's mlp clients train stacked: stacked, a training sample took 0.50× its time one "
        "by one",
        "fml's mlp clients train one by one: stacked, a training sample took 1.50× its time "
        "one by one",
    ]


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
def test_evaluation_and_finalize_stack_whatever_the_fits_do(monkeypatch, auto):
    calls = []
    run_stacked = groups.run_stacked

    def slow(algos, phase, *args, **kwargs):
        calls.append(phase)
        time.sleep(0.3 if phase == "fit" else 0)
        return run_stacked(algos, phase, *args, **kwargs)

    monkeypatch.setattr(groups, "run_stacked", slow)
    cfg = tiny_config(algorithm="fedavg", rounds=4, local_epochs=1, parallel=1, cohort_auto=auto)
    simulate(cfg, progress=False)
    assert calls.count("finalize") == 1 and calls.count("evaluate") >= 4
