"""Partition schemes: coverage, skew, determinism, the train/val/test split, and the summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from model_zoo.data import (
    Partition,
    PartitionError,
    format_split_table,
    partition,
    partition_schemes,
    plot_label_distribution,
    split_summary,
)

NUM_CLASSES = 10
PER_CLASS = 150
COVERING = {"iid", "shards", "dirichlet", "ds2", "label_groups", "natural"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """1500 labels, 150 per class, in a shuffled order."""
    return np.random.default_rng(7).permutation(np.repeat(np.arange(NUM_CLASSES), PER_CLASS))


@pytest.fixture(scope="module")
def owners(labels) -> np.ndarray:
    """30 natural owners of unequal sizes (owner = index // 50, shuffled)."""
    return np.random.default_rng(8).permutation(np.arange(len(labels)) // 50)


def _make(labels, scheme, seed=0, owners=None, **params) -> Partition:
    num_clients = None if scheme == "natural" else params.pop("num_clients", 10)
    return partition(labels, scheme, num_clients, seed=seed, groups=owners, **params)


def _classes(p: Partition, labels: np.ndarray) -> list[set[int]]:
    return [set(labels[c.indices].tolist()) for c in p.clients]


def _sizes(p: Partition) -> np.ndarray:
    return np.array([len(c) for c in p.clients])


def _max_class_fraction(p: Partition, labels: np.ndarray) -> float:
    fractions = [np.bincount(labels[c.indices]).max() / len(c) for c in p.clients]
    return float(np.mean(fractions))


# --------------------------------------------------------------------------- every scheme


def test_scheme_list_is_complete():
    assert partition_schemes() == sorted(
        ["iid", "shards", "dirichlet", "ds1", "ds2", "ds3", "ds4", "label_groups", "natural"]
    )


@pytest.mark.parametrize("scheme", sorted(COVERING | {"ds1", "ds3", "ds4"}))
def test_scheme_assigns_each_index_once_and_in_range(labels, owners, scheme):
    p = _make(labels, scheme, owners=owners)

    everything = np.concatenate([c.indices for c in p.clients])
    assert everything.dtype == np.int64
    assert len(np.unique(everything)) == len(everything)  # no index in two clients or parts
    assert everything.min() >= 0 and everything.max() < len(labels)
    if scheme in COVERING:
        assert len(everything) == len(labels)  # none lost
    assert p.scheme == scheme and p.params["seed"] == 0


@pytest.mark.parametrize("scheme", partition_schemes())
def test_scheme_is_deterministic_per_seed(labels, owners, scheme):
    a = _make(labels, scheme, seed=1, owners=owners)
    b = _make(labels, scheme, seed=1, owners=owners)
    c = _make(labels, scheme, seed=2, owners=owners)

    for x, y in zip(a.clients, b.clients, strict=True):
        for part in ("train", "val", "test"):
            np.testing.assert_array_equal(getattr(x, part), getattr(y, part))
    assert any(
        not np.array_equal(x.train, y.train) for x, y in zip(a.clients, c.clients, strict=False)
    )


@pytest.mark.parametrize("scheme", partition_schemes())
def test_split_fractions_are_respected_within_one(labels, owners, scheme):
    p = _make(labels, scheme, owners=owners)

    for c in p.clients:
        n = len(c)
        assert abs(len(c.train) - 0.6 * n) <= 1
        assert abs(len(c.val) - 0.2 * n) <= 1
        assert abs(len(c.test) - 0.2 * n) <= 1
        assert len(c.train) >= 1 and len(c.test) >= 1


def test_split_without_validation(labels):
    p = partition(labels, "iid", 5, split=(0.75, 0.0, 0.25))

    assert all(len(c.val) == 0 for c in p.clients)
    assert all((len(c.train), len(c.test)) == (225, 75) for c in p.clients)
    assert p.params["split"] == [0.75, 0.0, 0.25]


def test_split_is_stratified_by_label(labels):
    p = partition(labels, "iid", 2, split=(0.5, 0.0, 0.5))

    for c in p.clients:
        train, test = np.bincount(labels[c.train], minlength=10), np.bincount(labels[c.test])
        assert np.abs(train - test).max() <= 1


def test_tiny_client_gets_one_train_and_one_test():
    p = partition(np.array([0, 1, 0]), "iid", 1, split=(0.8, 0.1, 0.1))

    assert (len(p.clients[0].train), len(p.clients[0].test)) == (2, 1)


def test_client_with_fewer_than_three_samples_is_refused():
    with pytest.raises(PartitionError, match="client 0 has 2 sample"):
        partition(np.arange(10) % 2, "iid", 5)


def test_torch_labels_are_accepted(labels):
    a = partition(torch.from_numpy(labels), "shards", 5, seed=3)
    b = partition(labels, "shards", 5, seed=3)

    assert all(np.array_equal(x.train, y.train) for x, y in zip(a.clients, b.clients, strict=True))


# --------------------------------------------------------------------------- skew per scheme


def test_iid_clients_have_equal_sizes_and_all_classes(labels):
    p = _make(labels, "iid")

    assert set(_sizes(p).tolist()) == {150}
    assert all(len(s) == NUM_CLASSES for s in _classes(p, labels))


@pytest.mark.parametrize("p_classes", [6, 4, 2])
def test_shards_give_exactly_p_distinct_classes(labels, p_classes):
    p = partition(labels, "shards", 5, classes_per_client=p_classes)

    assert all(len(s) == p_classes for s in _classes(p, labels))
    assert [sorted(s) for s in _classes(p, labels)] == p.params["client_classes"]


def test_dirichlet_small_alpha_skews_labels_more_than_large(labels):
    skewed = _max_class_fraction(_make(labels, "dirichlet", alpha=0.1), labels)
    uniform = _max_class_fraction(_make(labels, "dirichlet", alpha=100.0), labels)

    assert skewed > 0.4 and uniform < 0.2 and skewed > 2 * uniform


def test_dirichlet_size_alpha_skews_client_sizes(labels):
    even = _sizes(_make(labels, "dirichlet", alpha=100.0))
    skewed = _sizes(_make(labels, "dirichlet", alpha=100.0, size_alpha=1.0))

    assert skewed.std() / skewed.mean() > 3 * (even.std() / even.mean())
    assert skewed.min() >= 10  # min_size held


def test_dirichlet_impossible_min_size_fails_clearly(labels):
    with pytest.raises(PartitionError, match="cannot give 10 clients 200 each"):
        _make(labels, "dirichlet", min_size=200)
    with pytest.raises(PartitionError, match=r"no draw in 3 .*raise alpha"):
        _make(labels, "dirichlet", alpha=0.01, min_size=140, max_attempts=3)


def test_ds1_equal_sizes_and_k_overlapping_classes(labels):
    p = _make(labels, "ds1", classes_per_client=4)

    classes = _classes(p, labels)
    assert all(len(s) == 4 for s in classes)
    assert len(set(_sizes(p).tolist())) == 1
    assert classes[0] == {0, 1, 2, 3} and classes[1] == {1, 2, 3, 4} and classes[9] == {9, 0, 1, 2}


def test_ds2_all_classes_unequal_sizes(labels):
    p = _make(labels, "ds2")

    assert all(len(s) == NUM_CLASSES for s in _classes(p, labels))
    assert len(set(_sizes(p).tolist())) > 1 and p.params["alpha"] == 0.9


def test_ds3_two_classes_lognormal_sizes(labels):
    p = _make(labels, "ds3", num_clients=20)

    sizes = _sizes(p)
    assert all(len(s) == 2 for s in _classes(p, labels))
    assert sizes.max() > 4 * sizes.min()
    assert p.params["sigma"] == 2.0


def test_ds4_two_client_types(labels):
    p = _make(labels, "ds4", k=20)

    first, last = set(range(5)), set(range(5, 10))
    for i, c in enumerate(p.clients):
        counts = np.bincount(labels[c.indices], minlength=10)
        if i < 5:  # type A: k of each of the first five classes
            assert counts[:5].tolist() == [20] * 5 and counts[5:].sum() == 0
        else:  # type B: k/2 of one of the first five, 2k of one of the last five
            held = set(np.flatnonzero(counts).tolist())
            assert len(held & first) == 1 and len(held & last) == 1
            assert sorted(counts[counts > 0].tolist()) == [10, 40]


def test_ds4_default_k_is_largest_feasible_and_too_large_k_fails(labels):
    p = _make(labels, "ds4")
    k = p.params["k"]

    assert k >= 2
    with pytest.raises(PartitionError, match="not feasible"):
        _make(labels, "ds4", k=k + 1)


@pytest.mark.parametrize("num_groups", [2, 3])
def test_label_groups_clients_stay_inside_disjoint_groups(labels, num_groups):
    p = _make(labels, "label_groups", num_groups=num_groups)

    groups = [set(g) for g in p.params["label_groups"]]
    assert sum(len(g) for g in groups) == NUM_CLASSES and set().union(*groups) == set(range(10))
    for i, s in enumerate(_classes(p, labels)):
        assert s <= groups[i % num_groups]  # round-robin assignment


def test_natural_gives_one_owner_per_client(labels, owners):
    every = _make(labels, "natural", owners=owners)
    first = partition(labels, "natural", 4, groups=owners)

    assert len(every) == 30 and len(first) == 4
    for i, c in enumerate(every.clients):
        assert set(owners[c.indices].tolist()) == {i} and len(c) == 50


# --------------------------------------------------------------------------- errors


def test_natural_without_groups_is_refused(labels):
    with pytest.raises(PartitionError, match="groups"):
        partition(labels, "natural", None)


def test_unknown_scheme_and_parameter_are_refused(labels):
    with pytest.raises(PartitionError, match="known schemes: dirichlet"):
        partition(labels, "powerlaw", 4)
    with pytest.raises(PartitionError, match=r"takes no parameter.*beta.*accepted: alpha"):
        partition(labels, "dirichlet", 4, beta=1.0)


@pytest.mark.parametrize("split", [(0.5, 0.2, 0.2), (0.8, 0.2, 0.0), (0.6, -0.1, 0.5)])
def test_bad_split_is_refused(labels, split):
    with pytest.raises(PartitionError, match="split"):
        partition(labels, "iid", 4, split=split)


def test_shards_too_many_classes_per_client_is_refused(labels):
    with pytest.raises(PartitionError, match=r"classes_per_client must be in 1\.\.10"):
        partition(labels, "shards", 4, classes_per_client=11)


# --------------------------------------------------------------------------- records, summaries


def test_partition_round_trips_through_json(labels):
    p = _make(labels, "ds3")

    back = Partition.from_dict(json.loads(json.dumps(p.to_dict())))

    assert back.scheme == "ds3" and back.params == p.params and len(back) == len(p)
    assert all(np.array_equal(a.test, b.test) for a, b in zip(p.clients, back.clients, strict=True))
    np.testing.assert_array_equal(back.client_indices(2), p.client_indices(2))


def test_split_summary_rows_and_table(labels):
    p = partition(labels, "shards", 5, classes_per_client=2)

    rows = split_summary(p, labels, class_names=[f"c{i}" for i in range(10)])
    table = format_split_table(rows)

    assert len(rows) == 5
    assert all(r["n_total"] == r["n_train"] + r["n_val"] + r["n_test"] == 300 for r in rows)
    assert all(r["n_classes"] == 2 and len(r["top_classes"]) == 2 for r in rows)
    lines = table.splitlines()
    assert lines[0].split() == [
        "client",
        "n_train",
        "n_val",
        "n_test",
        "n_total",
        "n_classes",
        "top_classes",
    ]
    assert len(lines) == 7 and "c" in lines[2] and "300" in lines[2]


def test_plot_label_distribution_writes_a_png(labels, tmp_path):
    p = _make(labels, "dirichlet")

    path = plot_label_distribution(p, labels, tmp_path / "plots" / "labels.png")

    data = path.read_bytes()
    assert path == tmp_path / "plots" / "labels.png"
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    assert [f.name for f in path.parent.iterdir()] == ["labels.png"]  # no temp file left


def test_the_label_plot_of_a_population_draws_its_first_clients_and_says_so(
    labels, tmp_path, monkeypatch
):
    # Prepare: 150 clients, more than a plot draws; catch the figure as it is saved
    from matplotlib.figure import Figure

    p = _make(labels, "iid", num_clients=150)
    saved: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), save(fig, *a, **k))
    )

    # Execute
    plot_label_distribution(p, labels, tmp_path / "labels.png")

    # Assert: a bar for each of the first 100 clients, and the title says which
    (axes,) = saved[0].axes
    assert [t.get_text() for t in axes.get_yticklabels()] == [str(i) for i in range(100)]
    assert axes.get_title() == "label distribution per client (iid): the first 100 of 150"


def test_shards_with_fewer_shards_than_classes_leaves_classes_unused():
    labels = np.repeat(np.arange(10), 30)
    part = partition(labels, "shards", 3, seed=0, classes_per_client=2)  # 6 shards, 10 classes
    used = {int(c) for cs in part.clients for c in labels[cs.indices]}
    assert len(used) == 6
    assert all(len(set(labels[cs.indices].tolist())) == 2 for cs in part.clients)
