"""A client's algorithm state survives a restart: saved, loaded, and continued exactly."""

import pytest
import torch

from edge_sdk.algorithms import ClientContext, algorithm_class
from edge_sdk.codec import WireModel
from edge_sdk.state import StateError, load_state, save_state
from edge_sdk.trainer import ClientData, Trainer
from model_zoo import ArchSpec, build

IMG = (1, 8, 8)
MINE = ArchSpec(family="mlp", num_classes=4, input_shape=IMG, kwargs={"hidden": [16]})
GLOBAL = ArchSpec(family="mlr", num_classes=4, input_shape=IMG)


def _data() -> ClientData:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(96) % 4
    x = torch.randn(96, *IMG, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float()
    return ClientData(x[:64], y[:64], x[64:80], y[64:80], x[80:], y[80:], num_classes=4)


def _algorithm(name, seed):
    cls = algorithm_class(name)
    spec = GLOBAL if name in ("local", "fedavg", "fedprox", "fedavg_ft") else MINE
    device = torch.device("cpu")
    ctx = ClientContext("c0", spec, _data(), device, seed, Trainer(device, seed=seed))
    extra = {"local_iterations": 4, "lr": 0.05} if name == "pfml" else {"local_epochs": 1}
    if name == "persfl":
        extra |= {"distill_lambdas": [0.0, 0.5], "distill_temperatures": [1.0, 2.0]}
        extra |= {"distill_epochs": 1}
    return cls(ctx, cls.config_cls(**extra))


def _models(name, round_):
    glob = WireModel.of(GLOBAL, build(GLOBAL, seed=100 + round_))
    if name == "local":
        return {}
    if name == "fedme":
        return {"personal": WireModel.of(MINE, build(MINE, seed=7)), "exchanged": glob}
    return {"global": glob}


def _weights(result):
    return {f"{m}.{k}": v for m, w in result.models.items() for k, v in w.weights.items()}


@pytest.mark.parametrize(
    "name", ["local", "fedavg", "fedprox", "fedavg_ft", "fml", "pfml", "persfl", "fedme"]
)
def test_a_restored_algorithm_continues_exactly_where_the_original_left_off(name, tmp_path):
    # Prepare: one round trained, its state written to disk and read into a new instance of the
    # same client (same seed, as after a restart) that has trained on another task since, so
    # nothing matches by accident.
    original = _algorithm(name, seed=0)
    original.fit(1, 3, _models(name, 1))
    save_state(tmp_path / "state", original.state_dict())
    restored = _algorithm(name, seed=0)
    for r in (1, 2):  # its models and its random generator have moved on
        restored.fit(r, 3, _models(name, 4 + r))
    restored.load_state_dict(load_state(tmp_path / "state"))

    # Execute: both train round 2 on the same task, then finalize.
    a, b = original.fit(2, 3, _models(name, 2)), restored.fit(2, 3, _models(name, 2))
    fa, fb = original.finalize(3, 3, _models(name, 3)), restored.finalize(3, 3, _models(name, 3))

    # Assert: bit-for-bit the same models, metrics and personalized weights.
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.metrics == b.metrics and fa.metrics == fb.metrics and fa.details == fb.details
    pa, pb = original.personalized_model()[1], restored.personalized_model()[1]
    sa, sb = pa.state_dict(), pb.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_momentum_is_part_of_the_state():
    original = _algorithm("fml", seed=0)
    original.fit(1, 3, _models("fml", 1))
    state = original.state_dict()
    momentum = state["opt_personal"]["__optimizer__"]["state"]
    assert momentum and all("momentum_buffer" in v for v in momentum.values())


def test_a_state_file_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a state file")
    with pytest.raises(StateError, match="not an edgefl state file"):
        load_state(bad)
    with pytest.raises(StateError, match="cannot save"):
        save_state(tmp_path / "x", {"opaque": object()})
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_state_files_hold_nested_tensors_and_plain_values(tmp_path):
    state = {"a": [1, 2.5, "x", None, True], "b": {"t": torch.arange(6).view(2, 3)}, "inf": 1e309}
    back = load_state(save_state(tmp_path / "s", state))
    assert back["a"] == [1, 2.5, "x", None, True] and back["inf"] == float("inf")
    assert torch.equal(back["b"]["t"], state["b"]["t"])
