"""A client node's rounds: a round run again starts from the state before it, and a round the
coordinator did not keep leaves no trace in the client's state."""

import pytest
import torch

from coordinator.stacking import Stacking
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.graphs import footprint
from edge_sdk.node import ClientNode, NodeTask
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

SPEC = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
CONFIG = {"local_epochs": 1, "batch_size": 4, "lr": 0.1, "momentum": 0.9}


def _node(i: int = 0) -> ClientNode:
    g = torch.Generator().manual_seed(i)
    y = torch.arange(24) % 3
    x = torch.randn(24, 4, generator=g) + y.view(-1, 1).float()
    data = ClientData(x, y, x[:6], y[:6], x[:6], y[:6], num_classes=3)
    return ClientNode(f"c{i}", SPEC, data, seed=i)


def _fit(round_: int, kept_round: int | None = None) -> NodeTask:
    return NodeTask(round_, 3, "fit", "local", CONFIG, kept_round=kept_round)


def _tensors(state, prefix=""):
    """Every tensor of a state_dict() by its path (the optimizer's momentum included)."""
    if isinstance(state, torch.Tensor):
        return {prefix: state.clone()}
    if isinstance(state, dict):
        out = {}
        for k, v in state.items():
            out |= _tensors(v, f"{prefix}/{k}")
        return out
    return {}


def test_a_round_run_twice_then_not_kept_leaves_the_state_before_it_momentum_included():
    # Prepare: round 1 trained and kept; its state, momentum buffers included, recorded.
    node = _node()
    node.run(_fit(1))
    before = _tensors(node.current().state_dict())
    assert any("momentum_buffer" in k for k in before)

    # Execute: round 2, round 2 again (a retry starts from the state before it), then round 3
    # told that round 1 is the last one kept (round 2 failed after its retry).
    node.run(_fit(2))
    node.run(_fit(2))
    node.begin(_fit(3, kept_round=1))

    # Assert: the state round 3 starts from is round 1's, tensor for tensor.
    after = _tensors(node.current().state_dict())
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def _stacked_round(nodes, task):
    for n in nodes:
        n.begin(task)
    results = Stacking().execute_together(nodes, [task] * len(nodes))
    assert all(not isinstance(r, Exception) for r in results)
    for n, r in zip(nodes, results, strict=True):
        n.end(task, r)


def test_a_stacked_round_run_twice_then_not_kept_leaves_each_state_before_it(monkeypatch):
    # Prepare: three clients that train as one stack (the stacked round does not copy each
    # node's state before it: it gives the members new tensors instead); round 1 kept.
    import coordinator.stacking.cohort as cohort

    stacks = []
    real = cohort.run_stacked
    monkeypatch.setattr(
        "coordinator.stacking.groups.run_stacked",
        lambda algos, *a, **k: stacks.append(len(algos)) or real(algos, *a, **k),
    )
    nodes = [_node(i) for i in range(3)]
    _stacked_round(nodes, _fit(1))
    before = [_tensors(n.current().state_dict()) for n in nodes]

    # Execute: round 2 stacked, again, then round 3 told round 1 is the last one kept.
    _stacked_round(nodes, _fit(2))
    trained = [_tensors(n.current().state_dict()) for n in nodes]
    _stacked_round(nodes, _fit(2))
    for n in nodes:
        n.begin(_fit(3, kept_round=1))

    # Assert: every round ran as one stack, round 2 changed the weights, and each client starts
    # round 3 from its round-1 state, tensor for tensor.
    assert stacks == [3, 3, 3]
    for b, t in zip(before, trained, strict=True):
        assert any(not torch.equal(t[k], v) for k, v in b.items())
    for n, b in zip(nodes, before, strict=True):
        after = _tensors(n.current().state_dict())
        assert after.keys() == b.keys()
        for k, v in b.items():
            assert torch.equal(after[k], v), (n.client_id, k)


@pytest.mark.parametrize("algorithm", ["fml", "fedavg", "local"])
def test_a_devices_training_loop_reads_the_same_tensors_every_round(algorithm, monkeypatch):
    # Prepare: one node's rounds, as a device runs them (the global model new every round);
    # what each training loop says its step reads, before and after the loop
    node = _node()
    seen = []
    real = Trainer.run

    def watched(self, step, batches, values=1, *, keep=()):
        seen.append(footprint(*keep))
        out = real(self, step, batches, values, keep=keep)
        seen.append(footprint(*keep))
        return out

    monkeypatch.setattr(Trainer, "run", watched)
    config = CONFIG | ({"alpha_gate": "off"} if algorithm == "fml" else {})

    # Execute
    for r in (1, 2, 3):
        glob = {"global": WireModel.of(SPEC, build(SPEC, seed=10 + r))}
        node.run(NodeTask(r, 3, "fit", algorithm, config, {} if algorithm == "local" else glob))

    # Assert: from the end of one round's loop to the start of the next, the same tensors at
    # the same addresses with the same settings: on CUDA its captured step is replayed
    assert len(seen) == 6 and all(f is not None for f in seen)
    assert seen[1] == seen[2] and seen[3] == seen[4]
