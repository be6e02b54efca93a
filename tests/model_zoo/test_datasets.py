"""Loaders: tiny files in the real formats written to tmp_path, the bundled / generated sets, and
the real Fashion-MNIST when the Debian package is installed."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from model_zoo.data import (
    SHAKESPEARE_VOCAB,
    Dataset,
    DatasetError,
    DatasetNotFound,
    UnknownDataset,
    dataset_names,
    load_dataset,
    read_idx,
    synthetic_arrays,
)

IDX_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FMNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")


# --------------------------------------------------------------------------- helpers


def _idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write(path: Path, data: bytes, gz: bool) -> None:
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def _write_idx_set(root: Path, *, gz: bool, n_train: int = 20, n_test: int = 10, seed: int = 0):
    """Four IDX files with random 28x28 images and labels cycling 0..9; returns pooled arrays."""
    rng = np.random.default_rng(seed)
    pooled_x, pooled_y = [], []
    for part, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        _write(root / IDX_STEMS[part][0], _idx_bytes(images), gz)
        _write(root / IDX_STEMS[part][1], _idx_bytes(labels), gz)
        pooled_x.append(images)
        pooled_y.append(labels)
    return np.concatenate(pooled_x), np.concatenate(pooled_y)


def _cifar_batch(n: int, rng: np.random.Generator, **labels: list[int]) -> dict[bytes, object]:
    batch: dict[bytes, object] = {
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"batch_label": b"test batch",
    }
    batch.update({k.encode(): v for k, v in labels.items()})
    return batch


def _dump(path: Path, obj: object) -> None:
    with path.open("wb") as f:
        pickle.dump(obj, f)


def _write_leaf(root: Path, split: str, name: str, users: dict[str, tuple[list, list]]) -> None:
    (root / split).mkdir(parents=True, exist_ok=True)
    obj = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    (root / split / name).write_text(json.dumps(obj))


class _CallsGetcwd:
    def __reduce__(self):
        return (os.getcwd, ())


# --------------------------------------------------------------------------- registry


def test_registry_lists_every_dataset():
    expected = ["cifar10", "cifar100", "digits", "fashion_mnist", "femnist", "mnist"]
    assert dataset_names() == sorted([*expected, "shakespeare", "synthetic"])


def test_registry_unknown_name_lists_known_names():
    with pytest.raises(UnknownDataset) as info:
        load_dataset("imagenet")
    assert isinstance(info.value, KeyError) and isinstance(info.value, DatasetError)
    assert "imagenet" in str(info.value) and "fashion_mnist" in str(info.value)


def test_registry_unknown_option_lists_accepted_ones():
    with pytest.raises(DatasetError, match=r"unknown option.*colour.*accepted.*size"):
        load_dataset("digits", colour=True)


# --------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_idx_loads_pooled_and_normalised(tmp_path, gz):
    images, labels = _write_idx_set(tmp_path, gz=gz)

    ds = load_dataset("fashion_mnist", root=tmp_path)

    assert ds.x.shape == (30, 1, 28, 28) and ds.x.dtype == torch.float32
    assert ds.y.dtype == torch.int64 and ds.y.tolist() == labels.tolist()
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10 and len(ds) == 30
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"
    mean, std = ds.normalization["mean"][0], ds.normalization["std"][0]
    scaled = images.astype(np.float64) / 255.0
    assert mean == pytest.approx(scaled.mean()) and std == pytest.approx(scaled.std())
    restored = ds.x.numpy()[:, 0].astype(np.float64) * std + mean
    np.testing.assert_allclose(restored, scaled, atol=1e-5)
    assert ds.groups is None


def test_mnist_raw_idx_has_digit_classes(tmp_path):
    _write_idx_set(tmp_path, gz=False)

    ds = load_dataset("mnist", root=tmp_path, normalize=False)

    assert ds.classes == [str(d) for d in range(10)]
    assert ds.normalization is None
    assert float(ds.x.min()) >= 0.0 and float(ds.x.max()) <= 1.0


def test_idx_max_samples_is_stratified_and_seeded(tmp_path):
    _write_idx_set(tmp_path, gz=True, n_train=100, n_test=100)

    a = load_dataset("mnist", root=tmp_path, max_samples=50, seed=1)
    b = load_dataset("mnist", root=tmp_path, max_samples=50, seed=1)
    c = load_dataset("mnist", root=tmp_path, max_samples=50, seed=2)

    assert len(a) == 50 and np.bincount(a.y.numpy()).tolist() == [5] * 10
    assert torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)
    full = load_dataset("mnist", root=tmp_path)
    assert a.normalization == full.normalization  # stats from the whole pool, not the subset


def test_idx_missing_file_names_file_directory_and_apt_hint(tmp_path):
    _write_idx_set(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()

    with pytest.raises(DatasetNotFound) as info:
        load_dataset("fashion_mnist", root=tmp_path)

    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "t10k-labels-idx1-ubyte" in message and str(tmp_path) in message
    assert "apt-get install -y dataset-fashion-mnist" in message


def test_mnist_missing_files_say_where_to_place_them(tmp_path):
    with pytest.raises(DatasetNotFound) as info:
        load_dataset("mnist", root=tmp_path)
    message = str(info.value)
    assert "train-images-idx3-ubyte" in message and str(tmp_path) in message
    assert "place" in message and "download" in message  # "Nothing is downloaded: place..."


def test_idx_bad_magic_raises_dataset_error(tmp_path):
    _write_idx_set(tmp_path, gz=False)
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes((2051).to_bytes(4, "big") + path.read_bytes()[4:])

    with pytest.raises(DatasetError, match="bad IDX magic number 2051"):
        load_dataset("mnist", root=tmp_path)


def test_idx_truncated_payload_raises_dataset_error(tmp_path):
    path = tmp_path / "images"
    path.write_bytes(_idx_bytes(np.zeros((3, 28, 28), dtype=np.uint8))[:-10])

    with pytest.raises(DatasetError, match="truncated or corrupt"):
        read_idx(path, 2051)


def test_real_fashion_mnist_subset_loads():
    if not (FMNIST_ROOT / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST not installed: apt-get install -y dataset-fashion-mnist")

    ds = load_dataset("fashion_mnist", max_samples=2000)

    assert ds.x.shape == (2000, 1, 28, 28)
    assert np.bincount(ds.y.numpy()).tolist() == [200] * 10
    assert ds.normalization["mean"][0] == pytest.approx(0.286, abs=0.01)
    assert ds.normalization["std"][0] == pytest.approx(0.353, abs=0.01)
    assert abs(float(ds.x.mean())) < 0.1 and float(ds.x.std()) == pytest.approx(1.0, abs=0.1)


# --------------------------------------------------------------------------- CIFAR


def _write_cifar10(directory: Path, per_batch: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    labels = []
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        lab = rng.integers(0, 10, size=per_batch).tolist()
        _dump(directory / name, _cifar_batch(per_batch, rng, labels=lab))
        labels += lab
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer"]
    names += [b"dog", b"frog", b"horse", b"ship", b"truck"]
    _dump(directory / "batches.meta", {b"label_names": names, b"num_vis": 3072})
    return np.asarray(labels)


def test_cifar10_loads_batches_from_standard_subdirectory(tmp_path):
    labels = _write_cifar10(tmp_path / "cifar-10-batches-py")

    ds = load_dataset("cifar10", root=tmp_path)

    assert ds.x.shape == (24, 3, 32, 32) and ds.x.dtype == torch.float32
    assert ds.y.tolist() == labels.tolist()
    assert ds.classes[1] == "automobile" and ds.num_classes == 10
    assert len(ds.normalization["mean"]) == 3
    per_channel = ds.x.transpose(0, 1).reshape(3, -1)
    np.testing.assert_allclose(per_channel.mean(1).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(per_channel.std(1, unbiased=False).numpy(), 1.0, atol=1e-3)


def test_cifar100_fine_and_coarse_labels(tmp_path):
    rng = np.random.default_rng(1)
    for name, n in (("train", 6), ("test", 4)):
        fine = rng.integers(0, 100, size=n).tolist()
        batch = _cifar_batch(n, rng, fine_labels=fine, coarse_labels=[f // 5 for f in fine])
        _dump(tmp_path / name, batch)
    meta = {
        b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
    }
    _dump(tmp_path / "meta", meta)

    fine_ds = load_dataset("cifar100", root=tmp_path)
    coarse_ds = load_dataset("cifar100", root=tmp_path, label="coarse")

    assert fine_ds.x.shape == (10, 3, 32, 32) and fine_ds.num_classes == 100
    assert coarse_ds.num_classes == 20 and coarse_ds.classes[3] == "coarse3"
    assert (coarse_ds.y == fine_ds.y // 5).all()


def test_cifar_missing_batch_names_it(tmp_path):
    _write_cifar10(tmp_path)
    (tmp_path / "data_batch_3").unlink()

    with pytest.raises(DatasetNotFound) as info:
        load_dataset("cifar10", root=tmp_path)
    assert "data_batch_3" in str(info.value) and str(tmp_path) in str(info.value)


def test_cifar_pickle_with_foreign_global_is_refused(tmp_path):
    _write_cifar10(tmp_path)
    _dump(tmp_path / "data_batch_2", {b"data": _CallsGetcwd(), b"labels": []})

    with pytest.raises(DatasetError, match="refusing to unpickle"):
        load_dataset("cifar10", root=tmp_path)


# --------------------------------------------------------------------------- LEAF


def test_femnist_pools_users_and_records_writers(tmp_path):
    rng = np.random.default_rng(0)

    def pixels(n):
        return rng.random((n, 784)).round(3).tolist()

    _write_leaf(
        tmp_path, "train", "a.json", {"w1": (pixels(3), [0, 10, 61]), "w2": (pixels(2), [5, 5])}
    )
    _write_leaf(tmp_path, "test", "a.json", {"w1": (pixels(1), [36]), "w2": (pixels(1), [1])})

    ds = load_dataset("femnist", root=tmp_path)
    one = load_dataset("femnist", root=tmp_path, max_users=1)

    assert ds.x.shape == (7, 1, 28, 28) and ds.x.dtype == torch.float32
    assert ds.y.tolist() == [0, 10, 61, 5, 5, 36, 1]
    assert ds.groups.tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert ds.num_classes == 62 and ds.classes[10] == "A" and ds.classes[36] == "a"
    assert ds.normalization is None
    assert len(one) == 4 and set(one.groups.tolist()) == {0}


def test_shakespeare_maps_characters_to_leaf_vocabulary(tmp_path):
    line = ("To be, or not to be: that is the question.\n" * 2)[:80]
    _write_leaf(tmp_path, "train", "s.json", {"HAMLET": ([line, line[1:] + "x"], ["W", "y"])})
    _write_leaf(tmp_path, "test", "s.json", {"OPHELIA": ([line], ["}"])})

    ds = load_dataset("shakespeare", root=tmp_path)

    assert len(SHAKESPEARE_VOCAB) == 80 and len(set(SHAKESPEARE_VOCAB)) == 80
    assert ds.x.shape == (3, 80) and ds.x.dtype == torch.int64
    assert "".join(SHAKESPEARE_VOCAB[i] for i in ds.x[0].tolist()) == line
    assert [SHAKESPEARE_VOCAB[i] for i in ds.y.tolist()] == ["W", "y", "}"]
    assert ds.classes == list(SHAKESPEARE_VOCAB) and ds.groups.tolist() == [0, 0, 1]


def test_shakespeare_unknown_character_dropped_or_refused(tmp_path):
    good, bad = "a" * 80, "a" * 79 + "$"
    _write_leaf(tmp_path, "train", "s.json", {"U": ([good, bad], ["b", "c"])})

    dropped = load_dataset("shakespeare", root=tmp_path)
    with pytest.raises(DatasetError, match=r"\$.*on_unknown='drop'"):
        load_dataset("shakespeare", root=tmp_path, on_unknown="error")

    assert len(dropped) == 1


def test_leaf_bad_json_raises_dataset_error(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "broken.json").write_text('{"users": ["u"], "user_data": {')

    with pytest.raises(DatasetError, match=r"broken\.json"):
        load_dataset("femnist", root=tmp_path)


def test_leaf_missing_folders_raise_not_found(tmp_path):
    with pytest.raises(DatasetNotFound, match=r"train/\*\.json"):
        load_dataset("shakespeare", root=tmp_path)


# --------------------------------------------------------------------------- generated


def test_digits_resized_to_28_and_raw_8():
    big = load_dataset("digits")
    raw = load_dataset("digits", size=8, normalize=False)

    assert big.x.shape == (1797, 1, 28, 28) and big.input_shape == (1, 28, 28)
    assert raw.x.shape == (1797, 1, 8, 8) and raw.normalization is None
    assert float(raw.x.min()) == 0.0 and float(raw.x.max()) == 1.0
    assert big.num_classes == 10 and abs(float(big.x.mean())) < 1e-4


def test_digits_are_scikit_learns_without_importing_it(monkeypatch):
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from model_zoo.data import generated

    want = load_digits()
    raw = load_dataset("digits", size=8, normalize=False)
    assert torch.equal(raw.y, torch.from_numpy(want.target.astype(np.int64)))
    assert torch.equal(raw.x.reshape(-1, 64) * 16, torch.from_numpy(want.data.astype(np.float32)))
    # A process that loads them never imports scikit-learn (most of a second, every process)
    code = "import sys; from model_zoo.data import load_dataset; load_dataset('digits', size=8)"
    code += "; print('sklearn' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False", run.stderr
    # ...and where the file is not where scikit-learn keeps it, its loader reads the same.
    monkeypatch.setattr(generated.importlib.util, "find_spec", lambda name: None)
    assert torch.equal(load_dataset("digits", size=8, normalize=False).x, raw.x)


def test_synthetic_defaults_follow_the_pfedme_recipe():
    ds = load_dataset("synthetic")

    sizes = np.bincount(ds.groups)
    expected = (np.random.RandomState(0).lognormal(4, 2, 100).astype(int) + 50) * 5
    assert sizes.tolist() == expected.tolist()
    assert sizes.min() >= 250 and (sizes.min(), sizes.max()) == (250, 25810)  # pFedMe's range
    assert ds.x.shape == (int(expected.sum()), 60) and ds.x.dtype == torch.float32
    assert ds.normalization is None and ds.classes == [str(c) for c in range(10)]
    assert len(np.unique(ds.y.numpy())) == 10


def test_synthetic_is_deterministic_per_seed():
    a = synthetic_arrays(num_users=8, seed=3)
    b = synthetic_arrays(num_users=8, seed=3)
    c = synthetic_arrays(num_users=8, seed=4)

    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)
    assert a[0].shape != c[0].shape or not np.array_equal(a[0], c[0])


def test_synthetic_input_means_differ_per_feature_unless_iid():
    x, _, g = synthetic_arrays(num_users=6, seed=0)
    xi, _, gi = synthetic_arrays(num_users=6, seed=0, iid=True)

    means = np.stack([x[g == k].mean(0) for k in range(6)])  # (users, 60)
    iid_means = np.stack([xi[gi == k].mean(0) for k in range(6)])
    # non-iid: v_k ~ N(B_k, 1) per feature; iid: v_k = B_k * 1, the same for every feature
    assert means.std(axis=1).mean() > 0.5
    assert iid_means.std(axis=1).mean() < 0.2


# --------------------------------------------------------------------------- container


def test_dataset_subset_keeps_metadata_and_groups():
    ds = load_dataset("synthetic", num_users=3, max_samples=300)

    sub = ds.subset(np.array([5, 0, 7]))

    assert len(sub) == 3 and torch.equal(sub.x[1], ds.x[0])
    assert sub.groups.tolist() == ds.groups[[5, 0, 7]].tolist()
    assert sub.classes == ds.classes and sub.input_shape == ds.input_shape


def test_dataset_rejects_inconsistent_fields():
    with pytest.raises(DatasetError, match="2 inputs but 3 labels"):
        Dataset("t", torch.zeros(2, 4), torch.zeros(3, dtype=torch.int64), ["a"], (4,), None)


def test_channel_stats_of_many_images_equal_the_float_mean_and_std():
    # More images than one histogram slice holds, three channels of different levels.
    from model_zoo.data.base import channel_stats_uint8

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(9000, 3, 4, 4), dtype=np.uint8)
    images[:, 1] //= 2
    images[5000:, 2] = 255
    mean, std = channel_stats_uint8(images)
    scaled = images.astype(np.float64) / 255.0
    np.testing.assert_allclose(mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, scaled.std(axis=(0, 2, 3)), rtol=1e-9)
