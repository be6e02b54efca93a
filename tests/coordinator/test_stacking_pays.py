"""`cohort = "auto"` (the default): a group stacks where stacking was measured to pay. On the
CPU a few clients train one by one, said once with why; `always` stacks every group, `never`
none; on a GPU every group stacks.

Before, a simulation stacked every group it could: on 2 CPU cores FML's 12 clients of three
architectures (4 a group) ran 1.14-1.4x slower stacked than one by one
(docs/benchmarks/stacking-contention.md).
"""

from __future__ import annotations

import logging

import pytest
import torch
from tests_helpers import tiny_config

import coordinator.stacking.groups as groups
from coordinator.config import ConfigError
from coordinator.simulator import simulate
from coordinator.stacking.pays import FEWEST_ON_CPU, unpaid
from model_zoo import ArchSpec

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MLR = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
LENET5 = ArchSpec(family="lenet5", num_classes=10, input_shape=(1, 28, 28))
LSTM = ArchSpec(family="lstm", num_classes=10, input_shape=(28, 28))


def _stacked_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the stacks the fleet runs from now on (a spy on `run_stacked`)."""
    sizes: list[int] = []
    run_stacked = groups.run_stacked

    def counted(algos, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(len(algos))
        return run_stacked(algos, *args, **kwargs)

    monkeypatch.setattr(groups, "run_stacked", counted)
    return sizes


def test_on_the_cpu_a_few_clients_train_one_by_one_by_default_said_once_with_why(
    caplog, monkeypatch
):
    # Prepare: 4 mlr clients of FedAvg on the CPU with 2 workers, the default cohort
    flags = dict(rounds=2, local_epochs=1, threads=2, parallel=2)
    sizes = _stacked_calls(monkeypatch)

    # Execute: auto, and one by one
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        auto = simulate(tiny_config(**flags, cohort="auto"), progress=False)
    never = simulate(tiny_config(**flags, cohort="never"), progress=False)

    # Assert: nothing stacked; the log said why, once, for the run's one group; the results
    # are one by one's to the bit
    assert sizes == []
    told = [r.getMessage() for r in caplog.records if r.name.startswith("coordinator.stacking")]
    assert told == [
        "fedavg: 4 clients of mlr train one by one: on the CPU, a stack of linear models "
        f"pays from {FEWEST_ON_CPU['linear']['workers']} clients on "
        '(cohort = "always" stacks it)'
    ]
    assert [c.personal_acc for c in auto.clients] == [c.personal_acc for c in never.clients]


def test_always_stacks_the_same_few_clients(monkeypatch):
    sizes = _stacked_calls(monkeypatch)

    simulate(
        tiny_config(rounds=1, local_epochs=1, threads=2, parallel=2, cohort="always"),
        progress=False,
    )

    # 4 clients, dealt into 2 stacks of 2 for the 2 workers, each phase (fit, evaluate, finalize)
    assert sizes and all(n == 2 for n in sizes)


def test_auto_stacks_a_group_of_linear_models_as_large_as_measured_to_pay_and_never_does_not(
    monkeypatch,
):
    fewest = FEWEST_ON_CPU["linear"]["workers"]
    assert fewest is not None
    flags = dict(clients=fewest, rounds=1, local_epochs=1, threads=2, parallel=2)
    sizes = _stacked_calls(monkeypatch)

    simulate(tiny_config(**flags, cohort="auto"), progress=False)
    stacked = list(sizes)
    sizes.clear()
    simulate(tiny_config(**flags, cohort="never"), progress=False)

    assert stacked and sum(stacked[:2]) == fewest  # the first phase's two dealt stacks
    assert sizes == []


def test_fml_clients_whose_meme_is_convolutional_train_one_by_one_however_many(caplog, monkeypatch):
    # Prepare: as many mlr clients as stack when alone, but each also trains a cnn1 meme
    fewest = FEWEST_ON_CPU["linear"]["workers"]
    assert fewest is not None
    flags = dict(clients=fewest, rounds=1, local_epochs=1, threads=2, parallel=2)
    sizes = _stacked_calls(monkeypatch)

    # Execute
    with caplog.at_level(logging.INFO, logger="coordinator.stacking"):
        simulate(
            tiny_config(**flags, algorithm="fml", global_model="cnn1", cohort="auto"),
            progress=False,
        )

    # Assert: the convolutional rule, said for the mlr clients
    told = [r.getMessage() for r in caplog.records if r.name.startswith("coordinator.stacking")]
    assert sizes == []
    assert told[0].startswith(
        f"fml: {fewest} clients of mlr train one by one: on the CPU with 2 workers"
    )


def test_the_rule_by_device_kind_of_model_size_and_workers():
    linear, conv = FEWEST_ON_CPU["linear"], FEWEST_ON_CPU["convolutional"]
    # A GPU: every group, however small
    assert unpaid([MLR], CUDA, 2, 2) is None and unpaid([LENET5], CUDA, 2, 1) is None
    # The CPU, linear layers alone: from the measured size on, with one worker or several
    for workers, key in ((2, "workers"), (1, "one worker")):
        fewest = linear[key]
        assert fewest is not None
        assert unpaid([MLR], CPU, fewest, workers) is None
        assert unpaid([MLR], CPU, fewest - 1, workers) == (
            f"on the CPU, a stack of linear models pays from {fewest} clients on "
            '(cohort = "always" stacks it)'
        )
    # convolutional: never with several workers; with one, from the measured size on
    assert conv["workers"] is None
    assert unpaid([LENET5], CPU, 1000, 2) == (
        "on the CPU with 2 workers, a stack of convolutional models trains no faster than its "
        'clients one by one (cohort = "always" stacks it)'
    )
    fewest = conv["one worker"]
    assert fewest is not None
    assert unpaid([LENET5], CPU, fewest, 1) is None
    assert unpaid([LENET5], CPU, fewest - 1, 1) is not None
    # a stack of mlr clients that also train a lenet5 (FML's meme) is convolutional
    assert unpaid([MLR, LENET5], CPU, 1000, 2) == unpaid([LENET5], CPU, 1000, 2)
    assert unpaid([MLR, MLR], CPU, 1000, 2) is None
    # anything never measured on the CPU (a recurrent model) trains one by one there
    assert unpaid([MLR, LSTM], CPU, 1000, 1) == (
        'on the CPU, stacking lstm was never measured to pay (cohort = "always" stacks it)'
    )


@pytest.mark.parametrize(
    ("given", "mode"), [(True, "auto"), (False, "never"), ("always", "always"), ("auto", "auto")]
)
def test_cohort_takes_the_switch_it_was_before_auto(given, mode):
    # true stacked every group it could before "auto" existed; it now means stack where it pays
    assert tiny_config(cohort=given).cohort == mode


def test_an_unknown_cohort_names_the_choices():
    with pytest.raises(ConfigError, match="cohort: Input should be 'auto', 'always' or 'never'"):
        tiny_config(cohort="sometimes")
