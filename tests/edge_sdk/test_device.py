"""Which device a run uses, why, and in what precision; what a client tells the coordinator;
how many CPU threads the SDK uses (the cores the process may run on, at most OMP_NUM_THREADS)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tests_helpers import needs_cuda

from coordinator.fleet import LocalFleet
from edge_sdk.device import autocast_dtype, choose_device, cpu_threads, precision, resolve_device
from edge_sdk.protocol import PROTOCOL_VERSION, Register, decode
from edge_sdk.trainer import Trainer

without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


def test_cpu_is_chosen_when_asked_and_trains_in_float32():
    choice = choose_device("cpu")
    assert (choice.requested, str(choice.device), choice.reason) == ("cpu", "cpu", "asked for cpu")
    assert choice.precision == "float32"
    assert autocast_dtype(torch.device("cpu")) is None
    assert Trainer(torch.device("cpu")).amp is False


@without_cuda
def test_auto_without_cuda_falls_back_to_the_cpu_and_says_so():
    choice = choose_device("auto")
    assert (str(choice.device), choice.reason) == ("cpu", "auto: CUDA is not available")
    with pytest.raises(ValueError, match="'cuda' requested but CUDA is not available"):
        resolve_device("cuda")


def test_an_unknown_device_name_is_refused():
    with pytest.raises(ValueError, match="unknown device 'tpu'; expected 'auto', 'cpu' or 'cuda'"):
        choose_device("tpu")


@needs_cuda
def test_cuda_names_the_card_and_the_autocast_dtype_the_trainer_uses():
    choice = choose_device("auto")
    assert choice.device.type == "cuda"
    assert choice.reason.startswith("auto: CUDA is available (")
    trainer = Trainer(choice.device)
    assert trainer.amp and choice.precision == f"{str(trainer._amp_dtype)[6:]} autocast"
    assert precision(choice.device) in {"bfloat16 autocast", "float16 autocast"}


def test_a_registration_from_a_client_that_names_no_dataset_or_precision_still_decodes():
    # An older client's registration: capabilities without `dataset` and `precision`.
    old = {
        "v": PROTOCOL_VERSION,
        "run": "r",
        "sender": "c0",
        "kind": "register",
        "spec": {"family": "mlr", "num_classes": 10, "input_shape": [1, 8, 8]},
        "capabilities": {"device": "cuda:0", "n_train": 5, "num_classes": 10},
    }
    msg = decode(json.dumps(old).encode())
    assert isinstance(msg, Register)
    caps = msg.capabilities
    assert (caps.device, caps.dataset, caps.precision) == ("cuda:0", None, None)


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
