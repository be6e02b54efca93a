"""The pieces without a federation: a zoo model, a dataset split across clients, an ONNX file,
and inference on the device from that file alone."""

from edge_sdk.export import export_onnx
from edge_sdk.inference import OnnxPredictor
from model_zoo import ArchSpec, build
from model_zoo.data import format_split_table, load_dataset, partition, split_summary

ds = load_dataset("digits")  # never downloads: scikit-learn's digits, 28x28 like Fashion-MNIST
part = partition(ds.y, "dirichlet", 10, seed=0, alpha=0.5)  # 10 clients, skewed labels
print(format_split_table(split_summary(part, ds.y.numpy())))

spec = ArchSpec(family="lenet5", num_classes=10, input_shape=ds.input_shape)
model = build(spec, seed=0)  # (train it; a federation does)
export_onnx(model, spec, "lenet5.onnx", class_names=ds.classes, normalization=ds.normalization)

# A device needs only the .onnx file: spec, class names and normalisation ride in its metadata.
predictor = OnnxPredictor("lenet5.onnx")
labels = predictor.predict(ds.x[:8])  # a dataset's x is normalised already: predict as is
# Raw inputs from a sensor, scaled to [0, 1], take the file's normalisation exactly once:
# labels = predictor.predict(raw_images, normalize=True)
print([predictor.class_names[i] for i in labels])
