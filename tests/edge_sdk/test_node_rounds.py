"""A client node's rounds: a round run again starts from the state before it, and a round the
coordinator did not keep leaves no trace in the client's state."""

import torch

from edge_sdk.node import ClientNode, NodeTask
from edge_sdk.trainer import ClientData
from model_zoo import ArchSpec

SPEC = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
CONFIG = {"local_epochs": 1, "batch_size": 4, "lr": 0.1, "momentum": 0.9}


def _node() -> ClientNode:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(24) % 3
    x = torch.randn(24, 4, generator=g) + y.view(-1, 1).float()
    data = ClientData(x, y, x[:6], y[:6], x[:6], y[:6], num_classes=3)
    return ClientNode("c0", SPEC, data)


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
    before = _tensors(node._current().state_dict())
    assert any("momentum_buffer" in k for k in before)

    # Execute: round 2, round 2 again (a retry starts from the state before it), then round 3
    # told that round 1 is the last one kept (round 2 failed after its retry).
    node.run(_fit(2))
    node.run(_fit(2))
    node.begin(_fit(3, kept_round=1))

    # Assert: the state round 3 starts from is round 1's, tensor for tensor.
    after = _tensors(node._current().state_dict())
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
