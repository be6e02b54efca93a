"""A device app's view: build an EdgeClient around your own data and let a coordinator drive it.

Here the coordinator runs in the same process over the in-memory transport, which is exactly
what `edgefl simulate` does; a deployment swaps the transport, not this code.

    .venv/bin/python examples/embedded_client.py
"""

from __future__ import annotations

from coordinator.server import Coordinator
from edge_sdk.algorithms import algorithm_class
from edge_sdk.client import EdgeClient
from edge_sdk.inference import OnnxPredictor
from edge_sdk.trainer import ClientData
from edge_sdk.transport import InMemoryBroker
from model_zoo import ArchSpec
from model_zoo.data import load_dataset, partition


def main() -> None:
    digits = load_dataset("digits", size=8)  # ships with scikit-learn: nothing downloads
    part = partition(digits.y, "dirichlet", 3, seed=0, alpha=0.5)
    broker = InMemoryBroker()
    config = algorithm_class("fml").config_cls(local_epochs=3, batch_size=32, lr=0.05)
    coordinator = Coordinator(
        broker.connect(),
        algorithm="fml",
        config=config,
        rounds=3,
        expected_clients=3,
        global_model="mlr",
        export_onnx=True,
    ).open()

    # Each device brings its own data and its own architecture.
    families = ["mlr", "mlp", "cnn1"]
    clients = []
    for i, split in enumerate(part.clients):
        x, y = digits.x, digits.y
        data = ClientData(
            x[split.train],
            y[split.train],
            x[split.val],
            y[split.val],
            x[split.test],
            y[split.test],
            num_classes=digits.num_classes,
        )
        spec = ArchSpec(family=families[i], num_classes=10, input_shape=digits.input_shape)
        client = EdgeClient(
            f"phone{i}",
            spec,
            data,
            broker.connect(),
            seed=i,
            onnx_path=f"runs/embedded/phone{i}.onnx",
            class_names=digits.classes,
            normalization=digits.normalization,
        )
        clients.append(client.start())

    result = coordinator.run()
    for c in result.clients:
        print(f"{c.id}: {c.arch:<5} personalized accuracy {c.personal_acc:.3f}")

    # The exported model needs nothing but onnxruntime on the device.
    predictor = OnnxPredictor("runs/embedded/phone2.onnx")
    sample = digits.x[:4].numpy()
    print("phone2 predicts", predictor.predict(sample).tolist(), "truth", digits.y[:4].tolist())
    for c in clients:
        c.stop()


if __name__ == "__main__":
    main()
