"""Training steps a CUDA graph can capture: no host read inside a step, losses read once per
loop, and (on a CUDA machine) captured steps that train as eager ones do.

The capture itself needs a GPU; what it relies on is checked on the CPU: a step that read a
value on the host (`.item()`, `float(t)`, `if t:`) could not be captured and would wait for the
device every step."""

import pytest
import torch
from tests_helpers import needs_cuda
from torch.utils._python_dispatch import TorchDispatchMode

import edge_sdk.graphs as graphs_mod
from coordinator.stacking import KeptStacks
from coordinator.stacking.cohort import run_stacked
from coordinator.stacking.trainer import CohortTrainer
from edge_sdk.algorithms import algorithm_class
from edge_sdk.algorithms.base import ClientContext
from edge_sdk.algorithms.pfml import _shaped_as
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.graphs import StepRunner, footprint
from edge_sdk.optim import SGD, restart
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal"}
FEATURES, CLASSES = 12, 4
SETTINGS = {
    "local": {"local_epochs": 1, "batch_size": 8, "lr": 0.1},
    "fedavg": {"local_epochs": 1, "batch_size": 8, "lr": 0.1},
    "fedprox": {"local_epochs": 1, "batch_size": 8, "lr": 0.1, "mu": 0.5},
    "fml": {"local_epochs": 1, "batch_size": 8, "lr": 0.1},
    "pfml": {"local_iterations": 3, "batch_size": 8, "lr": 0.05, "k_steps": 2, "lam": 1.0},
    "fedme": {"local_epochs": 1, "batch_size": 8, "lr": 0.1},
    "persfl": {"local_epochs": 1, "batch_size": 8, "lr": 0.1, "distill_temperatures": [1, 3]},
}


class _HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in HOST_READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


SHAPES = {"mlp": (FEATURES,), "lenet5": (1, 12, 12)}  # a stack of lenet5 runs grouped convolutions


def _clients(
    algorithm,
    device,
    sizes=(30, 21, 5),
    epochs=None,
    amp=True,
    graphs=None,
    family="mlp",
    **overrides,
):
    spec = ArchSpec(family=family, num_classes=CLASSES, input_shape=SHAPES[family])
    cls = algorithm_class(algorithm)
    settings = SETTINGS[algorithm] | ({"local_epochs": epochs} if epochs else {}) | overrides
    if "guard" in cls.config_cls.model_fields:
        # The guard scores each client's models after its fit (how often it reads the host
        # depends on what it finds, not on the steps): these tests count the training loop's.
        settings["guard"] = False
    cfg = cls.config_cls(**settings)
    out = []
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randn(n + 12, *spec.input_shape, generator=g)
        y = torch.randint(0, CLASSES, (n + 12,), generator=g)
        data = ClientData(x[:n], y[:n], x[n:], y[n:], x[n:], y[n:], num_classes=CLASSES)
        data = data.to(device)
        trainer = Trainer(device, seed=i, amp=amp, graphs=graphs)
        out.append(cls(ClientContext(f"c{i}", spec, data, device, i, trainer), cfg))
    return spec, out


def _models(algorithm, spec):
    glob = WireModel(spec, dict(build(spec, seed=7).state_dict()))
    if algorithm == "fedme":
        other = WireModel(spec, dict(build(spec, seed=8).state_dict()))
        return {"personal": glob, "exchanged": other}
    return {} if algorithm == "local" else {"global": glob}


@pytest.fixture
def steps_watched(monkeypatch):
    """Every step a StepRunner runs, under a count of host reads (the counts, one per step)."""
    counts = []
    real = graphs_mod.StepRunner.__call__

    def watched(self, *inputs):
        with _HostReads() as mode:
            out = real(self, *inputs)
        counts.append(mode.reads)
        return out

    monkeypatch.setattr(graphs_mod.StepRunner, "__call__", watched)
    return counts


@pytest.mark.parametrize("algorithm", sorted(SETTINGS))
def test_no_training_step_reads_a_value_on_the_host(algorithm, steps_watched):
    # Prepare: the clients alone, and the same clients as one stack (masked, as on CUDA)
    cpu = torch.device("cpu")
    spec, alone = _clients(algorithm, cpu)
    models = _models(algorithm, spec)

    # Execute
    for a in alone:
        a.fit(1, 2, models)
    if not algorithm_class(algorithm).exchanges_models:
        _, stacked = _clients(algorithm, cpu)
        run_stacked(stacked, "fit", 1, 2, [models] * len(stacked), masked=True)

    # Assert: steps ran, and none of them read a value on the host
    assert steps_watched and set(steps_watched) == {0}


@pytest.mark.parametrize("algorithm", ["fml", "local", "pfml"])
def test_a_stacked_fit_reads_its_values_on_the_host_as_often_whatever_its_steps(algorithm):
    # Prepare: the same stack for one and for three epochs (or iterations)
    cpu = torch.device("cpu")
    reads = []
    for epochs in (1, 3):
        spec, stacked = _clients(algorithm, cpu, epochs=epochs if algorithm != "pfml" else None)
        if algorithm == "pfml":
            for a in stacked:
                a.config = a.config.model_copy(update={"local_iterations": 2 * epochs})
        models = _models(algorithm, spec)

        # Execute
        with _HostReads() as mode:
            run_stacked(stacked, "fit", 1, 2, [models] * len(stacked), masked=True)
        reads.append(mode.reads)

    # Assert: reading the losses is once per loop, not once per step
    assert reads[0] == reads[1]


def _net():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # momentum buffers exist
    return model, opt


def _moved(t):
    t.data = t.data.clone()


CHANGES = {
    "a parameter in new memory": lambda m, o: _moved(m[0].weight),
    "a buffer in new memory": lambda m, o: _moved(m[1].running_mean),
    "a submodule in eval mode": lambda m, o: m[1].eval(),
    "a parameter frozen": lambda m, o: m[0].bias.requires_grad_(False),
    "another learning rate": lambda m, o: o.param_groups[0].update(lr=0.2),
    "another momentum": lambda m, o: o.param_groups[0].update(momentum=0.5),
    "new optimizer state": lambda m, o: o.state[m[0].weight].update(
        momentum_buffer=torch.zeros(3, 4)
    ),
    "optimizer state dropped": lambda m, o: o.state.clear(),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_footprint_changes_with_what_a_captured_step_reads(change):
    # Prepare
    model, opt = _net()
    before = footprint(model, opt, 0.5, "kl")

    # Execute
    CHANGES[change](model, opt)

    # Assert: a kept step would not be replayed onto other tensors or settings
    assert footprint(model, opt, 0.5, "kl") != before


def test_a_footprint_stays_through_in_place_updates_and_names_what_it_cannot_tell_apart():
    # Prepare: a model, its optimizer, plain values and a tensor of loss weights
    model, opt = _net()
    weights = torch.tensor([0.5, 1.0])
    before = footprint(model, opt, 0.5, "kl", weights)

    # Execute: what a round does in place (new weights loaded, the optimizer restarted, the
    # loss weights rewritten)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    restart(opt)
    opt.param_groups[0]["lr"] = 0.1
    weights.copy_(torch.tensor([1.0, 0.5]))

    # Assert: a tensor counts by where it is (a replay reads what it holds then), a plain
    # value by its value
    assert footprint(model, opt, 0.5, "kl", weights) == before
    assert footprint(model, opt, 0.25, "kl", weights) != before
    assert footprint(model, opt, 0.5, "kl", weights.clone()) != before
    assert footprint(object()) is None
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    assert footprint(model, opt) is None


# -- on a CUDA machine ------------------------------------------------------------------------


def _weights(algo):
    """Every model the client keeps, on the CPU."""
    modules = {n: getattr(algo, n) for n in type(algo).persistent}
    return {
        name: {k: v.detach().float().cpu() for k, v in m.state_dict().items()}
        for name, m in modules.items()
        if isinstance(m, torch.nn.Module)
    }


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fml", "pfml", "fedavg"])
def test_a_captured_fit_trains_as_an_eager_one(algorithm):
    # Prepare: the same client on CUDA in fp32, its steps captured or not
    dev = torch.device("cuda")
    spec, (captured,) = _clients(algorithm, dev, sizes=(64,), amp=False, epochs=3)
    _, (eager,) = _clients(algorithm, dev, sizes=(64,), amp=False, graphs=False, epochs=3)
    models = _models(algorithm, spec)

    # Execute
    got, expected = captured.fit(1, 2, models), eager.fit(1, 2, models)

    # Assert: graphs were captured and replayed; the same training to float rounding
    assert captured.ctx.trainer.stats.graphs >= 1 and captured.ctx.trainer.stats.replayed > 0
    assert eager.ctx.trainer.stats.replayed == 0
    assert got.metrics == pytest.approx(expected.metrics, rel=1e-4)
    for name, weights in _weights(eager).items():
        for k, v in weights.items():
            assert torch.allclose(_weights(captured)[name][k], v, atol=1e-5), (name, k)


@needs_cuda
@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("algorithm", ["fml", "pfml", "local", "fedme"])
def test_a_captured_stack_on_cuda_trains_each_client_as_it_trains_alone(
    algorithm, family, monkeypatch
):
    # Prepare: unequal clients, alone and stacked (masked, captured), fp32 without cuDNN's TF32
    # (PFML's members take its fixed iterations: epochs of unequal clients would not stack)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    dev = torch.device("cuda")
    epochs = None if algorithm == "pfml" else 2
    spec, alone = _clients(algorithm, dev, amp=False, epochs=epochs, family=family)
    _, stacked = _clients(algorithm, dev, amp=False, epochs=epochs, family=family)
    models = _models(algorithm, spec)

    # Execute
    expected = [a.fit(1, 2, models) for a in alone]
    got = run_stacked(stacked, "fit", 1, 2, [models] * len(stacked))

    # Assert
    assert stacked[0].ctx.trainer.stats.graphs >= 1
    assert all(s.ctx.trainer.stats.stacked > 0 for s in stacked)
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        assert g.metrics == pytest.approx(e.metrics, rel=1e-4)
        for name, weights in _weights(a).items():
            for k, v in weights.items():
                assert torch.allclose(_weights(s)[name][k], v, atol=1e-5), (name, k)


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fml", "pfml", "fedavg", "local"])
def test_a_devices_step_is_captured_once_and_replayed_in_its_later_rounds(algorithm):
    # Prepare: one client captured and its eager twin, fp32; FML's α fixed (the gate would
    # switch between two steps, each kept); a new global model every round
    dev = torch.device("cuda")
    kw = {"sizes": (64,), "epochs": 2, "amp": False}
    kw |= {"alpha_gate": "off"} if algorithm == "fml" else {}
    spec, (captured,) = _clients(algorithm, dev, **kw)
    _, (eager,) = _clients(algorithm, dev, graphs=False, **kw)
    stats = captured.ctx.trainer.stats
    counts = []

    # Execute
    for r in (1, 2, 3):
        glob = WireModel(spec, dict(build(spec, seed=7 + r).state_dict()))
        models = {} if algorithm == "local" else {"global": glob}
        got, expected = captured.fit(r, 3, models), eager.fit(r, 3, models)
        counts.append((stats.graphs, stats.replayed, stats.steps))
        assert got.metrics == pytest.approx(expected.metrics, rel=1e-4)

    # Assert: one graph, captured in round 1; every later step replayed; trained as eagerly
    assert counts[0][0] == counts[2][0] == 1
    assert counts[2][1] - counts[0][1] == counts[2][2] - counts[0][2] == 2 * 16
    for name, weights in _weights(eager).items():
        for k, v in weights.items():
            assert torch.allclose(_weights(captured)[name][k], v, atol=1e-5), (name, k)


@needs_cuda
def test_a_kept_step_is_not_replayed_onto_tensors_a_stacked_round_replaced():
    # Prepare: two clients, captured and eager; round 2 runs them stacked, which gives each
    # client's models new memory
    dev = torch.device("cuda")
    kw = {"sizes": (32, 32), "epochs": 1, "amp": False, "alpha_gate": "off"}
    spec, captured = _clients("fml", dev, **kw)
    _, eager = _clients("fml", dev, graphs=False, **kw)
    graphs = captured[0].ctx.trainer.stats

    # Execute: alone, stacked, alone
    for r in (1, 2, 3):
        models = {"global": WireModel(spec, dict(build(spec, seed=7 + r).state_dict()))}
        for clients in (captured, eager):
            if r == 2:
                run_stacked(clients, "fit", r, 3, [models] * 2)
            else:
                for c in clients:
                    c.fit(r, 3, models)
        if r == 1:
            first = graphs.graphs

    # Assert: round 3 captured again (its kept step's tensors were gone), and trained as eagerly
    assert graphs.graphs > first
    for c, e in zip(captured, eager, strict=True):
        for name, weights in _weights(e).items():
            for k, v in weights.items():
                assert torch.allclose(_weights(c)[name][k], v, atol=1e-5), (name, k)


@needs_cuda
def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_why(caplog):
    # Prepare: a step that reads the host while it is being captured (the capture fails, as a
    # cuBLAS kernel's failure inside a capture would), and the same steps worked out by hand
    dev = torch.device("cuda")
    w = torch.zeros(3, device=dev, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x):
        loss = ((w - x) ** 2).sum()
        if torch.cuda.is_current_stream_capturing():
            loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return (loss.detach(),)

    xs = [torch.full((3,), float(i + 1)) for i in range(5)]
    expected, v = [], torch.zeros(3)
    for x in xs:
        expected.append(float(((v - x) ** 2).sum()))
        v = v - 0.1 * 2 * (v - x)
    runner = StepRunner(step, capture=True)

    # Execute: two warm-up steps, the failed capture's, two more
    with caplog.at_level("WARNING", logger="edge_sdk.graphs"):
        got = [runner(x.to(dev))[0].item() for x in xs]

    # Assert: every step taken once, eagerly; the reason in the log; the device still works
    assert got == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(w.detach().cpu(), v, atol=1e-6)
    assert (runner.graphs, runner.eager, runner.replayed) == (0, 5, 0)
    assert runner.failed and "could not be captured" in caplog.text


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fml", "pfml", "fedavg", "local"])
def test_a_kept_stacks_step_is_captured_once_and_replayed_in_its_later_rounds(
    algorithm, monkeypatch
):
    # Prepare: unequal clients stacked (masked, captured, the stack kept from round to round)
    # and their eager twins alone, fp32; FML's α gate on (α per member, rewritten in place)
    store = KeptStacks()
    dev = torch.device("cuda")
    epochs = None if algorithm == "pfml" else 2  # (PFML's members take its fixed iterations)
    spec, alone = _clients(algorithm, dev, amp=False, graphs=False, epochs=epochs)
    _, stacked = _clients(algorithm, dev, amp=False, epochs=epochs)
    counts = []

    # Execute: three rounds, a new global model every round
    for r in (1, 2, 3):
        glob = WireModel(spec, dict(build(spec, seed=7 + r).state_dict()))
        models = {} if algorithm == "local" else {"global": glob}
        expected = [a.fit(r, 3, models) for a in alone]
        got = run_stacked(stacked, "fit", r, 3, [models] * len(stacked), kept=store)
        stats = [s.ctx.trainer.stats for s in stacked]
        counts.append((sum(s.graphs for s in stats), [(s.replayed, s.steps) for s in stats]))
        for e, g in zip(expected, got, strict=True):
            assert g.metrics == pytest.approx(e.metrics, rel=1e-4)

    # Assert: one graph, captured in round 1; every later step of every member replayed;
    # trained as alone
    assert [c[0] for c in counts] == [1, 1, 1]
    for (r1, s1), (r3, s3) in zip(counts[0][1], counts[2][1], strict=True):
        assert r3 - r1 == s3 - s1 > 0
    for a, s in zip(alone, stacked, strict=True):
        for name, weights in _weights(a).items():
            for k, v in weights.items():
                assert torch.allclose(_weights(s)[name][k], v, atol=1e-5), (name, k)


# -- what a step reads stays where it is from round to round -----------------------------------
@pytest.fixture
def loops_kept(monkeypatch):
    """The footprint of every training loop's `keep` (None: nothing to keep), in order."""
    prints = []
    for cls in (Trainer, CohortTrainer):

        def run(self, step, batches, values=1, *, keep=(), real=cls.run):
            prints.append(footprint(*keep) if keep else None)
            return real(self, step, batches, values, keep=keep)

        monkeypatch.setattr(cls, "run", run)
    return prints


@pytest.mark.parametrize("algorithm", ["fml", "pfml", "fedavg", "local"])
def test_a_devices_step_reads_the_same_tensors_in_every_round(algorithm, loops_kept):
    # Prepare: one client on the CPU (what a captured step would read is device-independent);
    # FML's α fixed (the gate would switch between two kept steps)
    kw = {"sizes": (32,), "epochs": 1} | ({"alpha_gate": "off"} if algorithm == "fml" else {})
    spec, (client,) = _clients(algorithm, torch.device("cpu"), **kw)

    # Execute: three rounds, a new global model every round
    for r in (1, 2, 3):
        glob = WireModel(spec, dict(build(spec, seed=7 + r).state_dict()))
        client.fit(r, 3, {} if algorithm == "local" else {"global": glob})

    # Assert: the step of rounds 2 and 3 would replay round 1's capture (its optimizer state
    # exists from round 1's first step on)
    assert len(loops_kept) == 3 and loops_kept[1] is not None
    assert loops_kept[1] == loops_kept[2]


@pytest.mark.parametrize("algorithm", ["fml", "pfml", "fedavg", "local"])
def test_a_kept_stacks_step_reads_the_same_tensors_in_every_round(algorithm, loops_kept):
    # Prepare: unequal clients stacked on the CPU, masked and kept (as on CUDA); FML's α gate
    # on: α per member, one tensor
    epochs = None if algorithm == "pfml" else 1
    spec, stacked = _clients(algorithm, torch.device("cpu"), epochs=epochs)
    store = KeptStacks()

    # Execute
    for r in (1, 2, 3):
        glob = WireModel(spec, dict(build(spec, seed=7 + r).state_dict()))
        models = {} if algorithm == "local" else {"global": glob}
        run_stacked(stacked, "fit", r, 3, [models] * len(stacked), masked=True, kept=store)

    # Assert
    assert len(loops_kept) == 3 and loops_kept[1] is not None
    assert loops_kept[1] == loops_kept[2]


def test_pfmls_work_model_is_kept_only_for_a_model_of_its_own_kind_and_layout():
    # Prepare: PFML's work model from last round, and this round's model to work on
    class Other(torch.nn.Sequential):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    same = torch.nn.Sequential(torch.nn.Linear(3, 2))
    other_kind = Other(torch.nn.Linear(3, 2))  # another forward, the same parameters
    other_shape = torch.nn.Sequential(torch.nn.Linear(3, 4))

    # Execute / Assert: kept where it is one of the model's kind and layout, else a copy
    assert _shaped_as(same, model) is same
    for kept in (None, other_kind, other_shape):
        work = _shaped_as(kept, model)
        assert work is not kept and type(work) is torch.nn.Sequential
        assert work[0].weight.shape == (2, 3)


@needs_cuda
@pytest.mark.parametrize("family", list(SHAPES))
def test_persfls_stage_two_stacked_on_cuda_distils_each_member_as_alone(family, monkeypatch):
    # Prepare: unequal PersFL clients alone and stacked (masked, captured), fp32 without cuDNN's
    # TF32, each given a teacher by a round of stage 1
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    dev = torch.device("cuda")
    spec, alone = _clients("persfl", dev, amp=False, epochs=1, family=family)
    _, stacked = _clients("persfl", dev, amp=False, epochs=1, family=family)
    models = _models("persfl", spec)
    for a in alone:
        a.fit(1, 2, models)
        a.fit(2, 2, models)
    run_stacked(stacked, "fit", 1, 2, [models] * len(stacked))
    run_stacked(stacked, "fit", 2, 2, [models] * len(stacked))

    # Execute: stage 2, the distillation grid
    expected = [a.finalize(2, 2, models) for a in alone]
    got = run_stacked(stacked, "finalize", 2, 2, [models] * len(stacked))

    # Assert: each member's grid point, scores and student as alone
    assert stacked[0].ctx.trainer.stats.graphs >= 1
    for e, g, a, s in zip(expected, got, alone, stacked, strict=True):
        assert g.details["distill_lambda"] == e.details["distill_lambda"]
        assert g.metrics == pytest.approx(e.metrics, rel=1e-4)
        for k, v in a.student.state_dict().items():
            assert torch.allclose(s.student.state_dict()[k], v, atol=1e-5), k
