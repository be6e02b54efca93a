"""Equal budgets: the training samples each algorithm processes, counted on the device and
reported in its finalize reply (`samples_processed`), against counts written out here."""

import math

import pytest
import torch

from coordinator.stacking.cohort import run_stacked
from edge_sdk.algorithms import ClientContext, algorithm_class
from edge_sdk.algorithms.members import CohortUnsupported
from edge_sdk.algorithms.pfml import PFMLConfig
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

FEATURES, CLASSES = 6, 3
MLR = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))
MLP = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,), kwargs={"hidden": [8]})
N = 30  # training samples
ROUNDS, EPOCHS, BATCH = 3, 2, 8
FT = 5  # the guard's fine-tuning of the federation's final model: epochs after the last round


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n + 12) % CLASSES
    x = torch.randn(n + 12, FEATURES, generator=g) + y.view(-1, 1)
    return ClientData(x[:n], y[:n], x[n : n + 6], y[n : n + 6], x[n + 6 :], y[n + 6 :], CLASSES)


def _client(name, spec=MLR, n=N, seed=0, students=False, **cfg):
    """A client of `name`. Without `students`, its guard makes none: a device whose guard's
    default is outside its budget (the MLR global model on an MLP device here) deploys a
    student of it, whose passes the tests below count apart."""
    cls = algorithm_class(name)
    if not students and "guard_distill_epochs" in cls.config_cls.model_fields:
        cfg = {"guard_distill_epochs": 0, **cfg}
    cpu = torch.device("cpu")
    ctx = ClientContext(f"c{seed}", spec, _data(n, seed), cpu, seed, Trainer(cpu, seed=seed))
    return cls(ctx, cls.config_cls(**cfg))


def _glob(spec=MLR):
    return {"global": WireModel.of(spec, build(spec, seed=3))}


def _run(client, models):
    for r in range(1, ROUNDS + 1):
        client.fit(r, ROUNDS, models)
    return client.finalize(ROUNDS, ROUNDS, models).details["samples_processed"]


EPOCHS_CFG = {"local_epochs": EPOCHS, "batch_size": BATCH}


@pytest.mark.parametrize(("name", "models"), [("local", {}), ("fedavg", _glob())])
def test_epoch_trained_algorithms_process_rounds_times_epochs_passes(name, models):
    assert _run(_client(name, MLR, **EPOCHS_CFG), models) == ROUNDS * EPOCHS * N


def test_fml_adds_the_guards_fine_tuning_epochs_by_default():
    assert _run(_client("fml", MLP, **EPOCHS_CFG), _glob()) == (ROUNDS * EPOCHS + FT) * N


def test_the_guards_students_of_a_default_outside_the_budget_are_counted():
    # By default: the weighed default outside the MLP device's budget is distilled into two
    # students of 40 epochs (one from the personalized model, one afresh); features, so one view
    # of each sample an epoch
    client = _client("fml", MLP, students=True, **EPOCHS_CFG)
    assert client.config.guard_distill_epochs == 40
    assert _run(client, _glob()) == (ROUNDS * EPOCHS + FT + 2 * 40) * N


@pytest.mark.parametrize(("ft", "guard"), [(3, True), (0, True), (3, False)])
def test_the_guards_fine_tuning_is_counted_and_only_when_it_runs(ft, guard):
    client = _client("fml", MLP, guard_ft_epochs=ft, guard=guard, **EPOCHS_CFG)
    assert _run(client, _glob()) == (ROUNDS * EPOCHS + (ft if guard else 0)) * N


def test_fedavg_ft_adds_its_fine_tuning_epochs():
    client = _client("fedavg_ft", ft_epochs=4, **EPOCHS_CFG)
    assert _run(client, _glob()) == (ROUNDS * EPOCHS + 4) * N


def test_fedme_counts_each_batch_once_though_two_models_learn_from_it():
    models = {"personal": _glob()["global"], "exchanged": _glob(MLP)["global"]}
    # FedMe's guard fine-tunes its aggregate 20 epochs by default (FedMeConfig)
    assert _run(_client("fedme", **EPOCHS_CFG), models) == (ROUNDS * EPOCHS + 20) * N


def test_persfl_stage_two_costs_its_grid_times_the_local_budget():
    # λ ∈ {0, 0.5}, T ∈ {1, 2}: λ = 0 once, so 3 students, each trained rounds × epochs.
    client = _client(
        "persfl", MLP, distill_lambdas=[0.0, 0.5], distill_temperatures=[1.0, 2.0], **EPOCHS_CFG
    )
    assert client.config.distill_epochs is None
    assert _run(client, _glob()) == (ROUNDS * EPOCHS + FT) * N + 3 * ROUNDS * EPOCHS * N


def test_persfl_distill_epochs_when_set_replaces_the_local_budget():
    client = _client("persfl", MLP, distill_lambdas=[0.0], distill_epochs=5, **EPOCHS_CFG)
    assert _run(client, _glob()) == (ROUNDS * EPOCHS + FT) * N + 5 * N


def test_pfml_counts_its_iterations_of_one_batch():
    client = _client("pfml", MLP, local_iterations=5, batch_size=BATCH, lr=0.05)
    assert client.iterations() == 5
    assert _run(client, _glob()) == ROUNDS * 5 * BATCH + FT * N


@pytest.mark.parametrize("n", [30, 32, 5])
def test_pfml_local_epochs_are_as_many_iterations_as_the_epochs_take_batches(n):
    client = _client("pfml", MLP, n=n, local_epochs=EPOCHS, batch_size=BATCH, lr=0.05)
    iterations = math.ceil(EPOCHS * n / BATCH)
    assert client.iterations() == iterations
    assert _run(client, _glob()) == ROUNDS * iterations * min(BATCH, n) + FT * n


def test_pfml_iterations_alone_turn_epochs_off_and_epochs_win_when_both_are_set():
    assert PFMLConfig(local_iterations=7).local_epochs is None
    both = PFMLConfig(local_iterations=7, local_epochs=2)
    assert both.local_epochs == 2
    assert PFMLConfig().local_epochs == PFMLConfig.model_fields["local_epochs"].default


def test_pfml_members_whose_epochs_differ_in_iterations_do_not_stack():
    # 30 and 41 samples: 8 and 11 iterations of 8 for two epochs; they train one by one.
    cfg = {"local_epochs": EPOCHS, "batch_size": BATCH, "lr": 0.05}
    members = [_client("pfml", MLP, n=n, seed=i, **cfg) for i, n in enumerate((30, 41))]
    with pytest.raises(CohortUnsupported, match="iterations"):
        run_stacked(members, "fit", 1, ROUNDS, [_glob()] * 2)
    assert [m.ctx.trainer.samples for m in members] == [0, 0]
