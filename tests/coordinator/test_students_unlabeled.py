"""The coordinator's unlabeled inputs for the guard's students (`guard_distill_unlabeled`) in FML,
PFML, PersFL and FedeRiCo, as FedMe has them: one seeded draw carried by every finalize task,
held out of a simulation's dataset unless a file names them, and refused where the coordinator
sends none. (FedMe's own are tests/coordinator/test_fedme_strategy.py's.)"""

import numpy as np
import pytest
import torch
from tests_helpers import raises_exactly, tiny_config

from coordinator.federation import prepare_federation
from coordinator.server_data import ServerData
from coordinator.strategies import ClientInfo, StrategyError, strategy_class
from edge_sdk.algorithms import algorithm_class
from edge_sdk.algorithms.deployment import UNLABELED
from edge_sdk.protocol import Capabilities
from model_zoo import ArchSpec

MLR = ArchSpec(family="mlr", num_classes=2, input_shape=(3,))
U = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))


def _strategy(name, unlabeled=U, seed=0, **cfg):
    clients = {
        f"c{i}": ClientInfo(f"c{i}", MLR, Capabilities(n_train=10, num_classes=2)) for i in range(3)
    }
    s = strategy_class(name)(
        algorithm_class(name).config_cls(**cfg),
        clients=clients,
        global_spec=MLR,
        rounds=3,
        seed=seed,
        server_data=ServerData(unlabeled=unlabeled),
    )
    s.setup()
    return s


@pytest.mark.parametrize("name", ["fml", "pfml", "persfl", "federico"])
def test_the_finalize_carries_one_seeded_draw_of_the_inputs_beside_the_global_model(name):
    # Prepare: 40 inputs held, 15 of them for the students
    s = _strategy(name, seed=3, guard_distill_unlabeled=15)

    # Execute
    plan = s.configure_finalize()

    # Assert: one object of the same 15 rows of U, in U's order, drawn from the run's seed
    assert {id(models[UNLABELED]) for models in plan.values()} == {id(plan["c0"][UNLABELED])}
    wire = plan["c0"][UNLABELED]
    assert wire.spec == ArchSpec(
        family="inputs", num_classes=2, input_shape=(3,), kwargs={"count": 15}
    )
    rows = np.sort(np.random.default_rng(3).choice(40, size=15, replace=False))
    assert torch.equal(wire.weights["inputs"], U[torch.from_numpy(rows)])
    # (FedeRiCo's coordinator has no model to send: the inputs alone)
    assert set(plan["c1"]) == ({UNLABELED} if name == "federico" else {"global", UNLABELED})


@pytest.mark.parametrize(
    "cfg",
    [{}, {"guard_distill_unlabeled": 9, "guard_distill_epochs": 0}],
    ids=["off", "no-students"],
)
def test_none_are_carried_by_default_or_where_the_guard_makes_no_students(cfg):
    plan = _strategy("fml", **cfg).configure_finalize()
    assert all(set(models) == {"global"} for models in plan.values())


def test_all_of_a_smaller_set_is_carried():
    plan = _strategy("pfml", guard_distill_unlabeled=100).configure_finalize()
    assert torch.equal(plan["c2"][UNLABELED].weights["inputs"], U)


def test_the_inputs_come_from_the_file_the_config_names(tmp_path):
    np.save(tmp_path / "u.npy", (U + 1).numpy())
    s = _strategy(
        "fml", unlabeled=U, guard_distill_unlabeled=40, unlabeled_path=str(tmp_path / "u.npy")
    )
    assert torch.equal(s.configure_finalize()["c0"][UNLABELED].weights["inputs"], U + 1)


def test_without_inputs_or_with_inputs_of_another_shape_the_run_does_not_start():
    with raises_exactly(
        StrategyError,
        "persfl's guard_distill_unlabeled sends its students inputs of an unlabeled set the "
        "coordinator holds: name a .npy or .safetensors file of inputs in persfl.unlabeled_path",
    ):
        _strategy("persfl", unlabeled=None, guard_distill_unlabeled=5)
    with raises_exactly(  # a deployment of the preset that sets it, without a file of inputs
        StrategyError,
        "fml's guard_distill_unlabeled (200: the preset 'trusted') sends its students inputs of "
        "an unlabeled set the coordinator holds: name a .npy or .safetensors file of inputs in "
        "fml.unlabeled_path",
    ):
        _strategy("fml", unlabeled=None, preset="trusted")
    with pytest.raises(StrategyError, match=r"shape \(4,\) but the clients' models take \(3,\)"):
        _strategy("fml", unlabeled=torch.zeros(5, 4), guard_distill_unlabeled=5)


def test_where_the_coordinator_sends_no_inputs_it_is_refused():
    # a strategy of a plugin's, with a guard, whose finalize tasks carry no inputs
    class Silent(strategy_class("federico")):  # type: ignore[misc, valid-type]
        name = "silent"
        carries_unlabeled = False

    info = {"c0": ClientInfo("c0", MLR, Capabilities(n_train=10, num_classes=2))}
    config = algorithm_class("federico").config_cls(guard_distill_unlabeled=5)
    with raises_exactly(
        StrategyError,
        "silent: guard_distill_unlabeled sends the coordinator's unlabeled inputs with the "
        "finalize tasks, which this algorithm's coordinator does not send (fml, pfml, persfl, "
        "fedme and federico do): set silent.guard_distill_unlabeled = 0",
    ):
        Silent(config, clients=info, global_spec=None, rounds=3, seed=0)


def test_the_inputs_are_held_out_unless_a_file_names_them():
    fml = strategy_class("fml")
    config = algorithm_class("fml").config_cls
    assert fml.unlabeled_holdout(config(guard_distill_unlabeled=60)) == 60
    assert fml.unlabeled_holdout(config(guard_distill_unlabeled=60, unlabeled_path="u.npy")) == 0
    assert fml.unlabeled_holdout(config()) == 0
    federico = algorithm_class("federico").config_cls(guard_distill_unlabeled=60)
    assert strategy_class("federico").unlabeled_holdout(federico) == 60
    assert strategy_class("local").unlabeled_holdout(algorithm_class("local").config_cls()) == 0


@pytest.mark.parametrize(
    ("algorithm", "setting", "n"),
    [("pfml", "pfml.guard_distill_unlabeled", 60), ("fedme", "fedme.unlabeled_size", 100)],
)
def test_a_simulation_holds_the_set_out_of_every_clients_data(algorithm, setting, n):
    plain = prepare_federation(tiny_config(algorithm="fedavg"))
    fed = prepare_federation(tiny_config(algorithm=algorithm, overrides={setting: n}))
    assert fed.server_data.unlabeled is not None and len(fed.server_data.unlabeled) == n
    assert len(fed.dataset) == len(plain.dataset) - n
    held = {tuple(row.tolist()) for row in fed.server_data.unlabeled.flatten(1)}
    for data in fed.client_data:
        for split in (data.x_train, data.x_val, data.x_test):
            assert not held & {tuple(row.tolist()) for row in split.flatten(1)}


@pytest.mark.parametrize("name", ["local", "fedavg"])
def test_a_baseline_without_a_guard_holds_nothing_out_and_its_finalize_carries_no_inputs(name):
    assert strategy_class(name).unlabeled_holdout(algorithm_class(name).config_cls()) == 0
    s = _strategy(name)
    assert all(UNLABELED not in models for models in s.configure_finalize().values())


def test_federicos_devices_receive_the_inputs_and_say_how_many_students_kept_them():
    # FedeRiCo's coordinator sends no models: its finalize tasks carry the inputs alone
    from coordinator.simulator import simulate

    cfg = tiny_config(
        algorithm="federico",
        models=["mlr", "mlp"],
        rounds=2,
        overrides={"federico.guard_distill_unlabeled": 30, "federico.guard_distill_epochs": 2},
    )
    res = simulate(cfg, progress=False)
    assert {c.model_dump()["guard_distill_unlabeled"] for c in res.clients} == {30}
    assert all(c.model_dump()["guard_distill_unlabeled_kept"] in (0, 1, 2) for c in res.clients)
    assert all(c.deployed_arch == c.arch for c in res.clients)
