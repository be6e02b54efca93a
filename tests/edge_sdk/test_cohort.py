"""Stacked training: clients of one architecture train their fit tasks as one stacked model,
and each gets what its own fit would have given it (to float rounding: a batched matmul's
rounding is not a single one's)."""

import pytest
import torch
from tests_helpers import tiny_config
from torch import nn

import edge_sdk.node as node_mod
from coordinator.federation import prepare_federation
from coordinator.simulator import run_federation
from edge_sdk.algorithms.base import AlgorithmError, ClientContext
from edge_sdk.algorithms.pfml import PFML, PFMLConfig
from edge_sdk.codec import WireModel
from edge_sdk.cohort import (
    CohortContext,
    CohortUnsupported,
    fit_stacked,
    stack_modules,
)
from edge_sdk.node import ClientNode, NodeTask, execute_together
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


@pytest.fixture
def stacked_fits(monkeypatch):
    """How each stacked fit the nodes tried ended: its size, or the error that stopped it."""
    log = []
    real = node_mod.fit_stacked

    def spy(algos, *args):
        try:
            out = real(algos, *args)
        except Exception as exc:
            log.append(exc)
            raise
        log.append(len(algos))
        return out

    monkeypatch.setattr(node_mod, "fit_stacked", spy)
    return log


def _together(algos, models):
    """The clients as ClientNodes running one fit task each, executed as one group."""
    nodes, tasks = [], []
    for a, m in zip(algos, models, strict=True):
        node = ClientNode(a.ctx.client_id, a.ctx.spec, a.ctx.data, seed=a.ctx.seed)
        node.algorithm, node._algo_key = a, ("pfml", a.config.model_dump_json())
        task = NodeTask(1, 2, "fit", "pfml", a.config.model_dump(mode="json"), m)
        node.begin(task)
        nodes.append(node)
        tasks.append(task)
    return execute_together(nodes, tasks)


def test_clients_whose_batches_differ_in_size_train_one_by_one_with_the_same_result(
    stacked_fits,
):
    # Prepare: c2 has fewer samples than a batch, so its batches are smaller than the others'
    spec, alone = _clients("mlr", n_train=(30, 41, 5))
    _, stacked = _clients("mlr", n_train=(30, 41, 5))
    glob = _global(spec)

    # Execute: the stacked fit is refused part way; each client then trains on its own
    expected = [a.fit(1, 2, {"global": glob}) for a in alone]
    got = _together(stacked, [{"global": glob}] * 3)

    # Assert: nothing of the abandoned stacked fit shows (random streams restored)
    assert len(stacked_fits) == 1 and isinstance(stacked_fits[0], CohortUnsupported)
    for e, g in zip(expected, got, strict=True):
        for k, v in e.models["local"].weights.items():
            assert torch.equal(g.models["local"].weights[k], v)


class _DrawsThenRefuses(PFML):
    """PFML that, run stacked, draws a batch and only then finds it cannot go on."""

    def fit(self, round_, rounds, models):
        if isinstance(self.ctx, CohortContext):
            self.ctx.trainer.sample_batch(self.ctx.data.x_train, self.ctx.data.y_train, 8)
            raise CohortUnsupported("refused after drawing")
        return super().fit(round_, rounds, models)


def test_a_stacked_fit_refused_part_way_leaves_the_random_streams_as_they_were():
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


def test_a_group_of_fit_tasks_trains_as_one_stacked_fit(stacked_fits):
    # Prepare
    spec, alone = _clients("mlr")
    _, stacked = _clients("mlr")
    glob = _global(spec)

    # Execute: three nodes' fit tasks executed as one group
    expected = [a.fit(1, 2, {"global": glob}) for a in alone]
    got = _together(stacked, [{"global": glob}] * 3)

    # Assert: one stacked fit of all three, each reply its own
    assert stacked_fits == [3]
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
    results = _together(stacked, models)

    # Assert: c1 fails with the algorithm's own error; the others train
    assert isinstance(results[1], AlgorithmError) and "global" in str(results[1])
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
    stacked_cfg = tiny_config(**flags, cohort=True)

    # Execute
    one_by_one = run_federation(one_by_one_cfg, prepare_federation(one_by_one_cfg), "pfml")
    assert stacked_fits == []
    stacked = run_federation(stacked_cfg, prepare_federation(stacked_cfg), "pfml")

    # Assert: every fit ran stacked, and every client ends where it ended on its own
    assert stacked_fits and all(n > 1 for n in stacked_fits) and sum(stacked_fits) == 4 * 2
    assert [c.personal_acc for c in stacked.clients] == [c.personal_acc for c in one_by_one.clients]
    for s, t in zip(stacked.rounds, one_by_one.rounds, strict=True):
        assert s.train_metrics == pytest.approx(t.train_metrics, rel=1e-6)
