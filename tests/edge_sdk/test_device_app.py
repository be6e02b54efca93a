"""What a device app sees of the SDK: the arguments it passes are checked when it builds its
node, and `run()` says what the client deployed."""

from __future__ import annotations

import threading

import pytest
from tests_helpers import small_federation

from edge_sdk.client import FinalMetrics
from edge_sdk.node import ClientNode


def test_normalization_with_other_keys_is_refused_when_the_node_is_built():
    # Before, {"mu", "sigma"} passed and failed only at the ONNX export after the last round.
    _, clients = small_federation(n=1)
    node = clients[0].node
    with pytest.raises(ValueError, match="exactly the keys 'mean' and 'std'"):
        ClientNode("c0", node.spec, node.data, normalization={"mu": [0.5]})
    ok = ClientNode("c0", node.spec, node.data, normalization={"mean": [0.5], "std": [2]})
    assert ok.normalization == {"mean": [0.5], "std": [2.0]}


def test_run_returns_the_metrics_and_what_the_client_deployed():
    # Prepare: FML (whose guard chooses the deployed model) and FedAvg (no guard).
    for algorithm, guarded in (("fml", True), ("fedavg", False)):
        coordinator, clients = small_federation(algorithm=algorithm, rounds=1)
        returned: dict[str, FinalMetrics] = {}
        threads = [
            threading.Thread(
                target=lambda c=c, out=returned: out.__setitem__(c.client_id, c.run(60))
            )
            for c in clients
        ]

        # Execute
        for t in threads:
            t.start()
        coordinator.run()
        for t in threads:
            t.join(60)

        # Assert: still the metrics dict, now with what was deployed.
        for c in clients:
            final = returned[c.client_id]
            assert isinstance(final, dict) and final == c.last_metrics
            assert final["personal_total"] > 0
            deployed = final.deployed
            assert deployed is not None and deployed == c.deployed  # the client's own record
            assert deployed.choice == c.last_details["deployed"]
            assert deployed.arch == c.last_details["deployed_arch"] == "mlr"  # its own
            assert deployed.params == deployed.own_params > 0 and deployed.reason.endswith(".")
            if guarded:
                assert deployed.val_acc is not None
            else:
                assert deployed.val_acc is None and "no guard" in deployed.reason
