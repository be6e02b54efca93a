"""How the simulator lays out the clients' data: each client's own samples, held once."""

import numpy as np
import torch
from tests_helpers import tiny_config

from coordinator.federation import _client_major, prepare_federation
from coordinator.simulator import simulate
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


def test_data_seed_picks_the_subset_and_split_whatever_the_run_seed():
    # Prepare: the data side of seed 7, made independently of the simulator.
    plain = load_dataset("digits", size=8, max_samples=800, seed=7)
    part = partition(plain.y.numpy(), "dirichlet", 5, seed=7, split=(0.6, 0.2, 0.2))
    flags = {"clients": 5, "data.partition": "dirichlet"}

    # Execute: the run's seed 3 with the data's seed 7, and seed 3 alone
    fed = prepare_federation(tiny_config(seed=3, **flags, **{"data.seed": 7}))
    other = prepare_federation(tiny_config(seed=3, **flags))

    # Assert: seed 7's samples for every client; seed 3 alone splits otherwise
    for data, cs in zip(fed.client_data, part.clients, strict=True):
        for name, ix in (("train", cs.train), ("val", cs.val), ("test", cs.test)):
            assert torch.equal(getattr(data, f"y_{name}"), plain.y[torch.from_numpy(ix)])
            assert torch.equal(getattr(data, f"x_{name}"), plain.x[torch.from_numpy(ix)])
    assert [len(d.y_train) for d in other.client_data] != [len(cs.train) for cs in part.clients]


def test_data_seed_holds_out_the_same_unlabeled_set():
    flags = {"algorithm": "fedme", "overrides": {"fedme.unlabeled_size": 50}}
    fixed = prepare_federation(tiny_config(seed=3, **flags, **{"data.seed": 7}))
    same = prepare_federation(tiny_config(seed=7, **flags))
    assert torch.equal(fixed.server_data.unlabeled, same.server_data.unlabeled)
    assert not torch.equal(
        fixed.server_data.unlabeled,
        prepare_federation(tiny_config(seed=3, **flags)).server_data.unlabeled,
    )


def test_runs_on_one_data_seed_differ_only_in_training():
    def run(seed):
        flags = {"data.seed": 0, "data.partition": "dirichlet"}
        res = simulate(tiny_config(algorithm="local", seed=seed, rounds=1, **flags), progress=False)
        return [c.model_dump() for c in res.split.clients], [c.personal_acc for c in res.clients]

    split0, accs0 = run(0)
    split1, accs1 = run(1)
    assert split0 == split1
    assert accs0 != accs1


def test_federico_is_told_the_rounds_that_give_its_largest_client_local_trainings_passes(caplog):
    # Prepare: local training at 3 epochs a round; FedeRiCo one batch a round.
    from coordinator.simulator import _federico_budget

    cfg = tiny_config(
        algorithm="federico",
        rounds=2,
        baselines=["local"],
        overrides={"local.local_epochs": 3},
        **{"data.partition": "dirichlet"},
    )
    fed = prepare_federation(cfg)
    sizes = [len(d.y_train) for d in fed.client_data]
    n = max(sizes)
    assert min(sizes) < n  # clients of different sizes: the largest is the one that counts
    batch = cfg.federico.batch_size
    rounds = -(-2 * 3 * n // batch)  # local training's 6 passes of the largest client

    # Execute: the run's 2 rounds, then as many as local training's passes take
    with caplog.at_level("INFO", logger="coordinator.simulator"):
        _federico_budget(cfg, fed)
        _federico_budget(cfg.model_copy(update={"rounds": rounds}), fed)

    # Assert: a warning below one pass over the largest client's data, information above it;
    # the first names the rounds of a run of federico's own with local training's 6 passes.
    said = [r for r in caplog.records if "federico takes" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "INFO"]
    first = said[0].getMessage()
    assert f"run federico on its own with --rounds {rounds}" in first, first


def test_batches_as_large_as_most_clients_data_are_named_with_a_batch_size_that_trains(caplog):
    # Prepare: batches of 256 on clients of about 120 training samples (fml and its baseline),
    # and the same split at 16 a batch.
    from coordinator.simulator import _batch_budget

    big = tiny_config(algorithm="fml", batch_size=256, baselines=["local"])
    small = tiny_config(algorithm="fml", batch_size=16, baselines=["local"])
    fed = prepare_federation(big)
    sizes = sorted(len(d.y_train) for d in fed.client_data)
    median = sizes[len(sizes) // 2]

    # Execute
    with caplog.at_level("WARNING", logger="coordinator.simulator"):
        _batch_budget(big, fed)
        _batch_budget(small, fed)

    # Assert: one warning, for the big batches, naming both runs, every client's one step and a
    # batch size that gives the median client at least 5 steps an epoch
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("fml, local: batches of 256 samples"), said
    assert f"one step for {len(sizes)} of {len(sizes)} clients" in said[0]
    suggested = int(said[0].split("--batch-size ")[1].split()[0])
    assert median / suggested >= 5 and suggested >= 1


def test_students_learning_on_many_samples_are_named_with_the_setting_that_bounds_them(caplog):
    # Prepare: FML on 8×8 digit images, its students 300 epochs of 4 views (over 100,000 samples
    # on the largest client), unbounded and bounded; and at the default epochs.
    from coordinator.simulator import _student_budget

    long = {"fml.guard_distill_epochs": 300, "fml.guard_distill_views": 4}
    unbounded = tiny_config(algorithm="fml", overrides=long)
    bounded = tiny_config(algorithm="fml", overrides=long | {"fml.guard_distill_samples": 64000})
    default = tiny_config(algorithm="fml")
    fed = prepare_federation(unbounded)
    largest = max(len(d.y_train) for d in fed.client_data)

    # Execute
    with caplog.at_level("WARNING", logger="coordinator.simulator"):
        for cfg in (unbounded, bounded, default):
            _student_budget(cfg, fed)

    # Assert: one warning, for the unbounded students, with their samples and the setting
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"fml: each of the guard's students on the largest client learns on {300 * 4 * largest:,} "
        f"samples (300 epochs of 4 views of {largest})"
    )
    assert "--set fml.guard_distill_samples=64000 bounds each student" in said[0]


def test_a_population_evaluated_whole_is_named_with_the_settings_that_sample_it(caplog):
    # Prepare: 1,000 clients (only their ids are read), 100 or 200 trained a round, with and
    # without an evaluation sample
    from types import SimpleNamespace

    from coordinator.simulator import _population_budget

    fed = SimpleNamespace(client_ids=[f"c{i}" for i in range(1000)])
    whole = tiny_config(clients=1000, clients_per_round=100)
    sampled = tiny_config(clients=1000, clients_per_round=100, **{"round.eval_clients": 200})
    big_cohorts = tiny_config(clients=1000, clients_per_round=200)
    everyone = tiny_config(clients=1000)

    # Execute
    with caplog.at_level("WARNING", logger="coordinator.simulator"):
        for cfg in (whole, sampled, big_cohorts, everyone):
            _population_budget(cfg, fed)

    # Assert: one warning, for the population 10 cohorts large evaluated whole, naming a sample
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("1000 clients, 100 trained a round: every evaluating round")
    assert "--set round.eval_clients=200 evaluates and finalizes a sample" in said[0]
