"""How many CPU threads the SDK uses: the cores the process may run on, at most
OMP_NUM_THREADS; never the machine's core count alone."""

import os

import pytest

from coordinator.fleet import LocalFleet
from edge_sdk.device import cpu_threads


@pytest.fixture
def three_of_sixty_four(monkeypatch):
    """A process allowed on 3 cores of a 64-core machine (a container, `taskset`)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize(
    ("omp", "threads"),
    [(None, 3), ("2", 2), ("8", 3), ("1,4", 1), ("0", 3), ("many", 3), (" 2 ", 2)],
)
def test_cpu_threads_are_the_allowed_cores_at_most_omp_num_threads(
    three_of_sixty_four, omp, threads
):
    environ = {} if omp is None else {"OMP_NUM_THREADS": omp}
    assert cpu_threads(environ) == threads


def test_cpu_threads_read_the_process_environment(three_of_sixty_four, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads() == 2


def test_a_local_fleet_trains_as_many_groups_at_once_as_the_process_has_threads(
    three_of_sixty_four,
):
    assert LocalFleet([]).parallel == 3
