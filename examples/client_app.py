"""A client app: your data, your architecture, one federation over MQTT. Run it as
`python examples/client_app.py BROKER_URL RUN_ID CLIENT_ID KEY_FILE ROSTER`."""

import sys

from edge_sdk.auth import AuthSettings, Keyring
from edge_sdk.client import EdgeClient
from edge_sdk.node import ClientNode
from edge_sdk.trainer import ClientData
from model_zoo import ArchSpec
from model_zoo.data import load_dataset

broker, run_id, me, key_file, roster = sys.argv[1:6]
digits = load_dataset("digits", size=8)  # stands in for your own (inputs, labels)
x, y = digits.x[int(me[-1]) :: 2], digits.y[int(me[-1]) :: 2]  # this client's half
a, b = len(y) * 6 // 10, len(y) * 8 // 10  # 60% train, 20% validation, 20% test
data = ClientData(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], num_classes=10)  # tensors
spec = ArchSpec(family="mlp", num_classes=10, input_shape=(1, 8, 8))  # its own architecture
keyring = Keyring.load(AuthSettings(key_file=key_file, roster=roster), me)  # from edgefl keys
onnx = f"{me}.onnx"  # where the model it deploys goes, verified against PyTorch
node = ClientNode(me, spec, data, run_id=run_id, onnx_path=onnx)  # what trains, on the device
client = EdgeClient(node, broker, keyring=keyring)  # ... served over its own MQTT connection
final = client.run()  # blocks until the federation ends: the final metrics, and what it deployed
print(f"{me} deployed {final.deployed.describe() if final.deployed else 'nothing (stopped)'}")
