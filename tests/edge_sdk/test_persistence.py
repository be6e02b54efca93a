"""A client's algorithm state survives a restart: saved, loaded, and continued exactly."""

import json

import pytest
import safetensors
import safetensors.torch
import torch

from coordinator.stacking.cohort import run_stacked
from edge_sdk.algorithms import AlgorithmError, ClientContext, algorithm_class
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.state import StateError, load_state, save_state
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

IMG = (1, 8, 8)
MINE = ArchSpec(family="mlp", num_classes=4, input_shape=IMG, kwargs={"hidden": [16]})
GLOBAL = ArchSpec(family="mlr", num_classes=4, input_shape=IMG)


def _data() -> ClientData:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(96) % 4
    x = torch.randn(96, *IMG, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float()
    return ClientData(x[:64], y[:64], x[64:80], y[64:80], x[80:], y[80:], num_classes=4)


def _algorithm(name, seed, **cfg):
    cls = algorithm_class(name)
    spec = GLOBAL if name in ("local", "fedavg", "fedprox", "fedavg_ft") else MINE
    device = torch.device("cpu")
    ctx = ClientContext("c0", spec, _data(), device, seed, Trainer(device, seed=seed))
    extra = {"local_iterations": 4, "lr": 0.05} if name == "pfml" else {"local_epochs": 1}
    if name == "persfl":
        extra |= {"distill_lambdas": [0.0, 0.5], "distill_temperatures": [1.0, 2.0]}
        extra |= {"distill_epochs": 1}
    if name in ("fml", "pfml", "persfl", "fedme", "federico"):
        extra |= cfg  # the guard's settings
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


def _file(tmp_path, stamp):
    """A state file {"w": [1, 2]} made here with safetensors, stamped with `stamp` (None: no
    stamp, as files were written before the format was)."""
    meta = {"edgefl.state": json.dumps({"w": {"__tensor__": "t0"}})}
    if stamp is not None:
        meta["edgefl.state_format"] = stamp
    path = tmp_path / f"format-{stamp}.state"
    path.write_bytes(safetensors.torch.save({"t0": torch.tensor([1.0, 2.0])}, metadata=meta))
    return path


def test_a_state_file_says_its_format_and_one_in_another_is_refused_with_what_to_do(tmp_path):
    # Prepare: a file written here, and files made with safetensors alone
    ours = save_state(tmp_path / "ours.state", {"w": torch.tensor([1.0, 2.0])})
    with safetensors.safe_open(ours, "pt") as f:
        written = f.metadata()["edgefl.state_format"]

    # Assert: this version writes format 1 and reads it, stamped or (written before the stamp)
    # not; a newer format asks for a newer edgefl, an older or unknown one names the way back
    assert written == "1"
    for path in (ours, _file(tmp_path, "1"), _file(tmp_path, None)):
        assert torch.equal(load_state(path)["w"], torch.tensor([1.0, 2.0]))
    newer = _file(tmp_path, "2")
    with pytest.raises(StateError, match=r"format-2\.state is in state format 2, .*reads 1\): "
                       r"it was written by a newer edgefl; upgrade edgefl here"):  # fmt: skip
        load_state(newer)
    for stamp in ("0", "x"):
        with pytest.raises(StateError, match=rf"in state format {stamp}, .*resume with the "
                           "edgefl that wrote it, or remove the file"):  # fmt: skip
            load_state(_file(tmp_path, stamp))


def test_state_files_hold_nested_tensors_and_plain_values(tmp_path):
    state = {"a": [1, 2.5, "x", None, True], "b": {"t": torch.arange(6).view(2, 3)}, "inf": 1e309}
    back = load_state(save_state(tmp_path / "s", state))
    assert back["a"] == [1, 2.5, "x", None, True] and back["inf"] == float("inf")
    assert torch.equal(back["b"]["t"], state["b"]["t"])


class _Keeper(algorithm_class("local")):  # type: ignore[misc]
    """`local` plus one attribute of every kind the persistence layer encodes."""

    persistent = ("model", "optimizer", "other", "spec", "wire", "table", "peers", "mods", "plain")

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        self.other = self._build(GLOBAL, salt=3)  # a second module, its own architecture
        self.spec = GLOBAL
        self.wire = WireModel.of(GLOBAL, build(GLOBAL, seed=11))
        self.table = {"a": 1.5, "b": {"c": 2.5}}
        self.peers = {"p1": WireModel.of(MINE, build(MINE, seed=12))}
        self.mods = {"m": self._build(MINE, salt=4)}  # modules in a dict load in place
        self.plain = [1, "x"]


def _keeper(seed=0):
    device = torch.device("cpu")
    ctx = ClientContext("c0", MINE, _data(), device, seed, Trainer(device, seed=seed))
    return _Keeper(ctx, _Keeper.config_cls(local_epochs=1))


def _same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_kind_of_private_state_round_trips_and_modules_change_architecture(tmp_path):
    # Prepare: trained state; a fresh instance whose `other` holds another architecture and
    # whose values all differ.
    original = _keeper()
    original.fit(1, 3, {})
    original.mods["n"] = original._build(GLOBAL, salt=5)  # a module the fresh one lacks
    save_state(tmp_path / "s", original.state_dict())
    fresh = _keeper(seed=5)
    fresh.other = torch.nn.Linear(2, 2)  # another architecture, not even built by _build
    fresh.spec, fresh.wire = MINE, WireModel.of(MINE, build(MINE))
    in_place = fresh.mods["m"]
    fresh.table, fresh.peers, fresh.plain = {}, {}, []
    # Execute
    fresh.load_state_dict(load_state(tmp_path / "s"))
    # Assert: every value equals the original's; `other` was rebuilt as the saved architecture.
    assert _same_weights(fresh.other.state_dict(), original.other.state_dict())
    assert fresh.other._edgefl_spec == GLOBAL and fresh.other is not original.other
    assert _same_weights(fresh.model.state_dict(), original.model.state_dict())
    assert fresh.spec == GLOBAL and fresh.plain == [1, "x"] and fresh.table == original.table
    assert fresh.wire.spec == GLOBAL and _same_weights(fresh.wire.weights, original.wire.weights)
    assert fresh.peers.keys() == {"p1"} and fresh.peers["p1"].spec == MINE
    assert _same_weights(fresh.peers["p1"].weights, original.peers["p1"].weights)
    assert fresh.mods["m"] is in_place  # its optimizer, if any, still steps it
    assert _same_weights(in_place.state_dict(), original.mods["m"].state_dict())
    rebuilt = fresh.mods["n"]  # built here, of the saved architecture, on this device
    assert rebuilt._edgefl_spec == GLOBAL and rebuilt is not original.mods["n"]
    assert _same_weights(rebuilt.state_dict(), original.mods["n"].state_dict())


def test_a_saved_state_is_a_snapshot_that_later_training_does_not_change():
    algo = _keeper()
    algo.fit(1, 3, {})
    state = algo.state_dict()
    momentum = {k: v["momentum_buffer"].clone() for k, v in _moments(state).items()}
    weights = {k: v.clone() for k, v in state["model"]["weights"].items()}
    algo.fit(2, 3, {})
    assert _same_weights(state["model"]["weights"], weights)
    assert _same_weights({k: v["momentum_buffer"] for k, v in _moments(state).items()}, momentum)


def test_a_state_loaded_and_trained_on_stays_as_it_was_saved():
    # A node loads its state from before a round to run the round again, and may load it once
    # more if that round then fails: training after a load must not change the saved state
    # (torch's optimizers adopt the tensors they are loaded from).
    algo = _keeper()
    algo.fit(1, 3, {})
    state = algo.state_dict()
    momentum = {k: v["momentum_buffer"].clone() for k, v in _moments(state).items()}
    algo.load_state_dict(state)
    algo.fit(2, 3, {})
    assert _same_weights({k: v["momentum_buffer"] for k, v in _moments(state).items()}, momentum)


def test_an_optimizers_plain_values_load_as_saved():
    # An optimizer may keep numbers beside its tensors in its per-parameter state; loading takes
    # copies of the tensors and the numbers as they are.
    algo = _keeper()
    algo.fit(1, 3, {})
    state = algo.state_dict()
    for entry in _moments(state).values():
        entry["steps_taken"] = 7
    algo.load_state_dict(state)
    assert all(s["steps_taken"] == 7 for s in algo.optimizer.state.values())


def test_shared_state_holds_the_algorithms_own_tensors_and_copied_state_copies_them():
    # A node keeps `shared_state()` as its state before a round without copying it (a stacked
    # round gives the members new tensors); `copied_state` makes it what `state_dict()` gives.
    algo = _keeper()
    algo.fit(1, 3, {})
    shared = algo.shared_state()
    own = {
        "model": algo.model.state_dict(),
        "mods": algo.mods["m"].state_dict(),  # a module inside a dict, too
        "momentum": {i: s["momentum_buffer"] for i, s in enumerate(algo.optimizer.state.values())},
    }
    held = {
        "model": shared["model"]["weights"],
        "mods": shared["mods"]["m"]["weights"],
        "momentum": {int(i): s["momentum_buffer"] for i, s in _moments(shared).items()},
    }
    for part, tensors in own.items():
        assert all(held[part][k].data_ptr() == t.data_ptr() for k, t in tensors.items()), part

    copied, fresh = algo.copied_state(shared), algo.state_dict()  # (sharing is off again)
    for state in (copied, fresh):
        got = {
            "model": state["model"]["weights"],
            "mods": state["mods"]["m"]["weights"],
            "momentum": {int(i): s["momentum_buffer"] for i, s in _moments(state).items()},
        }
        for part, tensors in own.items():
            for k, t in tensors.items():
                assert torch.equal(got[part][k], t) and got[part][k].data_ptr() != t.data_ptr()


def test_copied_state_keeps_each_tensors_dtype():
    state = {
        "m": {
            "__module__": "{}",
            "weights": {"steps": torch.tensor([3], dtype=torch.int64), "w": torch.ones(2).double()},
        }
    }
    copied = _keeper().copied_state(state)["m"]["weights"]
    assert copied["steps"].dtype == torch.int64 and copied["w"].dtype == torch.float64
    assert torch.equal(copied["steps"], state["m"]["weights"]["steps"])


def _moments(state):
    return state["optimizer"]["__optimizer__"]["state"]


def test_state_errors_name_what_is_wrong():
    algo = _keeper()
    algo.other = torch.nn.Linear(2, 2)  # not built by _build: nothing to rebuild it from
    with pytest.raises(AlgorithmError, match=r"local\.other: a module not built by _build"):
        algo.state_dict()
    algo = _keeper()
    state = algo.state_dict()
    algo.optimizer = None
    with pytest.raises(AlgorithmError, match=r"^local: an optimizer was saved where none exists"):
        algo.load_state_dict(state)
    with pytest.raises(AlgorithmError, match=r"lacks \['plain'\]"):
        algo.load_state_dict({k: v for k, v in state.items() if k != "plain"})
    with pytest.raises(AlgorithmError, match=r"lacks \['__rng__'\]"):
        algo.load_state_dict({k: v for k, v in state.items() if k != "__rng__"})
    algo = _keeper()
    algo.table = {"deep": torch.nn.Linear(2, 2)}
    with pytest.raises(AlgorithmError, match=r"local\.table\.deep: a module not built"):
        algo.state_dict()


def _optimizers(algo):
    return [
        o for n in type(algo).persistent if isinstance(o := getattr(algo, n), torch.optim.Optimizer)
    ]


def test_how_an_optimizer_steps_is_chosen_here_not_taken_from_the_saved_state():
    # Prepare: an FML client's state whose optimizers say they stepped otherwise: the loop of a
    # version before SGD's fused CPU kernel (fused None), a GPU's capturable step.
    original = _algorithm("fml", seed=0)
    original.fit(1, 3, _models("fml", 1))
    state = original.state_dict()
    for value in state.values():
        if isinstance(value, dict) and "__optimizer__" in value:
            for group in value["__optimizer__"]["param_groups"]:
                group.update(fused=None, foreach=True, capturable=True)
    restored, fresh = _algorithm("fml", seed=0), _algorithm("fml", seed=1)
    fresh.fit(1, 3, _models("fml", 1))

    # Execute
    restored.load_state_dict(state)

    # Assert: its optimizers step as a fresh client's on this CPU (the fused kernel), so it
    # stacks with fresh clients, and trains on as the original does
    assert _optimizers(restored)
    for mine, new in zip(_optimizers(restored), _optimizers(fresh), strict=True):
        (group,), (new_group,) = mine.param_groups, new.param_groups
        assert group["fused"] is True
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in new_group.items() if k != "params"
        }
    got, _ = run_stacked([restored, fresh], "fit", 2, 3, [_models("fml", 2)] * 2)
    expected = _weights(original.fit(2, 3, _models("fml", 2)))
    stacked = _weights(got)
    assert stacked.keys() == expected.keys()
    assert all(torch.allclose(stacked[k], v, rtol=1e-5, atol=1e-6) for k, v in expected.items())


def test_an_adam_state_saved_by_a_gpu_that_captured_its_steps_resumes_on_the_cpu():
    # Prepare: Adam's state as a capturing GPU saves it (capturable, its step count a tensor)
    device = torch.device("cpu")
    cls = algorithm_class("local")
    cfg = cls.config_cls(local_epochs=1, optimizer="adam")
    original = cls(ClientContext("c0", GLOBAL, _data(), device, 0, Trainer(device, seed=0)), cfg)
    original.fit(1, 3, {})
    state = original.state_dict()
    for group in state["optimizer"]["__optimizer__"]["param_groups"]:
        group["capturable"] = True
    restored = cls(ClientContext("c0", GLOBAL, _data(), device, 0, Trainer(device, seed=0)), cfg)

    # Execute: loaded and trained on (torch refuses a capturable step on the CPU)
    restored.load_state_dict(state)
    a, b = original.fit(2, 3, {}), restored.fit(2, 3, {})

    # Assert: it trains on as the original does
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
