"""PersFL's server half: FedAvg over any client architectures, and the bounded archive of global
models that a client joining after training distils from."""

import pytest
import torch
from tests_helpers import tiny_config

from coordinator.federation import prepare_federation
from coordinator.fleet import NetworkFleet
from coordinator.server import Coordinator, RoundConfig
from coordinator.strategies import ClientInfo, FitReply, IncompatibleClients, strategy_class
from edge_sdk.algorithms import algorithm_class
from edge_sdk.budget import arch_name
from edge_sdk.client import EdgeClient
from edge_sdk.codec import WireModel
from edge_sdk.model_blobs import pack_models
from edge_sdk.node import ClientNode
from edge_sdk.protocol import Capabilities, Task
from edge_sdk.transport import InMemoryBroker
from model_zoo import ArchSpec, build

MLR = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
MLP = ArchSpec(family="mlp", num_classes=3, input_shape=(4,), kwargs={"hidden": [5]})


def _strategy(name="persfl", specs=(MLR, MLP, MLR), **cfg):
    clients = {
        f"c{i}": ClientInfo(f"c{i}", s, Capabilities(n_train=10 * (i + 1), num_classes=3))
        for i, s in enumerate(specs)
    }
    config = algorithm_class(name).config_cls(**cfg)
    s = strategy_class(name)(config, clients=clients, global_spec=MLR, rounds=4, seed=0)
    s.setup()
    return s


def _filled(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in build(MLR).state_dict().items()}


def test_persfl_accepts_clients_of_any_architecture_where_fedavg_refuses():
    assert _strategy("persfl").expected_models("c1") == {"model": MLR}
    with pytest.raises(IncompatibleClients):
        _strategy("fedavg")


def test_persfl_archive_keeps_the_last_global_models_and_survives_a_checkpoint():
    # Prepare: 4 rounds; in round r the clients send r, 2r, 3r (uniform mean: 2r).
    s = _strategy(archive_size=2, weighting="uniform")

    # Execute
    for r in range(1, 5):
        replies = {
            cid: FitReply(cid, {"model": WireModel(MLR, _filled(r * (i + 1)))})
            for i, cid in enumerate(s.clients)
        }
        s.aggregate_fit(r, replies)

    # Assert: rounds 3 and 4 only, each the global model after that round
    archived = s.archived_models()
    assert list(archived) == ["global@3", "global@4"]
    for r in (3, 4):
        assert all(
            torch.allclose(v, torch.full_like(v, 2.0 * r))
            for v in archived[f"global@{r}"].weights.values()
        )
    fresh = _strategy(archive_size=2)
    fresh.load_state_dict(s.state_dict())
    assert list(fresh.archived_models()) == ["global@3", "global@4"]
    assert all(
        torch.equal(fresh.archived_models()["global@3"].weights[k], v)
        for k, v in archived["global@3"].weights.items()
    )


def test_persfl_archive_size_zero_keeps_nothing():
    s = _strategy(archive_size=0)
    s.aggregate_fit(1, {"c0": FitReply("c0", {"model": WireModel(MLR, _filled(1.0))})})
    assert s.archived_models() == {}


def test_persfl_new_participant_personalizes_from_the_archive_after_training():
    # Prepare: a 3-client PersFL federation on digits, mixed architectures.
    cfg = tiny_config(algorithm="persfl", clients=4, rounds=3)
    fed = prepare_federation(cfg)
    broker = InMemoryBroker()
    config = algorithm_class("persfl").config_cls(
        local_epochs=2,
        batch_size=32,
        lr=0.1,
        distill_epochs=2,
        distill_lambdas=[0.0, 0.5],
        distill_temperatures=[2.0],
        archive_size=2,
    )
    coordinator = Coordinator(
        NetworkFleet(broker.connect()),
        algorithm="persfl",
        config=config,
        rounds=3,
        expected_clients=3,
        global_model="mlr",
        round_config=RoundConfig(deadline_s=60, register_timeout_s=30),
    ).open()
    specs = [
        ArchSpec(family=f, num_classes=10, input_shape=(1, 8, 8)) for f in ("mlr", "mlp", "mlr")
    ]
    members = [
        EdgeClient(ClientNode(cid, spec, data, seed=i), broker.connect()).start()
        for i, (cid, spec, data) in enumerate(
            zip(fed.client_ids[:3], specs, fed.client_data[:3], strict=True)
        )
    ]
    coordinator.run()
    for c in members:
        c.stop()
    archive = coordinator.strategy.archived_models()
    # A fourth device joins after training, with an architecture of its own.
    newcomer = EdgeClient(
        ClientNode(
            fed.client_ids[3],
            ArchSpec(family="mlp", num_classes=10, input_shape=(1, 8, 8)),
            fed.client_data[3],
            seed=9,
        ),
        broker.connect(),
    )
    refs, blobs = pack_models(archive)
    task = Task(
        run="default",
        sender="coordinator",
        task_id="late-1",
        round=3,
        rounds=3,
        phase="finalize",
        algorithm="persfl",
        config=config.model_dump(mode="json"),
        models=refs,
    )

    # Execute
    result = newcomer.run_task(task, blobs)

    # Assert: it chose one of the archived rounds and learned its own model well above chance.
    assert list(archive) == ["global@2", "global@3"]
    assert result.details["teacher_round"] in (2, 3)
    assert result.details["student_init"] == "scratch"
    assert result.metrics["personal_correct"] / result.metrics["personal_total"] > 0.5
    assert newcomer.algorithm.trained_model()[0].family == "mlp"  # its student
    # What it deploys is the guard's pick between that student and the teacher, as reported.
    deployed = arch_name(newcomer.algorithm.personalized_model()[0])
    assert deployed == result.details["deployed_arch"]
