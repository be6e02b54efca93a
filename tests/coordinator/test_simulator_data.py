"""How the simulator lays out the clients' data: each client's own samples, held once."""

import numpy as np
import torch
from tests_helpers import tiny_config

from coordinator.federation import _client_major, prepare_federation
from model_zoo.data import ClientSplit, Partition, load_dataset, partition


def test_prepare_federation_gives_clients_their_samples_as_views_of_one_buffer():
    # Prepare: the same data and partition, made independently of the simulator.
    cfg = tiny_config(clients=5, **{"data.partition": "dirichlet"})
    plain = load_dataset("digits", size=8, max_samples=800, seed=cfg.seed)
    part = partition(plain.y.numpy(), "dirichlet", 5, seed=cfg.seed, split=cfg.data.split)

    # Execute
    fed = prepare_federation(cfg)

    # Assert: every split holds exactly its partition's samples, in order, and shares storage
    # with the federation's data set (no per-client copy).
    base = fed.dataset.x.untyped_storage().data_ptr()
    for data, cs in zip(fed.client_data, part.clients, strict=True):
        for name, ix in (("train", cs.train), ("val", cs.val), ("test", cs.test)):
            idx = torch.from_numpy(ix)
            assert torch.equal(getattr(data, f"x_{name}"), plain.x[idx])
            assert torch.equal(getattr(data, f"y_{name}"), plain.y[idx])
            assert getattr(data, f"x_{name}").untyped_storage().data_ptr() == base
    # The reordered data set and its partition still describe the same clients.
    for cs_new, cs in zip(fed.partition.clients, part.clients, strict=True):
        assert torch.equal(fed.dataset.y[torch.from_numpy(cs_new.train)], plain.y[cs.train])


def test_client_major_gathers_copies_when_clients_share_samples():
    # Prepare: sample 1 belongs to both clients.
    ds = load_dataset("digits", size=8, max_samples=20, seed=0)
    x0 = ds.x.clone()
    part = Partition(
        "handmade",
        [
            ClientSplit(np.array([3, 1]), np.array([], dtype=np.int64), np.array([5])),
            ClientSplit(np.array([1, 7]), np.array([2]), np.array([0])),
        ],
    )

    # Execute
    moved, ranges = _client_major(ds, part)

    # Assert: the clients' samples in order, and the caller's data set untouched.
    assert torch.equal(moved.x, x0[[3, 1, 5, 1, 7, 2, 0]])
    assert [list(c.train) for c in ranges.clients] == [[0, 1], [3, 4]]
    assert torch.equal(ds.x, x0)
