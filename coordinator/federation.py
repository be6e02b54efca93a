"""Setting up a federation from one RunConfig: the data, the split, and the two factories.

`prepare_federation(cfg)` loads and partitions the data exactly as every participant of a run
does (the simulator, the demo's baselines and each `edgefl client` process hold the same split),
so client `i` gets the same tensors, id, architecture and seed wherever it runs.

The one way to build a federation's parts, used by `simulate`, `edgefl coordinator`,
`edgefl client`, the demo and the tests: `build_coordinator(cfg, fleet)` for the server side and
`build_node(cfg, fed, i)` for client `i` (a device wraps its node in an `EdgeClient`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from coordinator.fleet import Fleet
from coordinator.results import RoundRecord
from coordinator.results_model import Split, SplitClient
from coordinator.run_config import RunConfig
from coordinator.server import Coordinator
from coordinator.server_data import ServerData
from coordinator.strategies import strategy_class
from edge_sdk.client_data import ClientData
from edge_sdk.device import resolve_device
from edge_sdk.model_blobs import reference_shapes
from edge_sdk.node import ClientNode
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
from model_zoo.files import write_atomic

__all__ = [
    "Federation",
    "build_coordinator",
    "build_node",
    "client_seed",
    "client_spec",
    "config_families",
    "config_family",
    "prepare_federation",
    "split_record",
    "split_table",
    "write_split",
]


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


def data_seed(cfg: RunConfig) -> int:
    """The seed of the data side of `cfg`'s run: `data.seed`, else the run's `seed`."""
    return cfg.seed if cfg.data.seed is None else cfg.data.seed


def prepare_federation(cfg: RunConfig) -> Federation:
    d = cfg.data
    seed = data_seed(cfg)
    # The data seed picks the subset; a generator's own seed (Synthetic's) stays in `options`.
    subset = {"max_samples": d.max_samples, "seed": seed} if d.max_samples else {}
    dataset = load_dataset(d.dataset, root=d.root, **subset, **d.options)
    dataset, server_data = _hold_out(cfg, dataset)
    part = partition(
        dataset.y.numpy(),
        d.partition,
        cfg.clients,
        seed=seed,
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
    held = stratified_indices(dataset.y.numpy(), n, data_seed(cfg) + 1)
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


def build_coordinator(
    cfg: RunConfig,
    fleet: Fleet,
    *,
    algorithm: str | None = None,
    fed: Federation | None = None,
    run_id: str | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    checkpoint_path: Path | None = None,
    incarnation: int | None = None,
) -> Coordinator:
    """The coordinator of `algorithm` (default: the run's) over `fleet`; `incarnation`: this
    start's number (default: the clock's milliseconds; see Coordinator).

    With the federation's data at hand (`fed`: a simulation), the clients' architectures are
    the config's `models`, so a strategy with a global model takes `global_family` (the first of
    them unless `global_model` names one) and the coordinator keeps the samples the strategy
    holds out (`fed.server_data`). Without it (the daemon), the global model is `global_model`,
    or the clients' one architecture when they all register the same. A simulation's
    `round.eval_clients` sample is drawn by the config's `models` (every baseline evaluates the
    same clients, whatever architecture it trains) and only it is finalized.
    """
    name = algorithm or cfg.algorithm
    has_global = strategy_class(name).has_global_model
    return Coordinator(
        fleet,
        algorithm=name,
        config=cfg.algorithm_config(name),
        rounds=cfg.rounds,
        expected_clients=len(fed.client_ids) if fed is not None else cfg.clients,
        clients_per_round=cfg.clients_per_round,
        allow=cfg.allow,
        global_model=(cfg.global_family if fed is not None else cfg.global_model)
        if has_global
        else None,
        model_kwargs=cfg.model_kwargs,
        round_config=cfg.round,
        robust=cfg.robust,
        run_id=run_id or cfg.run_id,
        seed=cfg.seed,
        on_round=on_round,
        checkpoint_path=checkpoint_path,
        server_data=fed.server_data if fed is not None else None,
        incarnation=incarnation,
        eval_families=None if fed is None else config_families(cfg, fed),
        finalize_sample=fed is not None,
    )


def config_family(cfg: RunConfig, index: int) -> str:
    """The architecture the config assigns the client at `index` (`models`, round-robin)."""
    return cfg.models[index % len(cfg.models)]


def config_families(cfg: RunConfig, fed: Federation) -> dict[str, str]:
    """Each client's architecture as the config assigns it (`config_family`)."""
    return {cid: config_family(cfg, i) for i, cid in enumerate(fed.client_ids)}


def build_node(
    cfg: RunConfig,
    fed: Federation,
    index: int,
    *,
    run_id: str | None = None,
    family: str | None = None,
    client_id: str | None = None,
    onnx_path: Path | None = None,
    state_dir: Path | None = None,
) -> ClientNode:
    """Client `index` of the split: its data, id, architecture (`family`, default the config's
    `models` round-robin) and seed, on the config's device."""
    if not 0 <= index < len(fed.client_ids):
        raise ValueError(f"client index {index} is out of range for {len(fed.client_ids)} clients")
    family = family or config_family(cfg, index)
    cid = client_id or fed.client_ids[index]
    return ClientNode(
        cid,
        client_spec(cfg, family, fed.dataset),
        fed.client_data[index],
        run_id=run_id or cfg.run_id,
        device=resolve_device(cfg.device),
        seed=client_seed(cfg.seed, index),
        onnx_path=onnx_path,
        class_names=fed.dataset.classes,
        normalization=fed.dataset.normalization,
        state_dir=state_dir,
        dataset=fed.dataset.name,
        budget=cfg.deploy.for_client(cid),
        onnx_exporter=cfg.onnx_exporter,
    )


def split_table(fed: Federation) -> str:
    """Samples and top classes per client, as a plain-text table keyed by client id."""
    rows = split_summary(fed.partition, fed.dataset.y.numpy(), class_names=fed.dataset.classes)
    for row, cid in zip(rows, fed.client_ids, strict=True):
        row["client"] = cid  # the ids the results use, not partition indices
    return format_split_table(rows)


def split_record(fed: Federation) -> Split:
    """Each client's share of the data for results.json (the report plots its classes)."""
    y = fed.dataset.y.numpy()
    k = fed.dataset.num_classes
    return Split(
        scheme=fed.partition.scheme,
        classes=list(fed.dataset.classes),
        clients=[
            SplitClient(
                id=cid,
                n_train=len(cs.train),
                n_val=len(cs.val),
                n_test=len(cs.test),
                counts=np.bincount(y[cs.train], minlength=k).tolist(),  # training, per class
            )
            for cid, cs in zip(fed.client_ids, fed.partition.clients, strict=True)
        ],
    )


def write_split(fed: Federation, out: Path) -> None:
    """split.txt (samples and top classes per client) and label_distribution.png."""
    write_atomic(out / "split.txt", split_table(fed) + "\n")
    plot_label_distribution(
        fed.partition,
        fed.dataset.y.numpy(),
        out / "label_distribution.png",
        class_names=fed.dataset.classes,
    )
