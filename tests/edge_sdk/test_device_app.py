"""What a device app sees of the SDK: the arguments it passes are checked when it builds its
client, and `run()` says what the client deployed."""

from __future__ import annotations

import pytest
from tests_helpers import small_federation

from edge_sdk.client import EdgeClient


def test_normalization_with_other_keys_is_refused_when_the_client_is_built():
    # Before, {"mu", "sigma"} passed and failed only at the ONNX export after the last round.
    _, clients = small_federation(n=1)
    node = clients[0].node
    with pytest.raises(ValueError, match="exactly the keys 'mean' and 'std'"):
        EdgeClient("c0", node.spec, node.data, clients[0].transport, normalization={"mu": [0.5]})
    ok = EdgeClient(
        "c0", node.spec, node.data, clients[0].transport, normalization={"mean": [0.5], "std": [2]}
    )
    assert ok.node.normalization == {"mean": [0.5], "std": [2.0]}

