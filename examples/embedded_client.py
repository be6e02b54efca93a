"""A client app that embeds the SDK: its own data, a zoo model, a per-round callback, ONNX export
after the federation, and on-device inference from the exported file.

Issue the run's signing keys, start a coordinator somewhere (any MQTT 3.1.1/5 broker; `edgefl
demo` prints its broker URL):

    edgefl keys --clients phone0,phone1 --out keys
    edgefl coordinator --broker mqtt://HOST:1883 --run-id phones --algorithm fml \\
        --clients 2 --rounds 3 --global-model mlr \\
        --set auth.key_file=keys/coordinator.key --set auth.roster=keys/roster.json

then run this on each edge device (here: two processes, each with its own slice of the digits
and its own key; every client gets the roster):

    python examples/embedded_client.py --broker mqtt://HOST:1883 --run-id phones --id phone0 \\
        --key-file keys/phone0.key --roster keys/roster.json
    python examples/embedded_client.py --broker mqtt://HOST:1883 --run-id phones --id phone1 \\
        --slice 1 --key-file keys/phone1.key --roster keys/roster.json

The broker password, if the broker wants one, comes from EDGEFL_BROKER__PASSWORD.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from edge_sdk.auth import AuthSettings, Keyring
from edge_sdk.client import EdgeClient, TaskOutcome
from edge_sdk.inference import OnnxPredictor
from edge_sdk.node import ClientNode
from edge_sdk.trainer import ClientData
from edge_sdk.transport.mqtt import BrokerSettings
from model_zoo import ArchSpec
from model_zoo.data import load_dataset


class Photos(Dataset):
    """Stands in for the app's own data: (image, label) pairs, as a torch Dataset."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", required=True, help="mqtt[s]://host:port")
    p.add_argument("--run-id", default="phones")
    p.add_argument("--id", default="phone0", help="this client's id")
    p.add_argument("--slice", type=int, default=0, help="which half of the digits it holds")
    p.add_argument("--model", default="mlp", help="this client's architecture family")
    p.add_argument("--out", default="runs/embedded", help="where the ONNX model goes")
    p.add_argument("--key-file", type=Path, required=True, help="this client's key (edgefl keys)")
    p.add_argument("--roster", type=Path, required=True, help="the run's roster.json")
    args = p.parse_args()
    # Everything this client sends is signed with its key; it obeys only the coordinator's.
    keyring = Keyring.load(AuthSettings(key_file=args.key_file, roster=args.roster), args.id)

    # 1. The client's own data: here a slice of scikit-learn's digits, as torch Datasets.
    digits = load_dataset("digits", size=8)
    mine = torch.arange(len(digits.y))[args.slice :: 2]
    n = len(mine)
    train, val, test = mine[: int(0.6 * n)], mine[int(0.6 * n) : int(0.8 * n)], mine[int(0.8 * n) :]
    data = ClientData.from_datasets(
        Photos(digits.x[train], digits.y[train]),
        Photos(digits.x[val], digits.y[val]),
        Photos(digits.x[test], digits.y[test]),
        num_classes=digits.num_classes,
    )

    # 2. Its own architecture from the zoo.
    spec = ArchSpec(family=args.model, num_classes=10, input_shape=digits.input_shape)

    # 3. A per-round callback: the app's progress bar, a notification, a log line.
    def on_task(t: TaskOutcome) -> None:
        m = t.metrics
        acc = ""
        if m.get("personal_total"):
            acc = (
                f", personalized accuracy {100 * m['personal_correct'] / m['personal_total']:.1f}%"
            )
        print(f"[{args.id}] round {t.round}/{t.rounds} {t.phase}: {'ok' if t.ok else t.error}{acc}")

    # 4. Join the federation and block until it ends; the model is exported (and verified) then.
    onnx_path = Path(args.out) / f"{args.id}.onnx"
    broker = BrokerSettings(url=args.broker, password=os.environ.get("EDGEFL_BROKER__PASSWORD"))
    node = ClientNode(
        args.id,
        spec,
        data,
        run_id=args.run_id,
        onnx_path=onnx_path,
        class_names=digits.classes,
        normalization=digits.normalization,
    )
    client = EdgeClient(node, broker, on_task=on_task, keyring=keyring)
    client.run()

    # 5. On-device inference needs nothing but onnxruntime and the file.
    predictor = OnnxPredictor(onnx_path)
    sample, truth = digits.x[test[:5]].numpy(), digits.y[test[:5]].tolist()
    print(f"[{args.id}] predicts {predictor.predict(sample).tolist()}, truth {truth}")


if __name__ == "__main__":
    main()
