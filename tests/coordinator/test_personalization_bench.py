"""benchmarks/personalization.py: every split resolves to a valid run for every method, and the
summary's arithmetic (win/tie/loss, the t-interval, passes) matches values computed here."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from coordinator.config import load_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "personalization.py"
_spec = importlib.util.spec_from_file_location("personalization", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["personalization"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

METHODS = ["local", "fedavg_ft", *bench.ALGORITHMS]


@pytest.mark.parametrize("size", sorted(bench.SIZES))
@pytest.mark.parametrize("method", METHODS)
def test_every_split_resolves_for_every_method_with_the_common_budget(size, method):
    budget = bench.SIZES[size]
    for split in bench.splits(budget).values():
        flags = {**split.flags, "algorithm": method, "models": list(split.models)}
        cfg = load_config(None, flags | bench._budget(budget, method), environ=False)
        section = cfg.algorithm_config(method)
        if method != "federico":  # one step per round: it gets rounds instead
            assert section.local_epochs == budget.local_epochs
            assert section.batch_size == budget.batch_size
        assert cfg.data.partition == split.flags["data.partition"]


def test_label_groups_give_every_group_every_architecture():
    for size in bench.SIZES.values():
        split = bench.splits(size)["lg-fmnist"]
        k, groups = split.flags["clients"], split.flags["data.partition_params"]["num_groups"]
        archs = {
            g: {split.models[i % 3] for i in range(k) if i % groups == g} for g in range(groups)
        }
        assert all(a == set(split.models) for a in archs.values())


def _run(accs, samples=None, n=10):
    clients = [
        {"personal_acc": a, "n_train": n, "samples_processed": s}
        for a, s in zip(accs, samples or [n] * len(accs), strict=True)
    ]
    return bench.Run("x", "s", 0, None, 1.0, clients)


def test_per_client_accuracy_is_averaged_over_the_seeds_in_points():
    runs = [_run([0.5, 0.9]), _run([0.7, 0.8])]
    assert bench._per_client(runs) == pytest.approx([60.0, 85.0])


def test_win_tie_loss_counts_a_tie_within_one_point():
    ours = [80.0, 80.0, 80.0, 80.0]
    theirs = [78.0, 79.5, 80.9, 82.0]  # +2 win, +0.5 tie, -0.9 tie, -2 loss
    assert bench._wtl(ours, theirs) == "1/2/1"


def test_ci95_is_the_t_interval_of_the_mean():
    values = [80.0, 82.0, 87.0]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    assert bench._ci95(values) == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-6)
    assert math.isnan(bench._ci95([80.0]))


def test_the_mean_mixture_weight_counts_only_the_mixtures_deployed():
    run = _run([0.5, 0.6, 0.7, 0.8])
    mixture, own = "personal+finetuned (final, mixture)", "personal (final, mlp)"
    choices = zip([mixture, mixture, own, None], [0.25, 0.5, 1.0, None], strict=True)
    for c, (choice, w) in zip(run.clients, choices, strict=True):
        c.update(deployed=choice, guard_mix_weight=w)
    assert bench._mix_weight([run]) == pytest.approx(0.375)
    assert bench._mix_weight([_run([0.5])]) is None  # an algorithm without the guard


def test_passes_are_samples_processed_over_training_samples():
    assert bench._passes([_run([0.5, 0.5], samples=[30, 50])]) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("choice", "kind"),
    [
        ("personal+finetuned (final, mixture)", "mixture"),
        ("personal (final, mlp)", "own"),
        (None, "own"),  # the guard off: the algorithm's own model
        ("finetuned (final, mlr)", "finetuned"),
        ("meme (round 3, mlr)", "other"),
        ("personal (round 2, mlp)", "other"),  # an earlier round's copy
    ],
)
def test_what_a_guard_deployed_is_read_from_its_choice(choice, kind):
    assert bench._deployed(choice) == kind


@pytest.mark.parametrize("size", sorted(bench.SIZES))
def test_digits_leaves_fedmes_unlabeled_set_images_no_client_holds(size):
    budget = bench.SIZES[size]
    for name in ("dir0.1-digits", "dir0.5-digits"):
        assert bench.splits(budget)[name].flags["data.max_samples"] + budget.unlabeled <= 1797


def test_a_kept_run_is_reused_only_for_the_same_config(tmp_path, monkeypatch):
    # Prepare: a tiny split and budget, and a count of the simulations really run
    split = bench.Split(
        "tiny",
        "digits, 2 clients",
        {"data.dataset": "digits", "data.max_samples": 200, "clients": 2, "data.partition": "iid"},
        ("mlr",),
    )
    size = bench.Size(1, 1, 16, 0.01, clients=2, samples=200, group_samples=200, unlabeled=50)
    runs = []
    real = bench.simulate
    monkeypatch.setattr(bench, "simulate", lambda cfg, **kw: runs.append(cfg) or real(cfg, **kw))

    # Execute: the same run twice, once more with another algorithm's field changed (it does
    # not run), as kept by an edgefl without a setting, then with settings of its own changed,
    # then on another subset
    first = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN)
    again = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN)
    not_its_own = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN, {"fml.guard_z": 3})
    assert len(runs) == 1 and again == first and not_its_own == first
    # kept by an edgefl without a setting: reused where this run holds it at its default
    path = tmp_path / "runs" / "tiny" / "0" / "local-own.json"
    kept = json.loads(path.read_text())
    del kept["config"]["onnx_exporter"]
    path.write_text(json.dumps(kept))
    reused = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN)
    assert len(runs) == 1 and reused.clients == first.clients
    bench.run_one(split, 0, "local", size, tmp_path, bench.OWN, {"onnx_exporter": "legacy"})
    assert len(runs) == 2
    bench.run_one(split, 0, "local", size, tmp_path, bench.OWN, {"local.lr": 0.02})
    assert len(runs) == 3
    other = bench.Split(split.name, split.title, split.flags | {"data.max_samples": 180}, ("mlr",))
    changed = bench.run_one(other, 0, "local", size, tmp_path, bench.OWN)

    # Assert
    assert len(runs) == 4
    assert sum(c["n_test"] for c in changed.clients) < sum(c["n_test"] for c in first.clients)


def test_a_kept_run_of_other_code_runs_again_unless_reuse_is_asked(tmp_path, monkeypatch):
    # Prepare: a tiny run kept, and a count of the simulations really run
    split = bench.Split("tiny", "digits", {"data.dataset": "digits", "clients": 2}, ("mlr",))
    size = bench.Size(1, 1, 16, 0.01, clients=2, samples=200, group_samples=200, unlabeled=50)
    runs = []
    real = bench.simulate
    monkeypatch.setattr(bench, "simulate", lambda cfg, **kw: runs.append(cfg) or real(cfg, **kw))
    first = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN)
    path = tmp_path / "runs" / "tiny" / "0" / "local-own.json"
    kept = json.loads(path.read_text())

    # Execute and assert: the digest is of the packages' sources; a run of this code is reused,
    # one of other code (or kept before digests) runs again, unless reuse is asked
    assert kept["code"] == bench.code_digest() and len(runs) == 1
    for other in ("0123456789abcdef", None):
        path.write_text(json.dumps(kept | {"code": other}))
        reused = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN, reuse_other_code=True)
        assert len(runs) == 1 and reused.code == other
        again = bench.run_one(split, 0, "local", size, tmp_path, bench.OWN)
        assert len(runs) == 2 and again.code == bench.code_digest()
        assert again.clients == first.clients  # the same config and code: the same results
        runs.clear()
        runs.append(None)
    rows = bench.summarize(split, [0], size, tmp_path, [], reuse_other_code=True)
    assert [r["other_code"] for r in rows] == [0, 0, 0]
    path.write_text(json.dumps(kept | {"code": "0123456789abcdef"}))
    rows = bench.summarize(split, [0], size, tmp_path, [], reuse_other_code=True)
    assert [r["other_code"] for r in rows] == [1, 0, 0]
    assert "(1 of 1 runs by other code)" in bench.table(rows).splitlines()[2]


def test_the_noise_floor_is_local_training_on_the_same_split_with_another_seed(tmp_path):
    # Prepare: a tiny label-skewed split and budget
    split = bench.Split(
        "tiny",
        "digits, 3 clients",
        {"data.dataset": "digits", "data.max_samples": 300, "clients": 3},
        ("mlr",),
    )
    size = bench.Size(1, 1, 16, 0.05, clients=3, samples=300, group_samples=300, unlabeled=50)

    # Execute
    rows = bench.summarize(split, [4], size, tmp_path, [])
    local = bench.run_one(split, 4, "local", size, tmp_path, bench.OWN)
    again = bench.run_one(split, 4, "local", size, tmp_path, bench.OWN, bench.reseed(4), "reseeded")

    # Assert: a row of its own; the same clients and samples, training from seed 1004
    assert [r["algorithm"] for r in rows] == ["local", "local_reseeded", "fedavg_ft"]
    assert again.config["seed"] == 1004 and again.config["data"]["seed"] == 4
    assert [c["n_train"] for c in again.clients] == [c["n_train"] for c in local.clients]
    assert [c["n_test"] for c in again.clients] == [c["n_test"] for c in local.clients]
    assert [c["personal_acc"] for c in again.clients] != [c["personal_acc"] for c in local.clients]
    assert rows[1]["per_client"] == [100 * c["personal_acc"] for c in again.clients]
    # every row of the split is judged against that floor: its worst client against local
    gaps = [
        100 * (b["personal_acc"] - a["personal_acc"])
        for a, b in zip(local.clients, again.clients, strict=True)
    ]
    assert all(r["noise_floor"] == pytest.approx(min(gaps)) for r in rows)


def test_federico_gets_the_rounds_that_give_its_largest_client_local_trainings_passes():
    size = bench.SIZES["quick"]
    n_train, batch = [6, 291, 37, 12], 16
    rounds = bench.federico_rounds(size, n_train, batch)
    local_samples = size.rounds * size.local_epochs * 291  # local training's, largest client
    assert rounds * batch >= local_samples > (rounds - 1) * batch  # enough, and no more
    for n in n_train:  # so every client makes at least local training's passes
        assert rounds * batch / n >= size.rounds * size.local_epochs


@pytest.mark.parametrize(
    ("worst", "floor", "verdict"),
    [
        (-1.9, -0.2, "yes"),  # within 2 points, whatever the floor
        (-2.0, -9.0, "yes"),
        (-3.5, -4.9, "floor"),  # deeper than 2, not deeper than local training against itself
        (-4.9, -4.9, "floor"),
        (-2.5, -0.2, "no"),  # deeper than both: a stable split, a real miss
        (-8.6, -4.9, "no"),
    ],
)
def test_the_guards_goal_holds_within_two_points_or_within_the_splits_noise_floor(
    worst, floor, verdict
):
    assert bench.goal(worst, floor) == verdict


def test_the_code_digest_follows_the_packages_sources_and_nothing_else(tmp_path, monkeypatch):
    # Prepare: a tree of the three packages, one source file each
    for package in ("coordinator", "edge_sdk", "model_zoo"):
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "sub" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(bench, "ROOT", tmp_path)

    def digest() -> str:
        bench.code_digest.cache_clear()
        return bench.code_digest()

    # Execute and assert
    try:
        first = digest()
        assert digest() == first
        (tmp_path / "README.md").write_text("prose")
        (tmp_path / "edge_sdk" / "notes.txt").write_text("not a source")
        assert digest() == first
        (tmp_path / "model_zoo" / "sub" / "a.py").write_text("x = 2\n")
        changed = digest()
        assert changed != first
        (tmp_path / "model_zoo" / "sub" / "a.py").rename(tmp_path / "model_zoo" / "b.py")
        assert digest() not in (first, changed)  # the same text under another name
    finally:
        bench.code_digest.cache_clear()
