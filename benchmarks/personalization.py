"""Does personalization pay? Algorithms × splits × seeds, each client against training alone.

For every split and seed this runs, on one data split and one local-training budget:
- `local` (each client alone) and `fedavg_ft` (FedAvg, then fine-tuning) once per architecture
  of the split, all clients on that architecture; the best of those is "FedAvg+FT";
- `local_reseeded`: local training again on the same split, its initialisation and batches from
  another seed, the noise floor: how far from `local` a method equal to it ends by chance (its
  worst client is what the guard's goal can expect of a method no better than training alone);
- each personalized algorithm (fml, pfml, persfl, fedme, federico), clients on the split's mixed
  architectures, the guard on (edge_sdk.algorithms.guard).

It reports, per algorithm and split: the mean personalized accuracy over seeds ± a 95% t-interval
over the seeds' means; per client (its index, averaged over the seeds), win / tie / loss against
local training and against FedAvg+FT (a tie: within ±1 point); the worst client's gap to local
training, and whether the guard's goal holds there ("goal": "yes", no client more than 2 points
below; "floor", deeper but no deeper than local_reseeded's worst client, the split's noise floor;
"no"); and the training samples each client processed, as passes over its training data (PersFL's
stage 2, FedMe's exchanged model, FedeRiCo's gradients for its neighbours and FedAvg+FT's
fine-tuning are extra passes).

    python benchmarks/personalization.py --quick                  # about 30 min on 2 cores
    python benchmarks/personalization.py                          # the full size
    python benchmarks/personalization.py --size long              # 20 clients, 20 rounds
    python benchmarks/personalization.py --quick --splits lg-fmnist --algorithms fml,persfl
    python benchmarks/personalization.py --quick --algorithms fedavg_ft --set robust.weight_cap=0

Every run's per-client results are kept under `--out` (default runs/personalization/<size>),
one JSON file per run with its config and a digest of the code that ran it, and a finished run
is not run again while both are the same: an interrupted benchmark resumes, and a changed split,
setting or source file of coordinator/, edge_sdk/ or model_zoo/ runs again. After a change known
to leave results alone (a refactor, a docstring), `--reuse-other-code` keeps runs of other code;
the summary counts them.
It prints the summary as JSON, then as a table (also written to OUT/summary.json and
OUT/summary.md).

Budgets: every algorithm and baseline trains `local_epochs` epochs of `batch_size` per round for
`rounds` rounds (PFML: the same epochs, `pfml.local_epochs`). FedeRiCo takes one gradient step
of one batch per round by design, for every client alike, so it gets as many rounds as local
training takes steps on the largest client: ⌈rounds · local_epochs · max n_train / batch_size⌉
(no client makes fewer passes over its data than alone; the smaller ones make more, counted).
FedMe clusters its models on unlabeled inputs drawn from samples no client holds, so every
algorithm runs on the same split; the guard's students learn on the same inputs where
`guard_distill_unlabeled` is set.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.config import load_config, parse_overrides  # noqa: E402
from coordinator.distributed import PACKAGES, source_digest  # noqa: E402
from coordinator.simulator import settings_differences, simulate  # noqa: E402
from edge_sdk.algorithms import algorithm_names  # noqa: E402
from model_zoo.data import load_dataset  # noqa: E402
from model_zoo.data.base import stratified_indices  # noqa: E402

ALGORITHMS = ("fml", "pfml", "persfl", "fedme", "federico")
TIE = 1.0  # points: a client within ±TIE of the other method ties
GUARD_POINTS = 2.0  # the guard's goal: no client more than this below local training
PAYS_POINTS = 5.0  # where data is scarce: at least local + this...
# ...and at least FedAvg+FT less this (FedAvg+FT trains the global architecture on every device,
# which a small device may not be able to run: issue 44's target)
FT_SLACK = 1.0
OWN = "own"  # local training: every client its own architecture
# The noise floor: local training again on each seed's own split, its initialisation and batches
# drawn from another seed (seed + RESEED).
RESEED = 1000
RESEEDED = "local_reseeded"  # its row


@dataclass(frozen=True)
class Split:
    """A federated data split: what `edgefl simulate` takes, less the training budget."""

    name: str
    title: str
    flags: dict[str, Any]  # RunConfig fields, dotted
    models: tuple[str, ...]  # the personalized algorithms' clients, round-robin
    # A label-skew split with few images per client, where personalization should pay: each
    # personalized algorithm's mean at least FedAvg+FT's and local training's + 5 points. Every
    # split here has a few dozen training images per client.
    scarce: bool = False


@dataclass(frozen=True)
class Size:
    rounds: int
    local_epochs: int
    batch_size: int
    lr: float
    clients: int  # image splits
    samples: int  # image splits: the seeded subset of the pooled data set
    group_samples: int  # label groups: the subset (50-100 training images per client)
    unlabeled: int  # FedMe's unlabeled set
    groups: int = 2  # label groups: how many (their clients draw from one each, round-robin)
    # The splits run by default (None: every split `splits` makes).
    default_splits: tuple[str, ...] | None = None
    # The Dirichlet splits' architectures, round-robin (the other image splits: IMAGE_MODELS).
    dirichlet_models: tuple[str, ...] = ("lenet5", "mlp", "cnn1")


SIZES = {
    "quick": Size(5, 2, 16, 0.01, 6, 1500, 1500, 200),
    "full": Size(10, 2, 16, 0.01, 12, 3600, 1500, 500, groups=4),
    # Longer runs and more clients, each with a few dozen training images, on the label-skew
    # and Dirichlet splits of two data sets (issue 44: a default must win here as well as at
    # the quick size). Digits' 1,797 images leave 20 clients about 24 training images each.
    "long": Size(
        20,
        2,
        16,
        0.01,
        20,
        3400,
        3400 * 6 // 20,
        200,
        groups=2,
        default_splits=("lg-fmnist", "lg-digits", "dir0.1-fmnist", "dir0.1-digits"),
        dirichlet_models=("lenet5", "mlp", "cnn1", "mlr"),
    ),
}
# Every client's data: 30% train, 20% validation (what the guard and PersFL, FedMe decide on),
# 50% test, so that one client's accuracy rests on a hundred images or more.
DATA_SPLIT = [0.3, 0.2, 0.5]

IMAGE_MODELS = ("lenet5", "mlp", "cnn1")
DS3_MIN_PER_CLASS = 25
DIGITS = 1797  # scikit-learn's digits: every image there is


def splits(size: Size) -> dict[str, Split]:
    """The benchmark's splits at `size`."""
    n, k = size.samples, size.clients
    img = {"clients": k, "data.max_samples": n, "data.split": DATA_SPLIT}
    out = [
        Split(
            f"dir{a}-{ds}",
            f"{'digits' if ds == 'digits' else 'Fashion-MNIST'}, Dirichlet {a}",
            {
                "data.dataset": "digits" if ds == "digits" else "fashion_mnist",
                "data.partition": "dirichlet",
                "data.partition_params": {"alpha": a, "min_size": 20},
                **img,
                # digits has 1,797 images: leave FedMe's unlabeled set some no client holds
                **({"data.max_samples": min(n, DIGITS - size.unlabeled)} if ds == "digits" else {}),
            },
            size.dirichlet_models,
            scarce=a == 0.1,  # most clients hold two or three classes
        )
        for ds in ("digits", "fmnist")
        for a in (0.1, 0.5)
    ]
    g = size.groups
    for ds in ("fmnist", "digits"):
        subset = size.group_samples * k // 6
        if ds == "digits":
            subset = min(subset, DIGITS - size.unlabeled)
        out.append(
            Split(
                f"lg-{ds}",
                f"{'digits' if ds == 'digits' else 'Fashion-MNIST'}, {g} label groups, "
                f"{k // g} clients each, {subset * DATA_SPLIT[0] / k:.0f} training images per "
                "client on average",
                {
                    "data.dataset": "digits" if ds == "digits" else "fashion_mnist",
                    "data.partition": "label_groups",
                    # groups of 3 clients or more and 3 architectures round-robin: every group
                    # has every architecture, so architecture and group are not the same thing
                    "data.partition_params": {"num_groups": g},
                    "data.max_samples": subset,
                    "data.split": DATA_SPLIT,
                    "clients": k,
                },
                IMAGE_MODELS,
                scarce=True,
            )
        )
    out.append(
        Split(
            "synthetic",
            "Synthetic(0.5, 0.5), the first clients' users",
            {
                "data.dataset": "synthetic",
                "data.options": {"alpha": 0.5, "beta": 0.5},
                "data.partition": "natural",
                "data.max_samples": 20000,
                "data.split": DATA_SPLIT,
                "clients": 10,
            },
            ("mlr", "mlp"),
        )
    )
    out += [
        Split(
            f"ds{i}-fmnist",
            f"Fashion-MNIST, PersFL's DS-{i}",
            {"data.dataset": "fashion_mnist", "data.partition": f"ds{i}", **img}
            # DS-3's log-normal sizes on a subset this small left clients 2 samples of each
            # class by default: 1 training image and 2 test images, where one image moves a
            # client's accuracy by 50 points. 25 of each: at least 15 training and 25 test.
            | ({"data.partition_params": {"min_per_class": DS3_MIN_PER_CLASS}} if i == 3 else {}),
            IMAGE_MODELS,
            scarce=i != 2,  # DS-1: 4 classes per client, DS-3: 2; DS-2 has all ten
        )
        for i in (1, 2, 3)
    ]
    return {s.name: s for s in out}


# -- running -------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run's per-client results (what the benchmark keeps of results.json)."""

    algorithm: str
    split: str
    seed: int
    family: str | None  # the one architecture of a baseline run; the global one otherwise
    wall_seconds: float
    clients: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None  # the run's whole config, as results.json holds it
    code: str | None = None  # code_digest() of what ran it (None: kept before digests)


_KEEP = (
    "id",
    "arch",
    "n_train",
    "personal_acc",
    "samples_processed",
    "guard_choice",  # (runs made before results said `deployed`)
    "guard_arch",
    "guard_unguarded_acc",
    "guard_mix_weight",
    "guard_distill_unlabeled",
    "guard_distill_unlabeled_kept",
    "guard_peers",
    "distill_lambda",
    "distill_T",
    "student_init",
    "arch_end",
    "deployed",
    "deployed_arch",
    "deployed_params",
    "own_params",
    "deployed_outside_budget",
)


def _budget(size: Size, algorithm: str) -> dict[str, Any]:
    """The common budget, as each algorithm takes it. PFML (plain gradient steps, no momentum)
    keeps its own learning rate; FedeRiCo (Adam, one step per round) its own batch and rate."""
    if algorithm == "federico":
        return {}
    budget: dict[str, Any] = {"batch_size": size.batch_size, "local_epochs": size.local_epochs}
    if algorithm != "pfml":
        budget["lr"] = size.lr
    return {f"{algorithm}.{k}": v for k, v in budget.items()}


def federico_rounds(size: Size, n_train: Sequence[int], batch_size: int) -> int:
    """FedeRiCo's rounds: one step of `batch_size` each, for every client alike, as many as
    local training's steps on the largest client, so that no client makes fewer passes over its
    training data than alone (the smaller ones make more; `passes` counts them)."""
    return math.ceil(size.rounds * size.local_epochs * max(n_train) / batch_size)


def _unlabeled(split: Split, seed: int, count: int, out: Path) -> Path:
    """The coordinator's unlabeled inputs (FedMe's set; the guard's students' with
    `guard_distill_unlabeled`): `count` samples that no client of this split holds."""
    path = out / "unlabeled" / f"{split.name}-{seed}.npy"
    if path.is_file():
        return path
    f = split.flags
    ds = load_dataset(f["data.dataset"], **f.get("data.options", {}))
    y = ds.y.numpy()
    held = np.zeros(len(y), dtype=bool)
    held[stratified_indices(y, f.get("data.max_samples"), seed)] = True
    if f.get("data.partition") == "natural":  # only the first `clients` users are clients
        users = np.unique(ds.groups)[: f["clients"]]
        held &= np.isin(ds.groups, users)
    free = np.flatnonzero(~held)
    if len(free) < count:
        raise ValueError(f"{split.name}: only {len(free)} samples are free for FedMe's set")
    pick = np.sort(np.random.default_rng(seed + 1).choice(free, size=count, replace=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, ds.x[pick].numpy())
    return path


def _differs(kept: dict[str, Any], config: dict[str, Any], algorithm: str) -> bool:
    """Whether a kept run's config is not `config`: a setting the kept one lacks differs only
    where `config` holds it at other than its default (coordinator.simulator's rule). The
    sections of the algorithms it does not run (a new guard setting of theirs, say) change
    nothing in it: it is not run again for them."""
    others = set(algorithm_names()) - {algorithm}
    differ, _ = settings_differences(kept, config, _defaults(), skip=others)
    return bool(differ)


@functools.cache
def code_digest() -> str:
    """A digest of what trains and scores a run: the sources of the three packages and torch's
    version. A kept run of other code is not reused unless asked (`--reuse-other-code`)."""
    import torch

    sources = source_digest([ROOT / package for package in PACKAGES])
    return hashlib.sha256(f"{torch.__version__}\0{sources}".encode()).hexdigest()[:16]


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every setting at its default, as a run's config is kept (validated once, not per run)."""
    return dict(json.loads(load_config(environ=False).model_dump_json()))


def run_one(
    split: Split,
    seed: int,
    algorithm: str,
    size: Size,
    out: Path,
    family: str,
    overrides: dict[str, Any] | None = None,
    variant: str = "",
    reuse_other_code: bool = False,
) -> Run:
    """One algorithm on one split and seed (cached under `out`: a kept run of the same config,
    and of the same code unless `reuse_other_code`, is not run again). fedavg_ft trains `family`
    on every client; the others give each client the split's architecture for it
    (round-robin), and the personalized algorithms have `family` as their global one (FML's
    meme, PFML's local model, PersFL's teacher)."""
    tag = f"{algorithm}-{family}" + (f"-{variant}" if variant else "")
    path = out / "runs" / split.name / str(seed) / f"{tag}.json"
    models = [family] if algorithm == "fedavg_ft" else list(split.models)
    flags: dict[str, Any] = {
        **split.flags,
        "algorithm": algorithm,
        "seed": seed,
        "rounds": size.rounds,
        "models": models,
        "global_model": split.models[0] if family == OWN else family,
        "device": "cpu",
        "round.eval_every": 10_000,  # only the last round: nothing here reads the others
        "round.deadline_s": 3600,
        **_budget(size, algorithm),
    }
    # The algorithm's settings as the overrides give them (read below).
    own = load_config(None, {"algorithm": algorithm}, overrides, environ=False)
    # FedMe's unlabeled set, and the other guards' students' inputs where they learn on some:
    # samples no client holds, so that the clients' data is the same as without them.
    if algorithm == "fedme" or getattr(own.algorithm_config(), "guard_distill_unlabeled", 0):
        flags[f"{algorithm}.unlabeled_path"] = str(_unlabeled(split, seed, size.unlabeled, out))
    if algorithm == "federico":
        local = run_one(split, seed, "local", size, out, OWN, reuse_other_code=reuse_other_code)
        flags["rounds"] = federico_rounds(
            size, [c["n_train"] for c in local.clients], own.federico.batch_size
        )
    cfg = load_config(None, flags, overrides, environ=False)
    config = json.loads(cfg.model_dump_json())
    if path.is_file():  # kept from an earlier run: reused only if it ran this very config
        kept = Run(**json.loads(path.read_text()))
        # (a setting added since, at its default here, is no difference: as a checkpoint's)
        same = kept.config is not None and not _differs(kept.config, config, algorithm)
        if same and (reuse_other_code or kept.code == code_digest()):
            return kept
        why = "its config differs" if not same else "other code made it"
        logging.info("%s %s seed %d: kept, but %s; running it again", tag, split.name, seed, why)
    t0 = time.perf_counter()
    res = json.loads(simulate(cfg, progress=False).to_json())  # results.json's document
    n_test = {c["id"]: c["n_test"] for c in res["split"]["clients"]}
    run = Run(
        algorithm,
        split.name,
        seed,
        family,
        round(time.perf_counter() - t0, 1),
        [{**{k: c.get(k) for k in _KEEP}, "n_test": n_test[c["id"]]} for c in res["clients"]],
        config,
        code_digest(),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.__dict__, indent=1) + "\n")
    logging.info("%s %s seed %d: %.1f s", tag, split.name, seed, run.wall_seconds)
    return run


# -- summarising ---------------------------------------------------------------------------------
def _mean_acc(run: Run) -> float:
    return 100 * statistics.mean(c["personal_acc"] for c in run.clients)


def _ci95(values: Sequence[float]) -> float:
    """Half-width of the 95% t-interval of the mean of `values`."""
    if len(values) < 2:
        return math.nan
    from scipy.stats import t

    return float(t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def _per_client(runs: Sequence[Run]) -> list[float]:
    """Each client index's accuracy (points), averaged over the seeds' runs."""
    width = len(runs[0].clients)
    return [100 * statistics.mean(r.clients[i]["personal_acc"] for r in runs) for i in range(width)]


def _wtl(ours: Sequence[float], theirs: Sequence[float]) -> str:
    d = [a - b for a, b in zip(ours, theirs, strict=True)]
    return f"{sum(x > TIE for x in d)}/{sum(abs(x) <= TIE for x in d)}/{sum(x < -TIE for x in d)}"


# What a client's guard deployed (edge_sdk.algorithms.guard), by the start of its choice's label.
DEPLOYED = {
    "mixture": "personal+finetuned (final",  # the default's mixture of the two, 0 < w < 1
    "own": "personal (final",  # the algorithm's own final personalized model
    "finetuned": "finetuned (final",  # the federation's final model, fine-tuned
    "distilled": "distilled (final",  # a student of its own architecture (edge_sdk.guard)
    "other": "",  # an earlier round's model, the meme, the global model...
}


def _choice(client: dict[str, Any]) -> str | None:
    """The guard's label of what a client deployed (`guard_choice` in runs made before)."""
    return client.get("deployed") or client.get("guard_choice")


def _deployed(choice: str | None) -> str:
    return next(k for k, start in DEPLOYED.items() if (choice or DEPLOYED["own"]).startswith(start))


def _arch_kind(client: dict[str, Any]) -> str:
    """What a client deployed against its own architecture: "own" (one model of it), "other"
    (one model of another architecture) or "mixture" (several models). Runs made before results
    said `deployed_arch` give the guard's label (FedMe's unguarded runs: the architecture it
    ended with)."""
    deployed = client.get("deployed_arch") or client.get("guard_arch") or client.get("arch_end")
    if deployed is None or deployed == client["arch"]:
        return "own"
    return "mixture" if deployed.startswith("mixture") else "other"


def _size_ratio(runs: Sequence[Run]) -> float | None:
    """The deployed models' parameters over the clients' own architectures', mean over clients
    (None for runs made before results said them)."""
    ratios = [
        c["deployed_params"] / c["own_params"]
        for r in runs
        for c in r.clients
        if c.get("deployed_params") and c.get("own_params")
    ]
    return statistics.mean(ratios) if ratios else None


def _mix_weight(runs: Sequence[Run]) -> float | None:
    """The mean weight w of the personalized model in the mixtures the guard deployed
    (w = 1: the algorithm's own model, 0: the fine-tuned one); None where none was."""
    weights = [
        c["guard_mix_weight"]
        for r in runs
        for c in r.clients
        if c.get("guard_mix_weight") is not None and _deployed(_choice(c)) == "mixture"
    ]
    return statistics.mean(weights) if weights else None


def _passes(runs: Sequence[Run]) -> float:
    """Training samples processed per client, in passes over its training data (mean)."""
    return statistics.mean(
        (c["samples_processed"] or 0) / c["n_train"] for r in runs for c in r.clients
    )


def goal(worst: float, floor: float) -> str:
    """The guard's goal for a row whose worst client ends `worst` points from local training,
    on a split whose noise floor (local_reseeded's worst client) is `floor`: "yes" within
    GUARD_POINTS; "floor" deeper, but no deeper than local training ends against itself on
    that split (what chance does to a method equal to it); "no" deeper than both."""
    if worst >= -GUARD_POINTS:
        return "yes"
    return "floor" if worst >= floor else "no"


def reseed(seed: int) -> dict[str, Any]:
    """The overrides of `seed`'s noise-floor run: its split, training's randomness from another
    seed."""
    return {"seed": seed + RESEED, "data.seed": seed}


def summarize(
    split: Split,
    seeds: Sequence[int],
    size: Size,
    out: Path,
    algorithms: Sequence[str],
    overrides: dict[str, Any] | None = None,
    variant: str = "",
    reuse_other_code: bool = False,
) -> list[dict[str, Any]]:
    def run(algorithm: str, seed: int, family: str, *more: Any) -> Run:
        return run_one(
            split, seed, algorithm, size, out, family, *more, reuse_other_code=reuse_other_code
        )

    local = [run("local", s, OWN) for s in seeds]
    reseeded = [run("local", s, OWN, reseed(s), "reseeded") for s in seeds]
    fts = {f: [run("fedavg_ft", s, f) for s in seeds] for f in split.models}
    best = max(fts, key=lambda f: statistics.mean(_mean_acc(r) for r in fts[f]))
    baselines = {"local": local, RESEEDED: reseeded, "fedavg_ft": fts[best]}
    local_pc, ft_pc = _per_client(local), _per_client(fts[best])
    floor = min(a - b for a, b in zip(_per_client(reseeded), local_pc, strict=True))
    rows = []
    # `fedavg_ft` among `algorithms`: FedAvg+FT again, on the best architecture, with the
    # overrides (what a setting does to the baseline), beside the baseline itself
    for i, name in enumerate(["local", RESEEDED, "fedavg_ft", *algorithms]):
        runs = baselines[name] if i < 3 else [
            run(name, s, best, overrides, variant) for s in seeds
        ]  # fmt: skip
        means = [_mean_acc(r) for r in runs]
        pc = _per_client(runs)
        gaps = [a - b for a, b in zip(pc, local_pc, strict=True)]
        worst = min(range(len(gaps)), key=gaps.__getitem__)
        row: dict[str, Any] = {
            "split": split.name,
            "algorithm": f"{name} ({variant or 'again'})"
            if i >= 3 and name == "fedavg_ft"
            else name,
            # FedAvg+FT's one architecture; the personalized algorithms' global one
            "architecture": ",".join(split.models) if name in ("local", RESEEDED) else best,
            "mean": statistics.mean(means),
            "ci95": _ci95(means),
            "seeds": list(seeds),
            "per_seed": means,
            "per_client": pc,
            "vs_local": _wtl(pc, local_pc),
            "vs_fedavg_ft": _wtl(pc, ft_pc),
            "worst_vs_local": min(gaps),
            # which client that is, and the test images its accuracy rests on (mean over seeds):
            # on a few dozen, one image is several points
            "worst_client": worst,
            "worst_client_test": statistics.mean(r.clients[worst].get("n_test") or 0 for r in runs),
            "noise_floor": floor,
            "goal": goal(min(gaps), floor),
            "passes": _passes(runs),
            "wall_seconds": sum(r.wall_seconds for r in runs),
            # runs kept from other code (`--reuse-other-code`): not what this code gives
            "other_code": sum(r.code != code_digest() for r in runs),
        }
        if name in ALGORITHMS:
            deployed = Counter(_deployed(_choice(c)) for r in runs for c in r.clients)
            row["deployed"] = {k: deployed[k] for k in DEPLOYED if deployed[k]}
            row["mix_weight"] = _mix_weight(runs)
            kinds = Counter(_arch_kind(c) for r in runs for c in r.clients)
            row["deployed_arch"] = {k: kinds[k] for k in ("own", "other", "mixture") if kinds[k]}
            row["size_vs_own"] = _size_ratio(runs)
            unguarded = [
                100
                * statistics.mean(
                    c["guard_unguarded_acc"]
                    if c.get("guard_unguarded_acc") is not None
                    else c["personal_acc"]
                    for c in r.clients
                )
                for r in runs
            ]
            row["mean_unguarded"] = statistics.mean(unguarded)
        if split.scarce and name in ALGORITHMS:
            ft_mean = statistics.mean(_mean_acc(r) for r in fts[best])
            local_mean = statistics.mean(_mean_acc(r) for r in local)
            row["pays"] = (
                row["mean"] >= ft_mean - FT_SLACK and row["mean"] >= local_mean + PAYS_POINTS
            )
        rows.append(row)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| split | method | mean ± 95% CI | vs local W/T/L | vs FedAvg+FT W/T/L | worst client "
        "vs local | passes | guard | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["algorithm"] + (f" ({r['architecture']})" if r["algorithm"] == "fedavg_ft" else "")
        if r.get("other_code"):
            name += f" ({r['other_code']} of {len(r['seeds'])} runs by other code)"
        guard = ""
        if "deployed" in r:
            guard = ", ".join(f"{k} {v}" for k, v in r["deployed"].items())
            if r.get("mix_weight") is not None:
                guard += f" (mean w {r['mix_weight']:.2f})"
            guard += f"; unguarded {r['mean_unguarded']:.1f}"
            guard += "; arch " + ", ".join(f"{k} {v}" for k, v in r["deployed_arch"].items())
            if r.get("size_vs_own") is not None:
                guard += f" ({r['size_vs_own']:.2f}x own size)"
        if "pays" in r:
            guard += f"; pays: {'yes' if r['pays'] else 'no'}"
        if "deployed" in r:
            guard += f"; goal: {r['goal']}"
        lines.append(
            f"| {r['split']} | {name} | {r['mean']:.1f} ± {r['ci95']:.1f} | {r['vs_local']} | "
            f"{r['vs_fedavg_ft']} | {r['worst_vs_local']:+.1f} (c{r['worst_client']}, "
            f"{r['worst_client_test']:.0f} test) | {r['passes']:.1f} | {guard} | "
            f"{r['wall_seconds']:.0f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), help="quick, full (the default) or long")
    ap.add_argument("--quick", action="store_true", help="the quick size: --size quick")
    ap.add_argument("--splits", help="comma-separated split names (default: all)")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument(
        "--out", type=Path, help="where runs are kept (default runs/personalization/SIZE)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="override a field of the personalized algorithms' runs, e.g. fml.alpha=0.3 (the "
        "runs are kept apart, under a name made of the overrides)",
    )
    ap.add_argument(
        "--reuse-other-code",
        action="store_true",
        help="reuse kept runs of the same config made by other code (after a change known to "
        "leave results alone); the table counts them",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("coordinator", "edge_sdk", "model_zoo"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.quick and args.size not in (None, "quick"):
        ap.error(f"--quick and --size {args.size} name two sizes")
    size_name = "quick" if args.quick else args.size or "full"
    size = SIZES[size_name]
    out = args.out or ROOT / "runs" / "personalization" / size_name
    chosen = splits(size)
    names = args.splits.split(",") if args.splits else list(size.default_splits or chosen)
    unknown = [n for n in names if n not in chosen]
    if unknown:
        ap.error(f"unknown split(s) {unknown}; known: {', '.join(chosen)}")
    algorithms = [a for a in args.algorithms.split(",") if a]
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.perf_counter()
    overrides = parse_overrides(args.set)
    variant = ",".join(args.set).replace("/", "_")
    rows = [
        r
        for n in names
        for r in summarize(
            chosen[n], seeds, size, out, algorithms, overrides, variant, args.reuse_other_code
        )
    ]
    doc = {
        "size": size_name,
        "budget": size.__dict__,
        "seeds": seeds,
        "overrides": overrides,
        "code": code_digest(),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = table(rows)
    (out / "summary.md").write_text(text + "\n")
    print(json.dumps(doc, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
