"""The simulator: one Coordinator and N EdgeClients over the in-memory transport.

Nothing here calls client code directly: the simulator loads and partitions the data, gives each
EdgeClient its own split (as a device app brings its own data), starts the clients and the
coordinator on one in-memory broker, and reads the results back from the coordinator. Baselines
run the same way on the same split, and their per-client accuracies feed the QoI metrics.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator.config import RunConfig
from coordinator.metrics import personalization_metrics
from coordinator.server import Coordinator, RoundRecord, RunResult
from coordinator.server_data import ServerData
from coordinator.strategies import GlobalModelStrategy, strategy_class
from edge_sdk import topics
from edge_sdk.client import EdgeClient
from edge_sdk.cohort import Cohort
from edge_sdk.device import resolve_device
from edge_sdk.malloc import M_ARENA_MAX, glibc
from edge_sdk.trainer import ClientData
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import MqttTransport
from edge_sdk.wire import reference_shapes
from model_zoo import ArchSpec
from model_zoo.data import (
    ClientSplit,
    Dataset,
    Partition,
    format_split_table,
    load_dataset,
    partition,
    plot_label_distribution,
    split_summary,
)
from model_zoo.data.base import stratified_indices

__all__ = [
    "Federation",
    "client_seed",
    "client_spec",
    "prepare_federation",
    "run_federation",
    "simulate",
    "split_record",
    "training_budget",
    "transport_factory",
]

log = logging.getLogger(__name__)

# Algorithms whose clients all train the global architecture (baselines in a mixed federation).
_ONE_ARCH = {"fedavg", "fedprox", "fedavg_ft"}


@dataclass
class Federation:
    """The data side of a simulated federation: the dataset, its split, each client's tensors.

    `server_data` holds what the coordinator keeps for itself (samples held out of `dataset`
    before it was partitioned, for strategies that need an unlabeled set).
    """

    dataset: Dataset
    partition: Partition
    client_ids: list[str]
    client_data: list[ClientData]
    server_data: ServerData = field(default_factory=ServerData)


def prepare_federation(cfg: RunConfig) -> Federation:
    d = cfg.data
    # The run's seed picks the subset; a generator's own seed (Synthetic's) stays in `options`.
    subset = {"max_samples": d.max_samples, "seed": cfg.seed} if d.max_samples else {}
    dataset = load_dataset(d.dataset, root=d.root, **subset, **d.options)
    dataset, server_data = _hold_out(cfg, dataset)
    part = partition(
        dataset.y.numpy(),
        d.partition,
        cfg.clients,
        seed=cfg.seed,
        split=d.split,
        groups=dataset.groups,
        **d.partition_params,
    )
    width = len(str(len(part) - 1))
    ids = [f"c{i:0{width}d}" for i in range(len(part))]
    dataset, part = _client_major(dataset, part)
    datas = []
    x, y = dataset.x, dataset.y
    for cs in part.clients:
        # Ranges of the client-major data set, so slices: views, not copies.
        tr, va, te = (
            slice(int(ix[0]), int(ix[-1]) + 1) if len(ix) else slice(0, 0)
            for ix in (cs.train, cs.val, cs.test)
        )
        data = ClientData(
            x_train=x[tr],
            y_train=y[tr],
            x_val=x[va],
            y_val=y[va],
            x_test=x[te],
            y_test=y[te],
            num_classes=dataset.num_classes,
        )
        # In the training layout already, so CPU clients (and every baseline run) share these
        # tensors instead of each making its own copy.
        datas.append(data.to(torch.device("cpu")))
    return Federation(dataset, part, ids, datas, server_data)


def _client_major(dataset: Dataset, part: Partition) -> tuple[Dataset, Partition]:
    """The data set reordered so that each client's train, val and test samples are contiguous
    (then the samples no client holds), and the partition as ranges into it.

    The inputs move in place, each cycle of the permutation rotated through one row of
    scratch: gathering a copy per client held the data set twice (+210 MB for Fashion-MNIST).
    A partition that gives a sample to two clients is gathered (copied) instead. `dataset`
    is consumed: its inputs are the returned data set's, reordered.
    """
    parts = [
        np.asarray(ix, dtype=np.int64) for cs in part.clients for ix in (cs.train, cs.val, cs.test)
    ]
    order = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    held = np.zeros(len(dataset), dtype=bool)
    held[order] = True
    if int(held.sum()) != len(order):  # a sample in two clients: copies cannot be avoided
        moved = dataset.subset(order)
    else:
        order = np.concatenate([order, np.flatnonzero(~held)])
        x = dataset.x.contiguous().cpu()
        _permute_rows_(x.numpy(), order)
        moved = Dataset(
            name=dataset.name,
            x=x,
            y=dataset.y[torch.from_numpy(order)],
            classes=list(dataset.classes),
            input_shape=tuple(dataset.input_shape),
            normalization=dataset.normalization,
            groups=None if dataset.groups is None else dataset.groups[order],
        )
    bounds = np.cumsum([0, *map(len, parts)])
    spans = [np.arange(lo, hi, dtype=np.int64) for lo, hi in itertools.pairwise(bounds)]
    clients = [ClientSplit(*spans[3 * i : 3 * i + 3]) for i in range(len(part.clients))]
    return moved, Partition(part.scheme, clients, dict(part.params))


def _permute_rows_(a: np.ndarray, order: np.ndarray) -> None:
    """a[k] = a_before[order[k]] for every k, in place, with one row of scratch."""
    done = order == np.arange(len(order))
    for start in np.flatnonzero(~done).tolist():
        if done[start]:
            continue
        scratch = a[start].copy()
        j = start
        while order[j] != start:
            done[j] = True
            a[j] = a[order[j]]
            j = int(order[j])
        done[j] = True
        a[j] = scratch


def _hold_out(cfg: RunConfig, dataset: Dataset) -> tuple[Dataset, ServerData]:
    """Remove the strategy's unlabeled set (stratified, seeded) from the data clients get."""
    n = strategy_class(cfg.algorithm).unlabeled_holdout(cfg.algorithm_config())
    if n <= 0:
        return dataset, ServerData()
    if n >= len(dataset):
        raise ValueError(
            f"{cfg.algorithm} holds out {n} unlabeled samples for the coordinator but the dataset "
            f"has only {len(dataset)}; lower {cfg.algorithm}.unlabeled_size"
        )
    held = stratified_indices(dataset.y.numpy(), n, cfg.seed + 1)
    rest = np.setdiff1d(np.arange(len(dataset)), held)
    return dataset.subset(rest), ServerData(unlabeled=dataset.x[torch.from_numpy(held)])


def client_spec(cfg: RunConfig, family: str, dataset: Dataset) -> ArchSpec:
    """The ArchSpec of a `family` model on `dataset` under the run's model_kwargs."""
    spec = ArchSpec(
        family=family,
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.input_shape),
        kwargs=cfg.model_kwargs.get(family, {}),
    )
    reference_shapes(spec)  # fail now (e.g. lenet5 on 60 features), not at registration
    return spec


def client_seed(seed: int, index: int) -> int:
    """The seed of client `index` of a federation seeded `seed` (simulated or deployed alike)."""
    return seed * 7919 + index


def transport_factory(cfg: RunConfig, run_id: str) -> Callable[[str], Transport]:
    """A transport per participant: on one fresh in-memory broker, or to `cfg.broker`."""
    if cfg.broker.url is None:
        broker = InMemoryBroker()
        return lambda who: broker.connect(f"{run_id}-{who}")
    settings = cfg.broker
    return lambda who: MqttTransport(settings, f"edgefl-{run_id}-{who}")


_TRIM_EVERY_S = 1.0


def _lean_heap(threads: int) -> Callable[[object], None] | None:
    """Keep glibc from hoarding freed memory across the client threads; returns a task hook
    that hands what is free back to the system (None where the C library is not glibc).

    glibc gives threads their own heaps (arenas), each keeping what was freed in it: with 20
    client threads, a Fashion-MNIST FML round left about 1 GB of freed memory held. The
    arenas are capped at one per concurrently training client (new threads share them) and
    `malloc_trim(0)` after a task releases free pages (benchmarks/simulate_scale.py), at most
    once a second: a trim costs ~5 ms and the pages it returns fault back in, which took a
    quarter of a round of 100 lenet5 clients whose tasks last ~50 ms when every task trimmed.
    The cap stays for the rest of the process.
    """
    libc = glibc()
    if libc is None:  # not glibc: nothing to release this way
        return None
    trim = libc.malloc_trim
    libc.mallopt(M_ARENA_MAX, max(2, threads))
    last = [-math.inf]

    def release(_outcome: object) -> None:
        now = time.monotonic()
        if now - last[0] >= _TRIM_EVERY_S:  # a race trims twice at worst
            last[0] = now
            trim(0)

    return release


def run_federation(
    cfg: RunConfig,
    fed: Federation,
    algorithm: str,
    *,
    models: list[str] | None = None,
    export_dir: Path | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> RunResult:
    """Run one algorithm: N EdgeClients and a Coordinator over the in-memory transport, or over
    the broker `cfg.broker` names (the same code path a deployment takes)."""
    device = resolve_device(cfg.device)
    families = models or cfg.models
    run_id = f"{cfg.run_id}-{algorithm}"
    connect = transport_factory(cfg, run_id)
    transports = [connect(topics.COORDINATOR)]
    coordinator = Coordinator(
        transports[0],
        algorithm=algorithm,
        config=cfg.algorithm_config(algorithm),
        rounds=cfg.rounds,
        expected_clients=len(fed.client_ids),
        clients_per_round=cfg.clients_per_round,
        global_model=(
            cfg.global_family
            if issubclass(strategy_class(algorithm), GlobalModelStrategy)
            else None
        ),
        model_kwargs=cfg.model_kwargs,
        round_config=cfg.round,
        run_id=run_id,
        seed=cfg.seed,
        share_models=cfg.broadcast,
        on_round=on_round,
        server_data=fed.server_data,
    )
    parallel = cfg.parallel or os.cpu_count() or 1
    gate = threading.Semaphore(parallel)
    # Clients train on their own threads: give each an equal share of the cores instead of
    # letting every one spawn a full intra-op pool (measured 1.7× faster on 2 cores). Set
    # before the client threads start, restored when the run ends.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel))
    release = _lean_heap(parallel)
    cohorts: dict[str, Cohort] = {}  # by architecture
    clients: list[EdgeClient] = []
    try:
        coordinator.open()
        for i, (cid, data) in enumerate(zip(fed.client_ids, fed.client_data, strict=True)):
            spec = client_spec(cfg, families[i % len(families)], fed.dataset)
            transports.append(connect(cid))
            clients.append(
                EdgeClient(
                    cid,
                    spec,
                    data,
                    transports[-1],
                    run_id=run_id,
                    device=device,
                    seed=client_seed(cfg.seed, i),
                    onnx_path=export_dir / f"{cid}.onnx" if export_dir else None,
                    class_names=fed.dataset.classes,
                    normalization=fed.dataset.normalization,
                    fp16_upload=cfg.fp16_upload,
                    compute_gate=gate,
                    cohort=cohorts.setdefault(spec.to_json(), Cohort(gate)) if cfg.cohort else None,
                    on_task=release,
                ).start()
            )
        return coordinator.run()
    finally:
        for c in clients:
            c.stop()
        for t in transports:
            t.close()
        torch.set_num_threads(threads)


def simulate(
    cfg: RunConfig,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the configured algorithm and its baselines; write results, report and plots to `out`."""
    from tqdm.auto import tqdm

    fed = prepare_federation(cfg)
    out = Path(cfg.out) if cfg.out else None
    log.info(
        "%s on %s (%s, %d clients): %s",
        cfg.algorithm,
        cfg.data.dataset,
        cfg.data.partition,
        len(fed.client_ids),
        cfg.models,
    )
    runs: dict[str, RunResult] = {}
    for name in [cfg.algorithm, *[b for b in cfg.baselines if b != cfg.algorithm]]:
        bar = tqdm(total=cfg.rounds, desc=name, unit="round", disable=not progress, leave=True)

        def tick(rec: RoundRecord, bar: Any = bar) -> None:
            bar.update(1)
            if rec.mean_personal_acc is not None:
                bar.set_postfix(personal=f"{rec.mean_personal_acc:.3f}")

        is_main = name == cfg.algorithm
        models = [cfg.global_family] if (name in _ONE_ARCH and not is_main) else None
        export_dir = out / "onnx" if (out and cfg.export_onnx and is_main) else None
        runs[name] = run_federation(
            cfg, fed, name, models=models, export_dir=export_dir, on_round=tick
        )
        bar.close()
    results = build_results(cfg, runs) | {"split": split_record(fed)}
    if out is not None:
        write_results(results, out)
        write_split(fed, out)
    return results


def split_table(fed: Federation) -> str:
    """Samples and top classes per client, as a plain-text table keyed by client id."""
    rows = split_summary(fed.partition, fed.dataset.y.numpy(), class_names=fed.dataset.classes)
    for row, cid in zip(rows, fed.client_ids, strict=True):
        row["client"] = cid  # the ids the results use, not partition indices
    return format_split_table(rows)


def split_record(fed: Federation) -> dict[str, Any]:
    """Each client's share of the data for results.json (the report plots its classes)."""
    y = fed.dataset.y.numpy()
    k = fed.dataset.num_classes
    return {
        "scheme": fed.partition.scheme,
        "classes": list(fed.dataset.classes),
        "clients": [
            {
                "id": cid,
                "n_train": len(cs.train),
                "n_val": len(cs.val),
                "n_test": len(cs.test),
                "counts": np.bincount(y[cs.train], minlength=k).tolist(),  # training, per class
            }
            for cid, cs in zip(fed.client_ids, fed.partition.clients, strict=True)
        ],
    }


def write_split(fed: Federation, out: Path) -> None:
    """split.txt (samples and top classes per client) and label_distribution.png."""
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".split-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(split_table(fed) + "\n")
    os.replace(tmp, out / "split.txt")
    plot_label_distribution(
        fed.partition,
        fed.dataset.y.numpy(),
        out / "label_distribution.png",
        class_names=fed.dataset.classes,
    )


_RESULT_KEYS = frozenset(
    {"config", "algorithm", "budget", "rounds", "clients", "summary", "baselines"}
)


def build_results(cfg: RunConfig, runs: dict[str, RunResult]) -> dict[str, Any]:
    """The results.json structure: main run, per-client comparison with baselines, metrics."""
    main = runs[cfg.algorithm]
    local = {c.id: c.personal_acc for c in runs["local"].clients} if "local" in runs else {}
    # QoI compares against the global *FedAvg* model (PersFL's G_i) when that baseline ran.
    fedavg = {c.id: c.global_acc for c in runs["fedavg"].clients} if "fedavg" in runs else {}
    clients: list[dict[str, Any]] = []
    for c in main.clients:
        glob = c.global_acc if c.global_acc is not None else fedavg.get(c.id)
        entry: dict[str, Any] = {
            "id": c.id,
            "arch": c.arch,
            "n_train": c.n_train,
            "personal_acc": c.personal_acc,
            "global_acc": glob,
            "local_acc": local.get(c.id),
            "fedavg_acc": fedavg.get(c.id),
            **({"error": c.error} if c.error else {}),
        }
        # What the algorithm reported about this client at the end (teacher round, λ, T, the
        # architecture it ended with...); it never overrides the fields above.
        for key, value in c.details.items():
            if key in entry:
                log.warning("%s: detail %r collides with a results field; dropped", c.id, key)
            else:
                entry[key] = value
        clients.append(entry)
    personal = [c.personal_acc for c in main.clients]
    curve = [r.mean_personal_acc for r in main.rounds if r.mean_personal_acc is not None]
    globals_ = [r.global_acc for r in main.rounds if r.global_acc is not None]
    final_personal = _mean(personal)
    summary: dict[str, Any] = {
        "mean_personal_acc": final_personal,
        "global_acc": main.rounds[-1].global_acc if main.rounds else None,
        # pFedMe-style reporting takes the best round; we report both final and best. The final
        # models count too: fedavg_ft's personalized models exist only after its fine-tuning.
        "best_mean_personal_acc": max(
            [*curve, *([final_personal] if final_personal is not None else [])], default=None
        ),
        "best_global_acc": max(globals_, default=None),
        "failed_rounds": sum(r.failed for r in main.rounds),
        "wall_seconds": sum(r.wall_seconds for r in runs.values()),
        # what crossed the coordinator's connection (payload bytes, the whole run)
        "coordinator_bytes_out": main.bytes_out,
        "coordinator_bytes_in": main.bytes_in,
    }
    source = "fedavg" if fedavg else cfg.algorithm
    g: list[float | None] = [c["fedavg_acc"] if fedavg else c["global_acc"] for c in clients]
    loc: list[float | None] = [c["local_acc"] for c in clients]
    if clients and all(v is not None for v in personal + g + loc):
        summary["metrics"] = personalization_metrics(
            np.array(personal, dtype=float), np.array(g, dtype=float), np.array(loc, dtype=float)
        )
        summary["metrics_global_from"] = source
    elif cfg.baselines:
        log.warning("metrics skipped: some client lacks a personal, global or local accuracy")
    return {
        "config": cfg.model_dump(mode="json"),
        "algorithm": cfg.algorithm,
        # What local training each run got: epochs, or iterations of one batch (pfml).
        "budget": {name: training_budget(cfg, name) for name in runs},
        "rounds": [
            {
                "round": r.round,
                "seconds": round(r.seconds, 4),
                "mean_personal_acc": r.mean_personal_acc,
                "global_acc": r.global_acc,
                "failed": r.failed,
                "replied": len(r.replied),
                "trained": len(r.trained),
                # per client, what its fit reply reported (e.g. the architecture it chose)
                **({"clients": r.client_details} if r.client_details else {}),
                # per client, its personalized accuracy after the round (when evaluated)
                **({"client_acc": r.client_acc} if r.client_acc else {}),
            }
            for r in main.rounds
        ],
        "clients": clients,
        "summary": summary,
        # what the algorithm's server half adds (FedeRiCo: the collaboration matrix)
        **{k: v for k, v in main.extra.items() if k not in _RESULT_KEYS},
        "baselines": {
            name: {
                "summary": {
                    "mean_personal_acc": _mean([c.personal_acc for c in run.clients]),
                    "global_acc": run.rounds[-1].global_acc if run.rounds else None,
                    "best_global_acc": max(
                        (r.global_acc for r in run.rounds if r.global_acc is not None),
                        default=None,
                    ),
                    "wall_seconds": run.wall_seconds,
                },
                "clients": [
                    {
                        "id": c.id,
                        "arch": c.arch,
                        "personal_acc": c.personal_acc,
                        "global_acc": c.global_acc,
                    }
                    for c in run.clients
                ],
            }
            for name, run in runs.items()
            if name != cfg.algorithm
        },
    }


_BUDGET_FIELDS = ("local_epochs", "local_iterations", "batch_size", "lr", "ft_epochs")


def training_budget(cfg: RunConfig, algorithm: str) -> dict[str, Any]:
    """The local-training budget fields of one algorithm's config, in its own units."""
    section = cfg.algorithm_config(algorithm).model_dump()
    return {k: section[k] for k in _BUDGET_FIELDS if k in section}


def write_results(results: dict[str, Any], out: Path) -> Path:
    """results.json (atomically) plus report.md and its plots."""
    from coordinator.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".results-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=2, default=_json_default)
    os.replace(tmp, path)
    write_report(results, out)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None
