"""Stacked training: clients of one architecture train their fit tasks as one stacked model,
and each gets what its own fit would have given it (to float rounding: a batched matmul's
rounding is not a single one's), whatever the sizes of their data."""

import copy
import gc
import math
import threading
import weakref

import pytest
import torch
from tests_helpers import CUDA_MARKS, tiny_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import coordinator.stacking.cohort as cohort
import coordinator.stacking.groups as groups
import coordinator.stacking.stacked_data as stacked_data
import coordinator.stacking.trainer as cohort_trainer
from coordinator.federation import prepare_federation
from coordinator.simulator import run_federation
from coordinator.stacking import KeptStacks, Stacking
from coordinator.stacking.cohort import CohortContext, run_stacked
from coordinator.stacking.modules import stack_modules
from coordinator.stacking.stacked_data import StackedData
from coordinator.stacking.state import stack_models
from coordinator.stacking.trainer import CohortTrainer
from edge_sdk.algorithms import algorithm_class
from edge_sdk.algorithms.base import (
    SPEC_ATTR,
    AlgorithmError,
    ClientAlgorithm,
    ClientContext,
    FitResult,
)
from edge_sdk.algorithms.deployment import UNLABELED, Deployment, peer_name, unlabeled_model
from edge_sdk.algorithms.members import CohortUnsupported, PerMember
from edge_sdk.algorithms.persfl import PersFL
from edge_sdk.algorithms.pfml import PFML, PFMLConfig
from edge_sdk.budget import DeployBudget
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.node import ClientNode, NodeTask
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

CPU = torch.device("cpu")
FEATURES, CLASSES = 12, 4
# Sizes that exercise every case at batch 8: epochs of 4, 6 and 1 batches, short last batches
# (30 = 3·8 + 6, 41 = 5·8 + 1) and a client with fewer samples than one batch.
SIZES = (30, 41, 5)
SETTINGS = {
    "local": {"local_epochs": 2, "batch_size": 8, "lr": 0.1},
    "fedavg": {"local_epochs": 2, "batch_size": 8, "lr": 0.1},
    "fedprox": {"local_epochs": 2, "batch_size": 8, "lr": 0.1, "mu": 0.5},
    "fedavg_ft": {"local_epochs": 1, "batch_size": 8, "lr": 0.1, "weight_decay": 0.01},
    "fml": {"local_epochs": 2, "batch_size": 8, "lr": 0.1, "alpha": 0.3, "beta": 0.7},
    "pfml": {"local_iterations": 4, "batch_size": 8, "lr": 0.05, "k_steps": 2, "lam": 1.0},
    "fedme": {"local_epochs": 2, "batch_size": 8, "lr": 0.1, "clip_norm": 0.5},
    "persfl": {"local_epochs": 2, "batch_size": 8, "lr": 0.1, "distill_temperatures": [1, 3]},
}
CFG = PFMLConfig(**SETTINGS["pfml"])


def _data(sizes, seed=100, shared=True):
    """Each client's data (train of the given size, 6 val, 6 test); `shared`: as a simulation
    holds it, rows of one client-major tensor."""
    total = sum(n + 12 for n in sizes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (total,), generator=g)
    out, at = [], 0
    for n in sizes:
        parts = [(at, at + n), (at + n, at + n + 6), (at + n + 6, at + n + 12)]
        xs = [x[a:b] if shared else x[a:b].clone() for a, b in parts]
        ys = [y[a:b] if shared else y[a:b].clone() for a, b in parts]
        out.append(ClientData(xs[0], ys[0], xs[1], ys[1], xs[2], ys[2], num_classes=CLASSES))
        at += n + 12
    return out


def _clients(algorithm, family="mlp", sizes=SIZES, shared=True, budget=None, **overrides):
    """Clients of `algorithm` with their own data, seeds and sizes (rebuilt identically), each
    with the deployment `budget` (default: its own architecture only)."""
    spec = ArchSpec(family=family, num_classes=CLASSES, input_shape=(FEATURES,))
    cls = algorithm_class(algorithm)
    cfg = cls.config_cls(**(SETTINGS[algorithm] | overrides))
    out = []
    for i, data in enumerate(_data(sizes, shared=shared)):
        ctx = ClientContext(f"c{i}", spec, data, CPU, i, Trainer(CPU, seed=i))
        if budget is not None:
            ctx.budget = budget
        out.append(cls(ctx, cfg))
    return spec, out


def _model(family, seed, features=FEATURES, classes=CLASSES):
    """A zoo model that knows its architecture, as the algorithms' models do."""
    spec = ArchSpec(family=family, num_classes=classes, input_shape=(features,))
    model = build(spec, seed=seed)
    setattr(model, SPEC_ATTR, spec)
    return model


def _global(spec, seed=7):
    return WireModel(
        spec, {k: v.detach().clone() for k, v in build(spec, seed=seed).state_dict().items()}
    )


def _models(algorithm, spec, n, round_=1):
    """Each member's task models: none (local), FedMe's personal and exchanged models (each
    member's own, new every round), or one global model."""
    if algorithm == "local":
        return [{} for _ in range(n)]
    if algorithm == "fedme":
        return [
            {"personal": _global(spec, 10 * round_ + i), "exchanged": _global(spec, 50 + i)}
            for i in range(n)
        ]
    return [{"global": _global(spec)} for _ in range(n)]


def _assert_close(a, b, where=""):
    """Nested states (dicts, lists, tensors, plain values) equal to float rounding."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), where
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), where
    else:
        assert a == b, where


def _fits_alike(algorithm, *, masked=False, rounds=2, **kw):
    """Run `rounds` fit rounds of the same clients alone and stacked; assert each stacked
    client's replies, state and random stream equal its own."""
    spec, alone = _clients(algorithm, **kw)
    _, stacked = _clients(algorithm, **kw)
    for round_ in range(1, rounds + 1):
        models = _models(algorithm, spec, len(alone), round_)
        expected = [a.fit(round_, rounds, m) for a, m in zip(alone, models, strict=True)]
        got = run_stacked(stacked, "fit", round_, rounds, models, masked=masked)
        _assert_alike(expected, got, alone, stacked)
    return alone, stacked


def _assert_alike(expected, got, alone, stacked):
    """Each stacked client's replies, state and random stream equal its own alone."""
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        assert g.n_samples == e.n_samples
        _assert_close(g.metrics, e.metrics, "metrics")
        _assert_close(
            {k: w.weights for k, w in g.models.items()},
            {k: w.weights for k, w in e.models.items()},
            "models",
        )
        _assert_close(s.state_dict(), a.state_dict(), f"{a.ctx.client_id} state")


# -- every stackable algorithm: stacked = client by client -------------------------------------
@pytest.mark.parametrize("algorithm", sorted(SETTINGS))
@pytest.mark.parametrize("masked", [False, True], ids=["prefix", "masked"])
def test_a_stacked_fit_gives_each_client_what_its_own_fit_gives(algorithm, masked):
    # Prepare / Execute / Assert (in _fits_alike): clients of 30, 41 and 5 samples at batch 8
    # take 4, 6 and 1 steps an epoch, each with a short last batch; two rounds, so what
    # persists (momentum, the auxiliary model) carries over stacked as it does alone
    _fits_alike(algorithm, masked=masked)


@pytest.mark.parametrize("gate", ["validation", "off"])
def test_stacked_fedme_members_gate_and_adopt_each_on_its_own_validation(gate):
    # Prepare: three FedMe clients, each given its own personal and exchanged models
    spec, alone = _clients("fedme", kl_gate=gate)
    _, stacked = _clients("fedme", kl_gate=gate)
    decisions = []

    for round_ in (1, 2):
        models = _models("fedme", spec, 3, round_)

        # Execute
        expected = [a.fit(round_, 2, m) for a, m in zip(alone, models, strict=True)]
        got = run_stacked(stacked, "fit", round_, 2, models)

        # Assert: replies and state as alone (the trained personal model is replied, the
        # adopted one kept)
        _assert_alike(expected, got, alone, stacked)
        decisions += [(g.metrics["adopted"], g.metrics["distilled"]) for g in got]

        # Execute, Assert: an evaluation keeps the personal model its task carries, as alone
        models = _models("fedme", spec, 3, round_ + 5)
        expected = [FitResult(metrics=a.evaluate(m)) for a, m in zip(alone, models, strict=True)]
        _assert_alike(expected, run_stacked(stacked, "evaluate", 2, 2, models), alone, stacked)

    # Assert: the members decided differently, so each decision was its own
    assert {a for a, _ in decisions} == {0.0, 1.0}
    assert {d for _, d in decisions} == ({0.0, 1.0} if gate == "validation" else {1.0})


def test_stacked_fedme_members_keep_their_model_when_the_exchanged_one_is_only_as_good():
    # Prepare: no training, and each member's exchanged model is its personal one
    spec, stacked = _clients("fedme", local_epochs=0)
    models = [
        {"personal": m["personal"], "exchanged": m["personal"]} for m in _models("fedme", spec, 3)
    ]

    # Execute
    got = run_stacked(stacked, "fit", 1, 2, models)

    # Assert: equal validation losses adopt nothing
    assert [g.metrics["adopted"] for g in got] == [0.0, 0.0, 0.0]


def test_a_fedme_member_without_validation_data_gets_its_own_error():
    # Prepare: c1 has no validation split
    spec, stacked = _clients("fedme")
    d = stacked[1].ctx.data
    stacked[1].ctx.data = ClientData(
        d.x_train, d.y_train, d.x_val[:0], d.y_val[:0], d.x_test, d.y_test, num_classes=CLASSES
    )

    # Execute
    results = _together(stacked, _models("fedme", spec, 3))

    # Assert: c1 fails with the algorithm's own error; the others train
    assert isinstance(results[1], AlgorithmError) and "validation" in str(results[1])
    assert results[0].models and results[2].models


@pytest.mark.parametrize(("sizes", "stacks"), [((16, 15, 9), True), ((16, 15, 8), False)])
def test_pfml_clients_whose_epochs_differ_in_iterations_train_one_by_one(
    sizes, stacks, stacked_fits
):
    # Prepare: PFML in whole epochs of batches of 8: 16, 15 and 9 samples take 2 iterations
    # each; 16, 15 and 8 take 2, 2 and 1
    spec, alone = _clients("pfml", sizes=sizes, local_epochs=1)
    _, stacked = _clients("pfml", sizes=sizes, local_epochs=1)
    models = _models("pfml", spec, 3)

    # Execute
    expected = [a.fit(1, 2, m) for a, m in zip(alone, models, strict=True)]
    got = _together(stacked, models)

    # Assert: one stack where every client takes as many iterations, else one by one with the
    # reason; the same replies either way
    if stacks:
        assert stacked_fits == [3]
    else:
        (refused,) = stacked_fits
        assert str(refused) == "pfml: the clients' epochs differ in iterations ([1, 2])"
    for e, g in zip(expected, got, strict=True):
        _assert_close(g.metrics, e.metrics)
        _assert_close(g.models["local"].weights, e.models["local"].weights)


def test_fedme_members_exchanging_other_architectures_stack_apart(stacked_fits):
    # Prepare: four mlp clients; two are sent exchanged mlps, two exchanged mlrs
    spec, alone = _clients("fedme", sizes=(20, 18, 16, 14))
    _, stacked = _clients("fedme", sizes=(20, 18, 16, 14))
    mlr = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))
    models = _models("fedme", spec, 4)
    for i in (1, 3):
        models[i]["exchanged"] = _global(mlr, 60 + i)

    # Execute
    expected = [a.fit(1, 2, m) for a, m in zip(alone, models, strict=True)]
    got = _together(stacked, models)

    # Assert: two stacks of two (mlp's exchanged mlps, then the pair whose exchanged model
    # is another architecture, refused as a stack: a member adopting it would leave it);
    # every reply as alone
    assert stacked_fits[0] == 2 and isinstance(stacked_fits[1], CohortUnsupported)
    assert str(stacked_fits[1]) == (
        "fedme: clients that may choose mlr over mlp cannot train as one model"
    )
    for e, g in zip(expected, got, strict=True):
        _assert_close(g.metrics, e.metrics)
        _assert_close(g.models["personal"].weights, e.models["personal"].weights)
        _assert_close(g.models["exchanged"].weights, e.models["exchanged"].weights)


@pytest.mark.parametrize("family", ["mlp", "mlr"], ids=["from-the-teacher", "from-scratch"])
def test_stacked_persfl_members_keep_their_own_teacher_and_distil_their_own_student(family):
    # Prepare: PersFL clients of `family`, alone and stacked; the global model an mlp, another
    # one every round and in every evaluation, so that each member's validation loss picks its
    # own teacher
    mlp = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,))
    _, alone = _clients("persfl", family=family)
    _, stacked = _clients("persfl", family=family)
    rounds = 4
    for round_ in range(1, rounds + 1):
        models = [{"global": _global(mlp, seed=11 * round_)}] * 3

        # Execute, Assert: stage 1's fit, then an evaluation, each as alone
        expected = [a.fit(round_, rounds, m) for a, m in zip(alone, models, strict=True)]
        _assert_alike(expected, run_stacked(stacked, "fit", round_, rounds, models), alone, stacked)
        models = [{"global": _global(mlp, seed=11 * round_ + 5)}] * 3
        expected = [FitResult(metrics=a.evaluate(m)) for a, m in zip(alone, models, strict=True)]
        got = run_stacked(stacked, "evaluate", round_, rounds, models)
        _assert_alike(expected, got, alone, stacked)

    # Execute: stage 2 (the grid) and the guard
    final = [{"global": _global(mlp, seed=99)}] * 3
    expected = [a.finalize(rounds, rounds, m) for a, m in zip(alone, final, strict=True)]
    got = run_stacked(stacked, "finalize", rounds, rounds, final)

    # Assert: every member's teacher, grid, student and guard's choice as alone
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        _assert_close(g.details, e.details, "details")
        _assert_close(g.metrics, e.metrics, "metrics")
        _assert_close(s.state_dict(), a.state_dict(), f"{a.ctx.client_id} state")
        _assert_close(
            s.personalized_model()[1].state_dict(), a.personalized_model()[1].state_dict()
        )
    # ... and the members chose differently, so each choice was its own
    assert len({a.teacher_round for a in alone}) > 1
    assert len({(a.choice.lam, a.choice.temperature) for a in alone}) > 1
    assert {e.details["student_init"] for e in expected} == {
        "teacher" if family == "mlp" else "scratch"
    }


def _image_clients(algorithm, spec, **cfg):
    """Clients of `algorithm` on 12×12 images (of SIZES training images each), twice: to run
    alone and stacked."""
    g = torch.Generator().manual_seed(5)
    pixels = {n: [torch.rand(k, *spec.input_shape, generator=g) for k in (n, 6, 6)] for n in SIZES}
    cls = algorithm_class(algorithm)
    config = cls.config_cls(**(SETTINGS[algorithm] | cfg))
    sides = []
    for _ in range(2):
        clients = []
        for i, n in enumerate(SIZES):
            labels = [torch.arange(len(x)) % CLASSES for x in pixels[n]]
            d = ClientData(*(t for p in zip(pixels[n], labels, strict=True) for t in p), CLASSES)
            clients.append(
                cls(ClientContext(f"c{i}", spec, d, CPU, i, Trainer(CPU, seed=i)), config)
            )
        sides.append(clients)
    return sides


def _finalized_both_ways(alone, stacked, glob, rounds=2, extra=None):
    """Each side's fits (a global model of `glob`, another every round), alone and stacked,
    then its finalize (its task carrying `extra` models too): (the replies alone, the
    stack's)."""
    for round_ in range(1, rounds + 1):
        models = [{"global": _global(glob, seed=11 * round_)}] * 3
        for a, m in zip(alone, models, strict=True):
            a.fit(round_, rounds, m)
        run_stacked(stacked, "fit", round_, rounds, models)
    final = [{"global": _global(glob, seed=99)} | (extra or {})] * 3
    expected = [a.finalize(rounds, rounds, m) for a, m in zip(alone, final, strict=True)]
    return expected, run_stacked(stacked, "finalize", rounds, rounds, final)


def _assert_each_as_alone(expected, got, alone, stacked):
    """Each member's finalize reply, state and random stream as alone."""
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        _assert_close(g.details, e.details, "details")
        _assert_close(g.metrics, e.metrics, "metrics")
        _assert_close(s.state_dict(), a.state_dict(), f"{a.ctx.client_id} state")
        assert torch.equal(s.ctx.trainer.generator.get_state(), a.ctx.trainer.generator.get_state())


@pytest.mark.parametrize("family", ["mlp", "lenet5"])
def test_stacked_persfl_students_see_each_members_own_shifted_views(family):
    # Prepare: PersFL clients of images (of three sizes), alone and stacked, stage 2 on images
    # shifted by up to a pixel; a global model of the other family, so the students start afresh
    image = (1, 12, 12)
    spec = ArchSpec(family=family, num_classes=CLASSES, input_shape=image)
    other = "lenet5" if family == "mlp" else "mlp"
    glob = ArchSpec(family=other, num_classes=CLASSES, input_shape=image)
    # (the guard's students, trained after stage 2, kept short: 160 passes grow stage 2's float
    # rounding past the comparison's tolerance)
    alone, stacked = _image_clients(
        "persfl", spec, distill_shift=1, distill_lambdas=[0.0, 0.5], guard_distill_epochs=2
    )

    # Execute: stage 1, then stage 2 (the grid, on shifted views) and the guard
    expected, got = _finalized_both_ways(alone, stacked, glob)

    # Assert: every member's grid, student and random stream as alone
    _assert_each_as_alone(expected, got, alone, stacked)


@pytest.mark.parametrize("diverges", [False, True], ids=["at-once", "client-by-client"])
def test_the_guards_students_of_a_stack_train_at_once_as_each_would_alone(monkeypatch, diverges):
    # Prepare: FML clients of an mlp on images, a lenet5 global model: the guard's default, the
    # personalized and the fine-tuned model mixed, is outside each device's budget, so each
    # guard distils two students of it (from its mlp and afresh), four shifted views an epoch
    image = (1, 12, 12)
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=image)
    glob = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=image)
    # (short students: their float rounding grows with their steps past the tolerance)
    alone, stacked = _image_clients("fml", spec, guard_distill_epochs=2, guard_mix_weights=[0.5])
    at_once = []
    students = cohort._students_at_once

    def spied(group, *args):
        # (`diverges`: the stack's students trained, then taken as diverged: each member's
        # guard trains its own from where its random stream was)
        made = None if diverges and students(group, *args) else students(group, *args)
        at_once.append((len(group), None if made is None else [len(m) for m in made]))
        return made

    monkeypatch.setattr(cohort, "_students_at_once", spied)

    # Execute
    expected, got = _finalized_both_ways(alone, stacked, glob)

    # Assert: the three members' two students each were trained as one stack (or, diverged,
    # by each member's guard), and every member deployed the student it deploys alone, its
    # samples and random stream as alone
    assert at_once == ([(3, None)] if diverges else [(3, [2, 2, 2])])
    assert all(e.details["deployed"] == "distilled (final, mlp)" for e in expected)
    _assert_each_as_alone(expected, got, alone, stacked)


@pytest.mark.parametrize("shift", [1, 0], ids=["shifted", "unshifted"])
def test_the_guards_mixed_students_of_a_stack_train_at_once_as_each_would_alone(monkeypatch, shift):
    # Prepare: the stack of the test above, its students shown mixed views (each member's
    # permutation and weights drawn from its own stream), with and without the shift
    image = (1, 12, 12)
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=image)
    glob = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=image)
    alone, stacked = _image_clients(
        "fml",
        spec,
        guard_distill_epochs=2,
        guard_mix_weights=[0.5],
        guard_distill_mix=True,
        guard_distill_shift=shift,
    )
    at_once = _spy_students(monkeypatch)

    # Execute
    expected, got = _finalized_both_ways(alone, stacked, glob)

    # Assert: the three members' two students each were trained as one stack, and every member
    # deployed the student it deploys alone, its samples and random stream as alone
    assert at_once == [(3, [2, 2, 2])]
    assert all(e.details["deployed"] == "distilled (final, mlp)" for e in expected)
    _assert_each_as_alone(expected, got, alone, stacked)


def _spy_students(monkeypatch):
    """What each call of `cohort._students_at_once` trained: (members, students each made, or
    None where they diverged), in a list filled as it runs."""
    at_once, students = [], cohort._students_at_once

    def spied(group, *args):
        made = students(group, *args)
        at_once.append((len(group), None if made is None else [len(m) for m in made]))
        return made

    monkeypatch.setattr(cohort, "_students_at_once", spied)
    return at_once


def test_the_guards_students_learn_on_the_finalizes_unlabeled_inputs_stacked_as_alone(monkeypatch):
    # Prepare: the stack of the tests above, twice; one finalize carries 5 unlabeled inputs
    image = (1, 12, 12)
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=image)
    glob = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=image)
    cfg = {"guard_distill_epochs": 2, "guard_mix_weights": [0.5]}
    u = torch.rand(5, *image, generator=torch.Generator().manual_seed(3))
    at_once = _spy_students(monkeypatch)
    alone, stacked = _image_clients("fml", spec, **cfg)

    # Execute
    carried = {UNLABELED: unlabeled_model(u, CLASSES)}
    expected, got = _finalized_both_ways(alone, stacked, glob, extra=carried)
    without, _ = _finalized_both_ways(*_image_clients("fml", spec, **cfg), glob)

    # Assert: the members' students trained as one stack, each as it would alone, and kept as
    # alone. Each student was made twice, from one random state: on the training split, and on
    # it and the 5 inputs (5 more samples in each of its views of each epoch)
    assert at_once == [(3, [2, 2, 2]), (3, [2, 2, 2])]
    epochs, views = cfg["guard_distill_epochs"], alone[0].config.guard_distill_views
    for a, e, w in zip(alone, expected, without, strict=True):
        assert e.details["guard_distill_unlabeled"] == 5
        assert e.details["guard_distill_unlabeled_kept"] in (0, 1, 2)
        assert "guard_distill_unlabeled" not in w.details
        more = e.details["samples_processed"] - w.details["samples_processed"]
        assert more == 2 * epochs * views * (len(a.ctx.data.x_train) + 5)
    _assert_each_as_alone(expected, got, alone, stacked)


def test_the_guards_students_of_the_best_trained_copies_train_stacked_as_alone(monkeypatch):
    # Prepare: the stack of the tests above, twice; the finalize carries three trained copies of
    # the global model, of which each member's guard mixes the two that do best on its own
    # validation split into its default
    image = (1, 12, 12)
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=image)
    glob = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=image)
    cfg = {"guard_distill_epochs": 2, "guard_mix_weights": [0.5], "guard_peers": 2}
    copies = {peer_name(f"p{i}"): _global(glob, seed=40 + i) for i in range(3)}
    at_once = _spy_students(monkeypatch)
    alone, stacked = _image_clients("fml", spec, **cfg)

    # Execute
    expected, got = _finalized_both_ways(alone, stacked, glob, extra=copies)

    # Assert: the members' students, of the default with the copies in it, trained as one
    # stack, each member's as alone, and each names the two copies it mixed
    assert at_once == [(3, [2, 2, 2])]
    for e in expected:
        assert e.details["deployed"] == "distilled (final, mlp)"
        assert len(e.details["guard_peers"].split(", ")) == 2
    _assert_each_as_alone(expected, got, alone, stacked)


def test_a_student_of_more_samples_than_the_bound_trains_fewer_epochs_stacked_as_alone(
    monkeypatch,
):
    # Prepare: the stack of the tests above (30, 41 and 5 training images; 4 views an epoch),
    # its students bounded to 2 epochs of the 30 images' views: the 41 images' take one
    image = (1, 12, 12)
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=image)
    glob = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=image)
    cfg = {"guard_distill_epochs": 2, "guard_mix_weights": [0.5]}
    views = 4
    bound = 2 * views * SIZES[0]
    unbounded, _ = _finalized_both_ways(*_image_clients("fml", spec, **cfg), glob)
    at_once = _spy_students(monkeypatch)
    alone, stacked = _image_clients("fml", spec, **cfg, guard_distill_samples=bound)
    assert alone[0].config.guard_distill_views == views

    # Execute
    expected, got = _finalized_both_ways(alone, stacked, glob)

    # Assert: the members whose students take 2 epochs trained theirs as one stack, the other
    # alone (one epoch: 164 samples a student, within the bound); each of its two students
    # processed one epoch of views fewer, and every member as alone
    assert at_once == [(2, [2, 2])]
    fewer = [
        u.details["samples_processed"] - e.details["samples_processed"]
        for u, e in zip(unbounded, expected, strict=True)
    ]
    assert fewer == [0, 2 * views * SIZES[1], 0]
    assert all(e.details["deployed"] == "distilled (final, mlp)" for e in expected)
    _assert_each_as_alone(expected, got, alone, stacked)


@pytest.mark.parametrize(("mix", "shift", "views"), [(True, 0, 4), (False, 1, 4), (False, 0, 1)])
def test_the_bound_counts_the_views_a_student_sees_of_images_it_moves(mix, shift, views):
    # 4 views an epoch where the images are mixed or shifted, one where they are as they are
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(1, 12, 12))
    bound = 3 * 4 * 41
    (a, *_), _ = _image_clients(
        "fml", spec, guard_distill_mix=mix, guard_distill_shift=shift, guard_distill_samples=bound
    )
    assert a.config.guard_distill_views == 4
    assert a.deployment.distil_epochs(41) == bound // (views * 41)


def _with_data(algo, **splits):
    """`algo`'s data with the given splits replaced."""
    d = algo.ctx.data
    fields = {
        k: getattr(d, k) for k in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
    }
    algo.ctx.data = ClientData(**(fields | splits), num_classes=CLASSES)


def test_a_persfl_member_whose_distillation_diverges_sends_the_stack_back_as_it_was():
    # Prepare: c1's training inputs blow every model's logits up
    spec, stacked = _clients("persfl")
    _with_data(stacked[1], x_train=stacked[1].ctx.data.x_train * 1e30)
    before = [s.state_dict() for s in stacked]
    final = [{"global": _global(spec)}] * 3

    # Execute
    with pytest.raises(CohortUnsupported, match="diverged at λ=0, T=1"):
        run_stacked(stacked, "finalize", 1, 1, final)

    # Assert: every member as it was, random stream included, to run its grid alone: c1's every
    # point diverges there, and it gets its own error
    for s, b in zip(stacked, before, strict=True):
        _assert_close(s.state_dict(), b)
    with pytest.raises(AlgorithmError, match="diverged at every"):
        stacked[1].finalize(1, 1, final[1])
    assert stacked[0].finalize(1, 1, final[0]).details["distill_lambda"] in (0.0, 0.5, 0.75)


@pytest.mark.parametrize("kept", ["none", "mlp"])
def test_stacked_persfl_members_whose_teachers_would_differ_in_architecture_are_refused(kept):
    # Prepare: a stack of PersFL members (as run_stacked makes one) holding no teacher or an
    # mlp one; c1's kept loss is below any, so that only the others take the mlr candidate
    mlp = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,))
    mlr = ArchSpec(family="mlr", num_classes=CLASSES, input_shape=(FEATURES,))
    _, members = _clients("persfl")
    first = members[0]
    algo = PersFL.__new__(PersFL)
    ctx = cohort._cohort_context([m.ctx for m in members], first.ctx.task, None)
    ClientAlgorithm.__init__(algo, ctx, first.config)
    algo.teacher = None if kept == "none" else algo._materialize(_rows(_global(mlp), 3))
    algo.teacher_spec = None if kept == "none" else mlp
    algo.teacher_round = PerMember([1, 1, 1])
    algo.teacher_loss = PerMember([math.inf, -1.0, math.inf])

    # Execute, Assert
    message = f"^persfl: clients that may choose mlr over {kept} cannot train as one model$"
    with pytest.raises(CohortUnsupported, match=message):
        algo.consider_teacher(2, _rows(_global(mlr), 3))


def _rows(wire, n):
    """`wire` as a stack's incoming model: each tensor as n equal rows."""
    return WireModel(wire.spec, {k: v.expand(n, *v.shape) for k, v in wire.weights.items()})


def test_a_stacked_persfl_member_without_validation_data_stops_the_stack_with_its_error():
    # Prepare: after a first round, c1 loses its validation split
    spec, stacked = _clients("persfl")
    models = [{"global": _global(spec)}] * 3
    run_stacked(stacked, "fit", 1, 2, models)
    _with_data(stacked[1], x_val=torch.zeros(0, FEATURES), y_val=torch.zeros(0, dtype=torch.long))

    # Execute, Assert: the second round's teacher is chosen on validation data
    with pytest.raises(AlgorithmError, match="validation split"):
        run_stacked(stacked, "fit", 2, 2, models)


def _kept_tensors(store):
    """The kept stacks, each with the addresses of its models' parameters and its optimizers'
    state tensors."""
    out = []
    for s in store:
        ptrs = []
        for name in type(s).persistent:
            value = getattr(s, name)
            if isinstance(value, nn.Module):
                ptrs += [p.data_ptr() for p in value.parameters()]
            elif isinstance(value, torch.optim.Optimizer):
                ptrs += [
                    t.data_ptr() for st in value.state.values() for t in st.values() if t.dim()
                ]
        out.append((s, ptrs))
    return out


@pytest.mark.parametrize("algorithm", ["fml", "pfml", "fedavg"])
def test_members_given_one_global_model_share_it_in_the_stack(algorithm):
    # Prepare: every member's task carries the same global model, as a simulation's do
    spec, alone = _clients(algorithm)
    _, stacked = _clients(algorithm)
    models = {"global": _global(spec)}

    # Execute
    expected = [a.fit(1, 2, models) for a in alone]
    got = run_stacked(stacked, "fit", 1, 2, [models] * len(stacked))
    rows = stack_models([models] * 3, CPU)["global"].weights

    # Assert: trained as alone; the stack's rows of the global model are views of its one
    # copy, not a copy per member
    _assert_alike(expected, got, alone, stacked)
    for k, t in models["global"].weights.items():
        assert rows[k].shape == (3, *t.shape) and rows[k].stride(0) == 0
        assert rows[k].data_ptr() == t.data_ptr()


def _halve(value):
    """A model's parameters or an optimizer's state tensors, halved in place."""
    with torch.no_grad():
        if isinstance(value, nn.Module):
            torch._foreach_mul_(list(value.parameters()), 0.5)
        elif isinstance(value, torch.optim.Optimizer):
            for state in value.state.values():
                for t in state.values():
                    if t.dim():
                        t.mul_(0.5)


@pytest.mark.parametrize("algorithm", sorted(SETTINGS))
def test_a_stack_kept_from_round_to_round_trains_each_client_as_alone(algorithm, monkeypatch):
    # Prepare: the same clients alone and stacked, the stack masked and kept (as on CUDA)
    store = KeptStacks()
    spec, alone = _clients(algorithm)
    _, stacked = _clients(algorithm)
    kept = []

    # Execute: three rounds; before the third, one member's models and optimizer state are
    # changed (as a rollback or a restore replaces its state), in both twins
    for round_ in (1, 2, 3):
        if round_ == 3:
            for clients in (alone, stacked):
                for name in type(clients[0]).persistent:
                    _halve(getattr(clients[0], name))
        models = _models(algorithm, spec, len(alone), round_)
        expected = [a.fit(round_, 3, m) for a, m in zip(alone, models, strict=True)]
        got = run_stacked(stacked, "fit", round_, 3, models, masked=True, kept=store)
        kept.append(_kept_tensors(store))

        # Assert: every round as client by client
        _assert_alike(expected, got, alone, stacked)

    # Assert: one stack, its tensors where they were in every later round (PersFL's teacher
    # arrives with round 2's global model: more tensors from then on)
    assert [len(k) for k in kept] == [1, 1, 1]
    (s1, p1), (s2, p2), (s3, p3) = (k[0] for k in kept)
    assert s1 is s2 is s3 and p1 == p2[: len(p1)] and p2 == p3 and p1


def test_a_kept_stack_of_adam_clients_counts_steps_from_a_restored_state(monkeypatch):
    # Prepare: Adam clients taking equal steps (4 a round), alone and in a kept stack
    store = KeptStacks()
    kw = {"sizes": (16, 16, 15), "optimizer": "adam", "weight_decay": 0.0, "momentum": 0.8}
    spec, alone = _clients("local", **kw)
    _, stacked = _clients("local", **kw)
    saved = {}

    # Execute: three rounds; before the third, every client's optimizer is restored to its
    # state after round 1 (step count 4, where the kept stack's counts 8)
    for round_ in (1, 2, 3):
        if round_ == 3:
            for c in (*alone, *stacked):
                c.optimizer.load_state_dict(saved[id(c)])
        models = _models("local", spec, len(alone))
        expected = [a.fit(round_, 3, m) for a, m in zip(alone, models, strict=True)]
        got = run_stacked(stacked, "fit", round_, 3, models, masked=True, kept=store)
        if round_ == 1:
            saved = {id(c): copy.deepcopy(c.optimizer.state_dict()) for c in (*alone, *stacked)}

        # Assert: as client by client, Adam's bias correction included
        _assert_alike(expected, got, alone, stacked)

    # Assert: the stack was kept, and counts from the restored state
    assert len(store) == 1
    assert stacked[0].optimizer.state_dict()["state"][0]["step"] == 8


def test_a_stack_whose_members_are_gone_is_let_go_when_the_next_is_kept(monkeypatch):
    # Prepare: two cohorts of clients, each trained in a kept stack (as on CUDA)
    store = KeptStacks()
    spec, first = _clients("fml")
    _, second = _clients("fml")
    run_stacked(first, "fit", 1, 2, _models("fml", spec, 3), masked=True, kept=store)
    (gone,) = [weakref.ref(s) for s in store]

    # Execute: the first cohort's clients let go (parked), the second cohort trains
    del first
    gc.collect()
    run_stacked(second, "fit", 1, 2, _models("fml", spec, 3), masked=True, kept=store)
    gc.collect()

    # Assert: only the second cohort's stack is kept; the first one's memory is free
    assert len(store) == 1 and gone() is None
    (kept,) = store
    assert {id(m) for m in store.members(kept)} == {id(c) for c in second}


def test_a_new_stacks_optimizer_state_is_laid_out_as_its_parameters(monkeypatch):
    # Prepare: FML clients with momentum after a stacked round; the next round's stack is
    # built anew from their state (nothing was kept) and kept to be looked at
    store = KeptStacks()
    spec, clients = _clients("fml")
    run_stacked(clients, "fit", 1, 2, _models("fml", spec, 3))

    # Execute
    run_stacked(clients, "fit", 2, 2, _models("fml", spec, 3), kept=store)

    # Assert: every momentum buffer in its parameter's memory layout (a linear layer's weight
    # is held transposed: see _transposed), not a contiguous stack
    (kept,) = store
    buffers = [
        (p, t)
        for name in type(kept).persistent
        if isinstance(opt := getattr(kept, name), torch.optim.Optimizer)
        for p, st in opt.state.items()
        for t in st.values()
        if t.dim()
    ]
    assert any(not p.is_contiguous() for p, _ in buffers)
    for p, t in buffers:
        assert t.shape == p.shape and t.stride() == p.stride()


def test_members_whose_fresh_batches_take_several_draws_train_stacked_as_alone(monkeypatch):
    # Prepare: one draw holds 64 keys, so PFML's 4 iterations over 30 and 41 samples take 2
    # and 4 draws (the 5-sample member one): the stack gathers each member's rows step by step.
    monkeypatch.setattr("edge_sdk.trainer._DRAW_KEYS", 64)

    # Execute / Assert (in _fits_alike): each stacked member ends as it does alone
    _fits_alike("pfml")


@pytest.mark.parametrize("algorithm", ["fml", "pfml"])
@pytest.mark.parametrize("weights", [None, [0.5]])
def test_the_guards_fine_tune_the_final_model_stacked_as_each_would_alone(
    algorithm, weights, monkeypatch
):
    # Prepare: two rounds alone and stacked (equal, as above), then a spy on the fine-tuning;
    # the default weighs each member's mixture, [0.5] deploys the fine-tuned weights in each.
    mix = {} if weights is None else {"guard_mix_weights": weights}
    # devices that may run their model mixed with the fine-tuned one
    budget = DeployBudget(allow="own,mixture")
    alone, stacked = _fits_alike(algorithm, guard_ft_epochs=3, budget=budget, **mix)
    calls = []
    real = Deployment.finetune
    monkeypatch.setattr(
        Deployment,
        "finetune",
        lambda self, *a: calls.append(self.algorithm.ctx.client_id) or real(self, *a),
    )
    spec = alone[0].ctx.spec
    models = _models(algorithm, spec, len(alone))

    # Execute
    expected = [a.finalize(2, 2, m) for a, m in zip(alone, models, strict=True)]
    assert len(calls) == len(alone)
    got = run_stacked(stacked, "finalize", 2, 2, models)

    # Assert: one fine-tuning for the whole stack, and every member deploys what it deploys
    # alone: the same choice (and mixture weight), scores, sample count and random stream, the
    # same weights. With [0.5], most members deploy the mixture with their fine-tuned model, so
    # its weights are compared.
    # (the stack's context names all its members, longest first: c1+c0+c2)
    members = {a.ctx.client_id for a in stacked}
    assert len(calls) == len(alone) + 1 and set(calls[-1].split("+")) == members
    deployed = []
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        assert g.details == e.details and "guard_mix_weight" in e.details
        _assert_close(g.metrics, e.metrics, "metrics")
        (spec_a, model_a), (spec_s, model_s) = a.personalized_model(), s.personalized_model()
        assert spec_s == spec_a
        deployed.append(spec_a.family)
        assert g.details["deployed_arch"] in ("mlp", "mixture of mlp+mlp")  # within its budget
        _assert_close(model_s.state_dict(), model_a.state_dict(), "deployed")
        _assert_close(s.state_dict(), a.state_dict(), f"{a.ctx.client_id} state")
    assert weights is None or deployed.count("mixture") >= 2, deployed


def test_fine_tuning_that_does_not_stack_runs_per_member_from_the_same_random_state(monkeypatch):
    # Prepare: the stacked fine-tuning draws every member's first batch (their generators move,
    # their sample counts grow), then finds it cannot stack.
    alone, stacked = _fits_alike("fml", guard_ft_epochs=2, rounds=1)

    def refuses(self, model, data, cfg, **kw):
        next(iter(self.epochs(data.x_train, data.y_train, cfg.batch_size, 1)))
        raise CohortUnsupported("not today")

    monkeypatch.setattr(CohortTrainer, "train_epochs", refuses)
    models = _models("fml", alone[0].ctx.spec, len(alone))

    # Execute
    expected = [a.finalize(1, 1, m) for a, m in zip(alone, models, strict=True)]
    got = run_stacked(stacked, "finalize", 1, 1, models)

    # Assert: each member fine-tuned on its own, from where it stood before the stacked try
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        assert g.details == e.details
        _assert_close(g.metrics, e.metrics, "metrics")
        _assert_close(s.state_dict(), a.state_dict(), f"{a.ctx.client_id} state")


@pytest.mark.parametrize("algorithm", ["fml", "local"])
def test_a_stack_of_clients_with_separate_tensors_trains_as_they_do(algorithm):
    # The data are not views of one tensor (a device app's, or a test's): they are gathered
    _fits_alike(algorithm, shared=False, rounds=1)


def test_a_stacked_round_gives_each_member_new_tensors_of_its_own_laid_out_as_it_trains():
    # Prepare: lenet5 clients (4-D conv weights, transposed-stacked linear weights) after a
    # round alone (momentum buffers exist); the first member's conv weights and their momentum
    # laid out channels_last, as a CUDA trainer lays them out
    spec = ArchSpec(family="lenet5", num_classes=CLASSES, input_shape=(1, 28, 28))
    g = torch.Generator().manual_seed(3)
    algos = []
    for i, n in enumerate((9, 5, 12)):
        x, y = torch.randn(n + 4, 1, 28, 28, generator=g), torch.arange(n + 4) % CLASSES
        data = ClientData(x[:n], y[:n], x[n:], y[n:], x[n:], y[n:], num_classes=CLASSES)
        ctx = ClientContext(f"c{i}", spec, data, CPU, i, Trainer(CPU, seed=i))
        algos.append(algorithm_class("local")(ctx, _local()))
    for a in algos:
        a.fit(1, 2, {})
    first = algos[0]
    convs = [p for p in first.model.parameters() if p.dim() == 4]
    for p in convs:
        p.data = p.data.to(memory_format=torch.channels_last)
        buf = first.optimizer.state[p]["momentum_buffer"]
        first.optimizer.state[p]["momentum_buffer"] = buf.to(memory_format=torch.channels_last)
    before = [{k: t.clone() for k, t in _state_tensors(a).items()} for a in algos]

    # Execute
    run_stacked(algos, "fit", 2, 2, [{}] * 3)

    # Assert: new values; every tensor in memory of its own; each in its member's layout, but
    # the linear weights (and their momentum), which keep the stack's transposed layout, so
    # that the next round's stacking copies them straight
    seen = set()
    for a, old in zip(algos, before, strict=True):
        for k, t in _state_tensors(a).items():
            assert t.shape == old[k].shape and not torch.equal(t, old[k]), k
            assert t.untyped_storage().data_ptr() not in seen, k
            seen.add(t.untyped_storage().data_ptr())
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), k
            linear = k.endswith("weight") and t.dim() == 2
            assert _layout(t) == ("transposed" if linear else _layout(old[k])), k
    assert sum(_layout(t) == "channels_last" for t in _state_tensors(first).values()) == 2


def _layout(t):
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return "transposed"
    if (
        t.dim() == 4
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
    ):
        return "channels_last"
    return "contiguous" if t.is_contiguous() else "other"


def _local():
    return algorithm_class("local").config_cls(local_epochs=1, batch_size=4, lr=0.1)


def _state_tensors(algo):
    """A client's parameters and optimizer buffers, by name (the live tensors)."""
    out = {f"param {k}": p.data for k, p in algo.model.named_parameters()}
    for k, p in algo.model.named_parameters():
        for name, t in algo.optimizer.state[p].items():
            if isinstance(t, torch.Tensor) and t.dim():
                out[f"{name} {k}"] = t
    return out


def test_stacked_fml_with_a_shared_backbone_keeps_each_clients_own_head():
    spec = ArchSpec(family="mlp", num_classes=CLASSES, input_shape=(FEATURES,))
    backbone = {k: v for k, v in _global(spec).weights.items() if k.startswith("layers.0.")}
    assert backbone  # the mlp's first layer
    _, alone = _clients("fml", shared_prefixes=["layers.0."])
    _, stacked = _clients("fml", shared_prefixes=["layers.0."])
    models = [{"global": WireModel(spec, backbone)}] * 3

    expected = [a.fit(1, 1, m) for a, m in zip(alone, models, strict=True)]
    got = run_stacked(stacked, "fit", 1, 1, models)

    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        _assert_close(g.models["meme"].weights, e.models["meme"].weights)
        _assert_close(s.state_dict(), a.state_dict())


def test_stacked_clients_with_equal_data_take_every_step_together():
    # No padding and no one sitting out: the plain path of the stacked loop
    _fits_alike("fml", sizes=(16, 16, 16), rounds=1)


def test_clients_with_adam_and_equal_steps_train_stacked_and_keep_their_step_counts():
    _, stacked = _fits_alike(
        "local", sizes=(16, 16, 15), optimizer="adam", weight_decay=0.0, momentum=0.8
    )
    # 2 rounds × 2 epochs × 2 batches
    assert stacked[0].optimizer.state_dict()["state"][0]["step"] == 8


def test_clients_with_adam_and_unequal_steps_are_refused_as_they_were():
    # Adam's step count is one per parameter tensor, so clients taking different numbers of
    # steps cannot share it: refused before anything changes
    spec, stacked = _clients("local", sizes=(30, 12), optimizer="adam")
    _, fresh = _clients("local", sizes=(30, 12), optimizer="adam")

    with pytest.raises(CohortUnsupported, match="Adam"):
        run_stacked(stacked, "fit", 1, 2, _models("local", spec, 2))

    for s, f in zip(stacked, fresh, strict=True):
        _assert_close(s.state_dict(), f.state_dict())


# -- the pieces --------------------------------------------------------------------------------
def test_each_members_stacked_batches_are_the_batches_it_draws_alone():
    # Prepare: three members of 30, 41 and 5 samples, each with its own generator
    datas = _data(SIZES)
    order = [1, 0, 2]  # longest first
    trainer = CohortTrainer([Trainer(CPU, seed=i) for i in order])
    alone = [Trainer(CPU, seed=i) for i in range(3)]
    packed = StackedData.of([datas[i] for i in order])

    # Execute
    steps = list(trainer.batches(packed.x_train, packed.y_train, 8))

    # Assert: 6 steps (the longest member's); at step s the members still in their epoch are a
    # prefix, each row is that member's own batch, and short batches are padded and weighed 0
    assert len(steps) == 6
    own = [list(alone[i].batches(datas[i].x_train, datas[i].y_train, 8)) for i in order]
    for s, (x, y, w, active) in enumerate(steps):
        assert active is None
        taking = [s < len(b) for b in own]
        assert steps[s].taking == taking and x.shape[0] == sum(taking)
        for row, batches in enumerate(own[: x.shape[0]]):
            bx, by = batches[s]
            assert torch.equal(x[row, : len(by)], bx) and torch.equal(y[row, : len(by)], by)
            if w is not None:
                assert torch.equal(w[row], (torch.arange(8) < len(by)) / len(by))
        assert (w is None) == all(len(b[s][1]) == 8 for b in own[: x.shape[0]])


def test_the_same_members_data_is_packed_once_while_it_lives():
    # Prepare: clients whose splits are views of one data set (a simulation's), and clients
    # whose splits are tensors of their own
    import gc

    views, own = _data(SIZES), _data(SIZES, shared=False)

    # Execute / Assert: the views' pack is reused, for the same members in the same order only
    first = StackedData.of(views)
    assert StackedData.of(list(views)) is first
    assert StackedData.of(views[::-1]) is not first
    assert StackedData.of(views[:2]) is not first
    moved = [ClientData(d.x_train.clone(), *_splits(d)[1:], num_classes=CLASSES) for d in views]
    assert StackedData.of(moved) is not first  # other tensors: packed anew
    for name in ClientData._tensor_fields():  # and what it holds is right
        got = getattr(StackedData.of(views), name)
        for i, d in enumerate(views):
            a = got.offsets[i]
            assert torch.equal(got.base[a : a + got.sizes[i]], getattr(d, name))
    # tensors of their own are concatenated: not kept
    assert StackedData.of(own) is not StackedData.of(own)
    # the pack is forgotten with the members' data
    kept = len(stacked_data._PACKS)
    del views, moved, first, d
    gc.collect()
    assert len(stacked_data._PACKS) <= kept - 3  # the views, reversed, and two of them


def _splits(d):
    return [getattr(d, name) for name in ClientData._tensor_fields()]


def test_masked_steps_mask_only_what_the_members_need():
    # Prepare: masked stacks (as on CUDA), batches of 8: members of 41, 30 and 5 samples (each
    # epoch's steps all of one kind: one CUDA graph); of 16 and 16; of 16 and 13
    def masked_steps(sizes):
        packed = StackedData.of(_data(sizes))
        trainer = CohortTrainer([Trainer(CPU, seed=i) for i in range(len(sizes))], masked=True)
        return list(trainer.batches(packed.x_train, packed.y_train, 8))

    # Execute
    unequal, equal = masked_steps((41, 30, 5)), masked_steps((16, 16))
    short = masked_steps((16, 13))

    # Assert: every step takes the whole stack. Members sitting steps out: weights and a mask
    # (who takes the step) on every step; all members taking every step: no mask, and weights
    # only when a batch is short
    counts = [[max(0, min(8, n - 8 * s)) for n in (41, 30, 5)] for s in range(6)]
    assert len(unequal) == 6 and counts[0] == [8, 8, 5] and counts[4] == [8, 0, 0]
    for (x, _, w, active), row in zip(unequal, counts, strict=True):
        assert x.shape[0] == 3
        assert active.tolist() == [float(c > 0) for c in row]
        assert w.sum(1).tolist() == [1.0 if c else 0.0 for c in row]
    assert len(equal) == 2 and all(w is None and a is None for _, _, w, a in equal)
    assert len(short) == 2 and all(w is not None and a is None for _, _, w, a in short)
    assert short[1][2].sum(1).tolist() == [1.0, 1.0] and short[1][2][1].count_nonzero() == 5


def test_a_member_sitting_a_step_out_keeps_its_weights_and_momentum():
    # Prepare: two stacked linear models with momentum and weight decay, both with state
    model = stack_modules([_model("mlr", s, features=4, classes=3) for s in (1, 2)])
    trainer = CohortTrainer([Trainer(CPU), Trainer(CPU)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    x = torch.randn(2, 5, 4)
    trainer.step(model(x).pow(2).mean((1, 2)), [opt])  # both members step: momentum exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    # Execute: a step only the first member takes (a batch of one row)
    stepper = trainer._stepper(lambda xb, yb: (trainer.step(model(xb).pow(2).mean((1, 2)), [opt]),))
    stepper(x[:1], torch.zeros(1, 5), None, None)

    # Assert: member 1 unchanged (momentum and decay alone would have moved it); member 0 moved
    for k, v in model.state_dict().items():
        assert torch.equal(v[1], before[k][1]) and not torch.equal(v[0], before[k][0])
    for p, m in zip(model.parameters(), momentum, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"][1], m[1])


def test_each_member_is_clipped_to_its_own_gradient_norm():
    # Prepare: two members whose gradients differ 100× in size
    model = stack_modules([_model("mlp", s, features=4, classes=3) for s in (1, 2)])
    singles = [_model("mlp", s, features=4, classes=3) for s in (1, 2)]
    scale = torch.tensor([1.0, 100.0])
    x = torch.randn(2, 5, 4)
    trainer = CohortTrainer([Trainer(CPU), Trainer(CPU)])

    # Execute: the stacked clip, and torch's clip on each member alone
    (model(x).pow(2).mean((1, 2)) * scale).sum().backward()
    trainer._clip([(list(model.parameters()), 1.0)])
    for i, m in enumerate(singles):
        (m(x[i]).pow(2).mean() * scale[i]).backward()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)

    # Assert
    for name, p in model.named_parameters():
        for i, m in enumerate(singles):
            assert torch.allclose(p.grad[i], m.get_parameter(name).grad, atol=1e-6), (name, i)


@pytest.mark.parametrize("test_sizes", [(6, 6, 70), (70, 6, 0)])
def test_a_stacked_evaluation_scores_each_member_on_its_own_samples(test_sizes, monkeypatch):
    # Prepare: members with test splits of different sizes (70: several chunks of forwards of
    # at most 16 samples; 0: none), the longest last or first
    _small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(5)
    datas = []
    for k in test_sizes:
        x = torch.randn(8 + k, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (8 + k,), generator=g)
        datas.append(ClientData(x[:8], y[:8], x[:1], y[:1], x[8:], y[8:], num_classes=CLASSES))
    models = [_model("mlp", s) for s in range(3)]
    packed = StackedData.of(datas)
    trainer = CohortTrainer([Trainer(CPU) for _ in range(3)])

    # Execute
    got = trainer.evaluate(stack_modules(models), packed.x_test, packed.y_test)

    # Assert: as each member's own evaluation, computed here
    for i, (m, d) in enumerate(zip(models, datas, strict=True)):
        z = m(d.x_test)
        assert got.correct[i] == int((z.argmax(1) == d.y_test).sum())
        assert got.total[i] == len(d.y_test)
        expected = nn.functional.cross_entropy(z, d.y_test, reduction="sum").item()
        assert got.loss_sum[i] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def _small_chunks(monkeypatch):
    """Stacked forwards of at most 16 samples, all members together."""
    monkeypatch.setattr(cohort_trainer, "_CPU_CHUNK_VALUES", 16 * FEATURES)
    monkeypatch.setattr(cohort_trainer, "_CPU_CHUNK_MIN", 16)


@pytest.mark.parametrize("train_sizes", [(6, 6, 70), (70, 6, 1)])
def test_stacked_logits_are_each_members_model_on_its_own_samples_in_its_batches(
    train_sizes, monkeypatch
):
    # Prepare: members with training splits of different sizes, forwards in several chunks
    _small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(6)
    datas = []
    for k in train_sizes:
        x = torch.randn(k + 2, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (k + 2,), generator=g)
        datas.append(ClientData(x[:k], y[:k], x[k:], y[k:], x[k:], y[k:], num_classes=CLASSES))
    models = [_model("mlp", s) for s in range(3)]
    packed = StackedData.of(datas)
    trainer = CohortTrainer([Trainer(CPU, seed=s) for s in range(3)])

    # Execute: every member's logits over its training split, then an epoch's batches of the
    # split with them
    z = trainer.logits(stack_modules(models), packed.x_train)
    batches = list(trainer.batches(packed.x_train, packed.y_train, 4, z))

    # Assert: the logits are each member's model on its own samples, computed here, and each
    # batch carries the logits of its own samples
    for i, (m, d) in enumerate(zip(models, datas, strict=True)):
        assert torch.allclose(z.base[z.offsets[i] :][: len(d.y_train)], m(d.x_train), atol=1e-6)
    for x, _, zb, *_ in batches:
        for i in range(len(x)):
            assert torch.allclose(zb[i], models[i](x[i]), atol=1e-6)
    assert sum(b.taking.count(True) for b in batches) == sum(-(-k // 4) for k in train_sizes)


@pytest.mark.parametrize("val_sizes", [(6, 6, 70), (70, 6, 0)])
def test_the_guards_stacked_scores_are_each_members_hits_and_mean_loss(val_sizes, monkeypatch):
    # Prepare: validation splits of different sizes (70: several chunks, at a budget of 16
    # samples a forward; 0: none), the longest last or first
    monkeypatch.setattr(cohort_trainer, "_CPU_CHUNK_VALUES", 16 * FEATURES)
    monkeypatch.setattr(cohort_trainer, "_CPU_CHUNK_MIN", 16)
    g = torch.Generator().manual_seed(6)
    datas = []
    for k in val_sizes:
        x = torch.randn(8 + k, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (8 + k,), generator=g)
        datas.append(ClientData(x[:8], y[:8], x[8:], y[8:], x[:1], y[:1], num_classes=CLASSES))
    models = [_model("mlp", s) for s in range(3)]
    packed = StackedData.of(datas)
    trainer = CohortTrainer([Trainer(CPU) for _ in range(3)])

    # Execute
    got = trainer.scores(stack_modules(models), packed.x_val, packed.y_val)

    # Assert: each member's samples right, in order, and mean cross-entropy, computed here
    for (hits, loss, correct), m, d in zip(got, models, datas, strict=True):
        with torch.no_grad():
            z = m(d.x_val)
        assert torch.equal(hits, z.argmax(1) == d.y_val)
        assert correct == sum(int(p == y) for p, y in zip(z.argmax(1), d.y_val, strict=True))
        if len(d.y_val):
            assert loss == pytest.approx(nn.functional.cross_entropy(z, d.y_val).item(), rel=1e-5)
        else:
            assert math.isnan(loss)


def test_a_stacked_fit_scores_the_guards_candidates_once_for_the_stack(monkeypatch):
    # Prepare: a spy on per-client logits (what a guard alone scores with) and stacked scores
    _, stacked = _clients("fml")
    per_client, per_stack = [], []
    logits, scores = Trainer.logits, CohortTrainer.scores
    monkeypatch.setattr(
        Trainer, "logits", lambda self, *a, **k: per_client.append(1) or logits(self, *a, **k)
    )
    monkeypatch.setattr(
        CohortTrainer, "scores", lambda self, *a: per_stack.append(1) or scores(self, *a)
    )

    # Execute
    run_stacked(stacked, "fit", 1, 2, _models("fml", stacked[0].ctx.spec, len(stacked)))

    # Assert: the personalized model and the meme, once each; no client scored on its own,
    # and every guard kept a model
    assert len(per_stack) == 2 and per_client == []
    guards = [a.deployment.guard for a in stacked]
    assert all(g.best is not None and g.best.model is not None for g in guards)


def test_a_decision_on_a_per_client_value_is_refused():
    values = PerMember([0.5, 0.7])
    for decide in (lambda: values < 0.6, lambda: values > values, lambda: bool(values)):
        with pytest.raises(CohortUnsupported, match="decision per client"):
            decide()
    assert values[1] == 0.7 and len(values) == 2


def test_a_stacked_fit_refused_part_way_leaves_the_random_streams_as_they_were():
    # Prepare
    spec, fresh = _clients("pfml", family="mlr")
    _, refused = _clients("pfml", family="mlr")
    for a in refused:
        a.__class__ = _DrawsThenRefuses

    # Execute
    with pytest.raises(CohortUnsupported):
        run_stacked(refused, "fit", 1, 2, _models("pfml", spec, 3))

    # Assert
    for a, f in zip(refused, fresh, strict=True):
        assert torch.equal(a.ctx.trainer.generator.get_state(), f.ctx.trainer.generator.get_state())
        assert a.ctx.trainer.samples == f.ctx.trainer.samples == 0  # nothing counted either


class _DrawsThenRefuses(PFML):
    """PFML that, run stacked, draws a batch and only then finds it cannot go on."""

    def train_round(self, round_, rounds, models):
        if isinstance(self.ctx, CohortContext):
            next(self.ctx.trainer.fresh_batches(self.ctx.data.x_train, self.ctx.data.y_train, 8, 1))
            raise CohortUnsupported("refused after drawing")
        return super().train_round(round_, rounds, models)


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
        nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)),
    ],
)
def test_a_model_with_buffers_or_dropout_does_not_stack(model):
    with pytest.raises(CohortUnsupported):
        stack_modules([model, model])


def test_a_stacked_module_runs_each_row_on_its_own_input():
    # Prepare: three different linear models and inputs
    models = [_model("mlr", s, features=5, classes=3) for s in (1, 2, 3)]
    stacked = stack_modules(models)
    x = torch.randn(3, 4, 5)

    # Execute: every row; the first two rows only (a prefix taking a step); one shared input
    out, prefix, shared = stacked(x), stacked(x[:2]), stacked(x[0])

    # Assert: row i is model i on its input, computed independently here
    for i, m in enumerate(models):
        w, b = m.state_dict().values()
        assert torch.allclose(out[i], x[i] @ w.T + b, atol=1e-6)
        assert torch.allclose(shared[i], x[0] @ w.T + b, atol=1e-6)
    assert prefix.shape == (2, 4, 3) and torch.allclose(prefix, out[:2])


class _Calls(TorchDispatchMode):
    """Counts the torch operator calls made under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Residual(nn.Module):
    """Not a chain: the input is used twice, so a stack of it runs vmapped."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        x = x.flatten(1)
        return self.b(torch.tanh(self.a(x)) + x)


FEED_FORWARD = {  # family: (input shape, options): every layer kind a chain runs, small
    "mlr": ((6,), {}),
    "mlp": ((1, 6, 6), {"hidden": [5]}),
    "lenet5": ((1, 12, 12), {}),
    "cnn1": ((2, 8, 8), {"hidden": 5}),
    "cnn2": ((2, 8, 8), {"width": 3}),
}


def _stack_of(family, n=3, device="cpu"):
    if family == "residual":
        spec = ArchSpec(family="mlr", num_classes=3, input_shape=(6,))
        models = [_Residual() for _ in range(n)]
        for i, m in enumerate(models):
            torch.manual_seed(i)
            m.a.reset_parameters(), m.b.reset_parameters()
    else:
        shape, options = FEED_FORWARD[family]
        spec = ArchSpec(family=family, num_classes=3, input_shape=shape, kwargs=options)
        models = [build(spec, seed=i) for i in range(n)]
    for m in models:
        setattr(m, SPEC_ATTR, spec)
        m.to(device)
    return spec, models, stack_modules(models)


CUDA = pytest.param("cuda", marks=CUDA_MARKS)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", [*FEED_FORWARD, "residual"])
def test_every_row_of_a_stacked_model_computes_what_its_model_computes(family, device, monkeypatch):
    # Prepare: three models of one architecture, their stack, a batch of 4 per row (on CUDA in
    # full fp32: cuDNN's TF32 would round a grouped and a single convolution differently)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    spec, models, stacked = _stack_of(family, device=device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, *spec.input_shape, generator=g).to(device)
    weights = torch.randn(3, 4, 3, generator=g).to(device)

    # Execute: every row on its own input (and its gradient), a prefix of two rows, one input
    # shared by every row
    out = stacked(x)
    (out * weights).sum().backward()
    prefix, shared = stacked(x[:2]), stacked(x[0])

    # Assert: row i is model i alone, forward and backward
    for i, m in enumerate(models):
        alone = m(x[i])
        (alone * weights[i]).sum().backward()
        assert torch.allclose(out[i], alone, atol=1e-5)
        assert torch.allclose(shared[i], m(x[0]), atol=1e-5)
        for name, p in m.named_parameters():
            assert torch.allclose(stacked.get_parameter(name).grad[i], p.grad, atol=1e-5), name
    assert prefix.shape == (2, 4, 3) and torch.allclose(prefix, out[:2], atol=1e-6)


@pytest.mark.parametrize("family", list(FEED_FORWARD))
def test_a_stacked_feed_forward_model_runs_as_one_program_not_row_by_row(family):
    # Prepare: a stack of five and one of its models alone, each on a batch of 4
    spec, models, stacked = _stack_of(family, n=5)
    x = torch.randn(5, 4, *spec.input_shape)

    # Execute: count the operator calls of a forward and backward
    with _Calls() as rows:
        stacked(x).sum().backward()
    with _Calls() as one:
        models[0](x[0]).sum().backward()

    # Assert: the stack costs about one model's calls (vmapped, it took 1.6-3x as many)
    assert rows.count < 1.5 * one.count


class _Handshake(nn.Module):
    """A chain whose forward, once `waiting` is set, signals `inside` and waits for `done`
    (class attributes: shared with the copies a stack makes)."""

    inside, done = threading.Event(), threading.Event()

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.waiting = False

    def forward(self, x):
        if self.waiting:
            self.inside.set()
            assert self.done.wait(10)
        return self.linear(torch.flatten(x, 1))


def test_reading_a_models_chain_leaves_other_threads_models_alone():
    # Prepare: models whose stack's chain is read while another thread runs a model of its own
    # (a simulation trains stacks on several threads; torch.fx's tracer would patch every
    # thread's nn.Module.__call__ while it traced)
    spec = ArchSpec(family="mlr", num_classes=2, input_shape=(4,))
    models = [_Handshake(), _Handshake()]
    for m in models:
        setattr(m, SPEC_ATTR, spec)
        m.waiting = True
    other, x = nn.Linear(3, 2), torch.randn(5, 3)
    got = {}

    def run_other():
        assert models[0].inside.wait(10)  # the chain is being read
        try:
            got["out"] = other(x)
        finally:
            models[0].done.set()

    # Execute: stack them (which reads the chain) while the other thread runs its model
    thread = threading.Thread(target=run_other)
    thread.start()
    stacked = stack_modules(models)
    thread.join()

    # Assert: the other thread's model computed what it computes; the stack is a chain, and
    # runs each row as its model
    assert torch.allclose(got["out"], x @ other.weight.T + other.bias)
    for m in models:
        m.waiting = False
    rows = torch.randn(2, 3, 4)
    out = stacked(rows)
    for i, m in enumerate(models):
        assert torch.allclose(out[i], m(rows[i]), atol=1e-6)


# -- through the node and the simulator -------------------------------------------------------
@pytest.fixture
def stacked_fits(monkeypatch):
    """How each stacked fit the nodes tried ended: its size, or the error that stopped it
    (`stacked_fits.phases`: the phase of every stacked run, fit or not)."""
    log = _Log()
    real = groups.run_stacked

    def spy(algos, phase, *args, **kw):
        try:
            out = real(algos, phase, *args, **kw)
        except Exception as exc:
            log.phases.append((phase, exc))
            if phase == "fit":
                log.append(exc)
            raise
        log.phases.append((phase, len(algos)))
        if phase == "fit":
            log.append(len(algos))
        return out

    monkeypatch.setattr(groups, "run_stacked", spy)
    return log


class _Log(list):
    def __init__(self):
        super().__init__()
        self.phases = []


def _together(algos, models, stacking=None):
    """The clients as ClientNodes running one fit task each, executed as one group (by a fresh
    fleet's `Stacking` unless given)."""
    nodes, tasks = [], []
    for a, m in zip(algos, models, strict=True):
        node = ClientNode(a.ctx.client_id, a.ctx.spec, a.ctx.data, seed=a.ctx.seed)
        node.algorithm, node._algo_key = a, (a.name, a.config.model_dump_json())
        task = NodeTask(1, 2, "fit", a.name, a.config.model_dump(mode="json"), m)
        node.begin(task)
        nodes.append(node)
        tasks.append(task)
    return (stacking or Stacking()).execute_together(nodes, tasks)


def test_a_group_of_fit_tasks_trains_as_one_stacked_fit(stacked_fits):
    # Prepare
    spec, alone = _clients("pfml", family="mlr")
    _, stacked = _clients("pfml", family="mlr")
    models = _models("pfml", spec, 3)

    # Execute: three nodes' fit tasks executed as one group
    expected = [a.fit(1, 2, m) for a, m in zip(alone, models, strict=True)]
    got = _together(stacked, models)

    # Assert: one stacked fit of all three, each reply its own
    assert stacked_fits == [3]
    for e, g in zip(expected, got, strict=True):
        _assert_close(g.metrics, e.metrics)
        _assert_close(g.models["local"].weights, e.models["local"].weights)


def test_a_member_whose_task_lacks_the_global_model_gets_its_own_error():
    # Prepare: c1's task carries no global model
    spec, stacked = _clients("pfml", family="mlr")
    models = _models("pfml", spec, 3)
    models[1] = {}

    # Execute
    results = _together(stacked, models)

    # Assert: c1 fails with the algorithm's own error; the others train
    assert isinstance(results[1], AlgorithmError) and "global" in str(results[1])
    assert results[0].models and results[2].models


def test_a_stack_that_runs_out_of_memory_trains_in_halves(stacked_fits, monkeypatch):
    # Prepare: a stack of four fails as a GPU out of memory would; two fit. A stack kept
    # from an earlier round holds memory
    spec, alone = _clients("fml", sizes=(20, 18, 16, 14))
    _, stacked = _clients("fml", sizes=(20, 18, 16, 14))
    models = _models("fml", spec, 4)
    real = groups.run_stacked
    stacking = Stacking()
    stacking.kept.put(alone[:1], alone[0])  # (a stand-in: only its being let go is looked at)

    tried = []

    def small_memory(algos, *args, **kw):
        tried.append(len(algos))
        if len(algos) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return real(algos, *args, **kw)

    monkeypatch.setattr(groups, "run_stacked", small_memory)

    # Execute
    expected = [a.fit(1, 2, m) for a, m in zip(alone, models, strict=True)]
    got = _together(stacked, models, stacking)

    # Assert: every client trained, stacked two by two, with its own result; the kept
    # stack let go
    for e, g in zip(expected, got, strict=True):
        _assert_close(g.metrics, e.metrics)
        _assert_close(g.models["meme"].weights, e.models["meme"].weights)
    assert not stacking.kept and stacking.limits == {("fml", spec.to_json(), "cpu"): 2}
    assert tried == [4, 2, 2]

    # Execute, Assert: the same fleet starts from stacks of two; another fleet (another run in
    # this process) has learnt nothing, and tries all four first
    _, again = _clients("fml", sizes=(20, 18, 16, 14))
    _together(again, models, stacking)
    assert tried[3:] == [2, 2]
    _, other = _clients("fml", sizes=(20, 18, 16, 14))
    _together(other, models, Stacking())
    assert tried[5:] == [4, 2, 2]


def test_a_population_stacks_its_sampled_and_its_never_sampled_clients_apart(stacked_fits):
    # Prepare: FML, 8 clients of which 4 train (a round of a cohort of 4); the 4 never sampled
    # hold no meme or optimizer, the 4 sampled do
    flags = dict(algorithm="fml", rounds=1, clients=8, clients_per_round=4, lr=0.05)
    one_by_one_cfg = tiny_config(**flags, cohort=False)
    stacked_cfg = tiny_config(**flags, cohort="always")

    # Execute
    one_by_one = run_federation(one_by_one_cfg, prepare_federation(one_by_one_cfg), "fml")
    stacked = run_federation(stacked_cfg, prepare_federation(stacked_cfg), "fml")

    # Assert: every stack tried ran (none refused for members of two kinds), and the
    # evaluation and the finalize of the 8 ran stacked but for clients alone of their kind in
    # their group; every client ends where it ended alone
    assert all(isinstance(n, int) for _, n in stacked_fits.phases), stacked_fits.phases
    for phase in ("evaluate", "finalize"):
        assert sum(n for p, n in stacked_fits.phases if p == phase) >= 6, phase
    assert [c.personal_acc for c in stacked.clients] == [c.personal_acc for c in one_by_one.clients]
    assert [c.details.get("deployed") for c in stacked.clients] == [
        c.details.get("deployed") for c in one_by_one.clients
    ]


def test_simulated_pfml_trains_stacked_with_the_results_of_one_client_at_a_time(stacked_fits):
    # Prepare: two architectures (two stacks of two)
    flags = dict(
        algorithm="pfml",
        rounds=2,
        lr=0.05,
        overrides={"pfml.lam": 1.0, "pfml.local_iterations": 5},
        models=["mlr", "mlp"],
        global_model="mlr",
    )
    one_by_one_cfg = tiny_config(**flags, cohort=False)
    stacked_cfg = tiny_config(**flags, cohort="always")

    # Execute
    one_by_one = run_federation(one_by_one_cfg, prepare_federation(one_by_one_cfg), "pfml")
    assert stacked_fits == []
    stacked = run_federation(stacked_cfg, prepare_federation(stacked_cfg), "pfml")

    # Assert: every fit and evaluation ran stacked, and every client ends where it ended alone
    assert stacked_fits and all(n > 1 for n in stacked_fits) and sum(stacked_fits) == 4 * 2
    assert {phase for phase, _ in stacked_fits.phases} == {"fit", "evaluate", "finalize"}
    assert all(n == 2 for _, n in stacked_fits.phases)
    assert [c.personal_acc for c in stacked.clients] == [c.personal_acc for c in one_by_one.clients]
    for s, t in zip(stacked.rounds, one_by_one.rounds, strict=True):
        assert s.train_metrics == pytest.approx(t.train_metrics, rel=1e-6)
