"""The cohort executor: clients of one architecture train their fit tasks as one stacked model,
and each gets what its own fit would have given it (to float rounding: a batched matmul's
rounding is not a single one's)."""

import threading

import pytest
import torch
from tests_helpers import tiny_config
from torch import nn

import edge_sdk.cohort as cohort_mod
from coordinator.federation import prepare_federation
from coordinator.simulator import run_federation
from edge_sdk.algorithms.base import AlgorithmError, ClientContext
from edge_sdk.algorithms.pfml import PFML, PFMLConfig
from edge_sdk.codec import WireModel
from edge_sdk.cohort import (
    Cohort,
    CohortContext,
    CohortUnsupported,
    fit_stacked,
    stack_modules,
)
from edge_sdk.trainer import ClientData, Trainer
from model_zoo import ArchSpec, build

CFG = PFMLConfig(local_iterations=4, batch_size=8, lr=0.05, k_steps=2, lam=1.0)


def _clients(family, n_train=(30, 41, 25)):
    """PFML clients with their own data, seeds and sizes (rebuilt identically on each call)."""
    spec = ArchSpec(family=family, num_classes=4, input_shape=(12,))
    out = []
    for i, n in enumerate(n_train):
        g = torch.Generator().manual_seed(100 + i)
        data = ClientData(
            torch.randn(n, 12, generator=g),
            torch.randint(0, 4, (n,), generator=g),
            torch.randn(6, 12, generator=g),
            torch.randint(0, 4, (6,), generator=g),
            torch.randn(6, 12, generator=g),
            torch.randint(0, 4, (6,), generator=g),
            num_classes=4,
        )
        cpu = torch.device("cpu")
        out.append(PFML(ClientContext(f"c{i}", spec, data, cpu, i, Trainer(cpu, seed=i)), CFG))
    return spec, out


def _global(spec):
    return WireModel(
        spec, {k: v.detach().clone() for k, v in build(spec, seed=7).state_dict().items()}
    )


def _close(a, b):
    return torch.allclose(a, b, rtol=0, atol=1e-6)


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("family", ["mlr", "mlp"])
def test_a_stacked_fit_gives_each_client_what_its_own_fit_gives(family):
    # Prepare: the same three clients twice; the aux model persists across the two rounds
    spec, alone = _clients(family)
    _, stacked = _clients(family)
    glob = _global(spec)

    for round_ in (1, 2):
        # Execute
        expected = [a.fit(round_, 2, {"global": glob}) for a in alone]
        got = fit_stacked(stacked, round_, 2, [{"global": glob}] * len(stacked))

        # Assert: the same replies and state to float rounding, the same random streams
        for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
            assert g.n_samples == e.n_samples
            assert g.metrics == pytest.approx(e.metrics, rel=1e-6)
            for k, v in e.models["local"].weights.items():
                assert _close(g.models["local"].weights[k], v), k
            for name in ("local", "aux"):
                for k, v in _weights(getattr(a, name)).items():
                    assert _close(_weights(getattr(s, name))[k], v), (name, k)
            assert torch.equal(
                s.ctx.trainer.generator.get_state(), a.ctx.trainer.generator.get_state()
            )
            # the guard looked at each member's models, as after its own fit
            ka, ks = a.guard.best, s.guard.best
            assert ka is not None and ks is not None
            assert (ks.name, ks.round, ks.correct) == (ka.name, ka.round, ka.correct)
            assert ks.loss == pytest.approx(ka.loss, rel=1e-5)
            for k, v in ka.model.weights.items():
                assert _close(ks.model.weights[k], v), k
            assert s.ctx.trainer.samples == a.ctx.trainer.samples == round_ * 4 * 8


def test_clients_whose_batches_differ_in_size_train_one_by_one_with_the_same_result():
    # Prepare: c2 has fewer samples than a batch, so its batches are smaller than the others'
    spec, alone = _clients("mlr", n_train=(30, 41, 5))
    _, stacked = _clients("mlr", n_train=(30, 41, 5))
    glob = _global(spec)
    cohort = Cohort()

    # Execute: the stacked fit is refused part way; each client then trains on its own
    expected = [a.fit(1, 2, {"global": glob}) for a in alone]
    got = _submit_together(cohort, stacked, glob)

    # Assert: nothing of the abandoned stacked fit shows (random streams restored)
    assert cohort.batches == []
    for e, g in zip(expected, got, strict=True):
        for k, v in e.models["local"].weights.items():
            assert torch.equal(g.models["local"].weights[k], v)


class _DrawsThenRefuses(PFML):
    """PFML that, run stacked, draws a batch and only then finds it cannot go on."""

    def train_round(self, round_, rounds, models):
        if isinstance(self.ctx, CohortContext):
            self.ctx.trainer.sample_batch(self.ctx.data.x_train, self.ctx.data.y_train, 8)
            raise CohortUnsupported("refused after drawing")
        return super().train_round(round_, rounds, models)


def test_a_stacked_fit_refused_part_way_leaves_the_random_streams_and_counts_as_they_were():
    # Prepare
    spec, fresh = _clients("mlr")
    _, refused = _clients("mlr")
    for a in refused:
        a.__class__ = _DrawsThenRefuses

    # Execute
    with pytest.raises(CohortUnsupported):
        fit_stacked(refused, 1, 2, [{"global": _global(spec)}] * len(refused))

    # Assert
    for a, f in zip(refused, fresh, strict=True):
        assert torch.equal(a.ctx.trainer.generator.get_state(), f.ctx.trainer.generator.get_state())
        assert a.ctx.trainer.samples == f.ctx.trainer.samples == 0  # nothing counted either


def _submit_together(cohort, algos, glob, models=None):
    results = [None] * len(algos)
    errors = [None] * len(algos)
    for a in algos:
        cohort.announce(a.ctx.client_id)

    def one(i, a):
        try:
            task_models = models[i] if models is not None else {"global": glob}
            results[i] = cohort.fit(a.ctx.client_id, a, 1, 2, task_models)
        except Exception as exc:  # the test inspects it
            errors[i] = exc

    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(algos)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results if models is None else (results, errors)


def test_the_cohort_trains_the_clients_that_submit_together_as_one_batch():
    # Prepare
    spec, alone = _clients("mlr")
    _, stacked = _clients("mlr")
    glob = _global(spec)
    cohort = Cohort()

    # Execute: three client threads submit their fit tasks at once
    expected = [a.fit(1, 2, {"global": glob}) for a in alone]
    got = _submit_together(cohort, stacked, glob)

    # Assert: one stacked fit of all three, each reply its own
    assert cohort.batches == [3]
    for e, g in zip(expected, got, strict=True):
        assert g.metrics == pytest.approx(e.metrics, rel=1e-6)
        for k, v in e.models["local"].weights.items():
            assert _close(g.models["local"].weights[k], v)


def test_a_member_whose_task_lacks_the_global_model_gets_its_own_error():
    # Prepare: c1's task carries no global model
    spec, stacked = _clients("mlr")
    glob = _global(spec)
    models = [{"global": glob}, {}, {"global": glob}]

    # Execute
    results, errors = _submit_together(Cohort(), stacked, glob, models)

    # Assert: c1 fails with the algorithm's own error; the others train
    assert isinstance(errors[1], AlgorithmError) and "global" in str(errors[1])
    assert errors[0] is None and errors[2] is None
    assert results[0].models and results[2].models


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
    # Prepare: two different linear models and two different inputs
    spec = ArchSpec(family="mlr", num_classes=3, input_shape=(5,))
    models = [build(spec, seed=s) for s in (1, 2)]
    x = torch.randn(2, 4, 5)

    # Execute
    out = stack_modules(models)(x)

    # Assert: row i is model i on input i, computed independently here
    for i, m in enumerate(models):
        w, b = m.state_dict().values()
        assert torch.allclose(out[i], x[i] @ w.T + b, atol=1e-6)


def test_simulated_pfml_trains_stacked_with_the_results_of_one_thread_per_client(monkeypatch):
    # Prepare: two architectures (two cohorts of two), and a spy on the stacked fits
    sizes = []
    real = cohort_mod.fit_stacked

    def spy(algos, *args):
        sizes.append(len(algos))
        return real(algos, *args)

    monkeypatch.setattr(cohort_mod, "fit_stacked", spy)
    flags = dict(
        algorithm="pfml",
        rounds=2,
        lr=0.05,
        overrides={"pfml.lam": 1.0, "pfml.local_iterations": 5},
        models=["mlr", "mlp"],
        global_model="mlr",
    )
    threads_cfg = tiny_config(**flags, cohort=False)
    cohort_cfg = tiny_config(**flags, cohort=True)

    # Execute
    by_thread = run_federation(threads_cfg, prepare_federation(threads_cfg), "pfml")
    assert sizes == []
    stacked = run_federation(cohort_cfg, prepare_federation(cohort_cfg), "pfml")

    # Assert: every fit ran stacked, and every client ends where it ended on its own thread
    assert sizes and all(n > 1 for n in sizes) and sum(sizes) == 4 * 2
    assert [c.personal_acc for c in stacked.clients] == [c.personal_acc for c in by_thread.clients]
    for s, t in zip(stacked.rounds, by_thread.rounds, strict=True):
        assert s.train_metrics == pytest.approx(t.train_metrics, rel=1e-6)
