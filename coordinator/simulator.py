"""The simulator: a run's algorithm and its baselines on one split, in one process (the runner).

The data side lives in `coordinator.federation`, the results in `coordinator.results`. Each run
is a Coordinator and one ClientNode per client (built by the federation's factories, as a
deployment builds them). By default the nodes run in this process (`LocalFleet`: no
serialisation, compatible clients trained as one stacked model); `fleet = "network"` serves
every node as an EdgeClient over the in-memory transport instead, and a broker URL over MQTT,
the code path of a deployment. Both give the same per-client results for the same seed.
Baselines run the same way on the same split, and their per-client accuracies feed the QoI
metrics.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from coordinator import distributed
from coordinator.config import ConfigError, load_config
from coordinator.federation import (
    Federation,
    build_coordinator,
    build_node,
    client_spec,
    prepare_federation,
    split_record,
    write_split,
)
from coordinator.fleet import LocalFleet, NetworkFleet
from coordinator.fleet.ranks import (
    RankFleet,
    Ranks,
    ShardFleet,
    balance,
    client_cost,
    from_rank0,
    serve,
)
from coordinator.results import (
    RoundRecord,
    RunResult,
    build_results,
    device_record,
    write_results,
)
from coordinator.results_model import Results
from coordinator.run_config import RunConfig
from coordinator.strategies import strategy_class
from edge_sdk import topics
from edge_sdk.algorithms.federico import FedeRiCoConfig
from edge_sdk.algorithms.guard_config import GuardConfig
from edge_sdk.auth import Keyring
from edge_sdk.client import EdgeClient
from edge_sdk.device import choose_device, cpu_threads
from edge_sdk.malloc import M_ARENA_MAX, glibc
from edge_sdk.node import ClientNode
from edge_sdk.trainer import Trainer
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import MqttTransport
from model_zoo.files import write_atomic

__all__ = ["run_federation", "serve_runs", "simulate", "transport_factory"]

log = logging.getLogger(__name__)


def transport_factory(cfg: RunConfig, run_id: str) -> Callable[[str], Transport]:
    """A transport per participant: on one fresh in-memory broker, or to `cfg.broker`."""
    if cfg.broker.url is None:
        broker = InMemoryBroker()
        return lambda who: broker.connect(f"{run_id}-{who}")
    settings = cfg.broker
    return lambda who: MqttTransport(settings, f"edgefl-{run_id}-{who}")


_TRIM_EVERY_S = 1.0
# The progress bar after the last round, while every client finalizes: its guard
# fine-tunes, distils its students and chooses what it deploys, and it exports the model.
FINALIZING = "finalizing each client's model"


def _lean_heap(threads: int) -> Callable[[object], None] | None:
    """Keep glibc from hoarding freed memory across training threads; returns a hook that hands
    what is free back to the system (None where the C library is not glibc).

    glibc gives threads their own heaps (arenas), each keeping what was freed in it: with 20
    client threads, a Fashion-MNIST FML round left about 1 GB of freed memory held. The arenas
    are capped at one per concurrently training thread and `malloc_trim(0)` releases free pages
    (benchmarks/simulate_scale.py), at most once a second: a trim costs ~5 ms and the pages it
    returns fault back in. The cap stays for the rest of the process.
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
    client_cls: Mapping[str, type[EdgeClient]] | None = None,
    on_clients: Callable[[int], None] | None = None,
) -> RunResult:
    """Run one algorithm on the federation: its clients in this process (`LocalFleet`, the
    default), or as EdgeClients over the in-memory transport (`fleet = "network"`) or over the
    broker `cfg.broker` names, the code path a deployment takes. `client_cls`: per client id,
    the EdgeClient class that serves it over the network (a benchmark's attacker).
    `on_clients`: told how many clients' tasks ended, as a phase's tasks end (`Fleet.finished`;
    over ranks, not told).

    In a simulation over ranks (`coordinator.distributed`), rank 0 runs this; the other ranks
    serve their shards of it (`serve_runs`)."""
    result = _run(cfg, fed, algorithm, models, export_dir, on_round, client_cls, on_clients)
    assert result is not None  # rank 0, or one process
    return result


def _run(
    cfg: RunConfig,
    fed: Federation,
    algorithm: str,
    models: list[str] | None,
    export_dir: Path | None,
    on_round: Callable[[RoundRecord], None] | None,
    client_cls: Mapping[str, type[EdgeClient]] | None,
    on_clients: Callable[[int], None] | None = None,
) -> RunResult | None:
    families = models or cfg.models
    run_id = f"{cfg.run_id}-{algorithm}"
    ranks = distributed.current()
    # Clients by rank: every client here in one process, else shards balanced by work.
    shards = (
        [list(range(len(fed.client_ids)))] if ranks is None else _shards(cfg, fed, families, ranks)
    )
    mine = shards[0 if ranks is None else ranks.rank]
    # With exports, each client's state is kept in OUT/state for `edgefl export`; with
    # checkpoints, in OUT/checkpoint/<algorithm>. A simulation starts from scratch, never from
    # what an earlier run with the same OUT left there (rank 0 clears it: every rank's clients
    # save there), unless it resumes from the coordinator's checkpoint.
    kept = checkpoint_dir(cfg)
    ckpt = kept / f"{algorithm}.state" if kept else None
    state_dir = export_dir.parent / "state" if export_dir else (kept / algorithm if kept else None)
    resuming = ckpt is not None and ckpt.exists()
    if state_dir is not None and not resuming and (ranks is None or ranks.rank == 0):
        shutil.rmtree(state_dir, ignore_errors=True)
    nodes = [
        build_node(
            cfg,
            fed,
            i,
            run_id=run_id,
            family=families[i % len(families)],
            onnx_path=export_dir / f"{fed.client_ids[i]}.onnx" if export_dir else None,
            state_dir=state_dir,
        )
        for i in mine
    ]
    if ranks is not None:
        owners = {fed.client_ids[i]: r for r, part in enumerate(shards) for i in part}
        return _over_ranks(
            cfg, fed, algorithm, ranks, nodes, owners, run_id, on_round, on_clients, ckpt
        )
    threads = cfg.threads or cpu_threads()  # the CPU threads this run trains with
    parallel = cfg.parallel or threads
    release = _lean_heap(parallel)

    def round_done(rec: RoundRecord) -> None:
        if release is not None:
            release(rec)
        if on_round is not None:
            on_round(rec)

    if cfg.fleet == "local" and cfg.broker.url is None and not client_cls:
        fleet = LocalFleet(nodes, parallel=parallel, threads=threads, **_local_options(cfg))
        fleet.finished = on_clients
        coordinator = build_coordinator(
            cfg,
            fleet,
            algorithm=algorithm,
            fed=fed,
            run_id=run_id,
            on_round=round_done,
            checkpoint_path=ckpt,
        )
        return coordinator.run()
    if cfg.checkpoint:
        raise ConfigError(
            "checkpoint = true resumes the clients of the local fleet; clients over a "
            "transport keep their own state (edgefl client --state-dir): set fleet = local "
            "and no broker, or checkpoint = false"
        )
    if cfg.idle_state != "memory":
        raise ConfigError(
            f"idle_state = {cfg.idle_state!r} parks the clients of the local fleet between "
            "their tasks; clients over a transport keep their own state: set fleet = local "
            "and no broker, or idle_state = memory"
        )
    classes = client_cls or {}
    return _over_network(
        cfg, fed, algorithm, nodes, run_id, threads, parallel, round_done, classes, on_clients
    )


def _local_options(cfg: RunConfig) -> dict[str, Any]:
    """The settings of a fleet of in-process clients (one process, or one rank's shard)."""
    return {
        "stack": cfg.cohort,
        "fp16_upload": cfg.fp16_upload,
        "idle": cfg.idle_state,
        "idle_dir": cfg.idle_dir,
        "chunk": cfg.clients_per_round,
    }


def _shards(cfg: RunConfig, fed: Federation, families: list[str], ranks: Ranks) -> list[list[int]]:
    """Client indices per rank, balanced by work (`coordinator.fleet.ranks.balance`): the same
    on every rank."""
    costs = [
        client_cost(client_spec(cfg, families[i % len(families)], fed.dataset), d.n_train)
        for i, d in enumerate(fed.client_data)
    ]
    return balance(costs, ranks.world)


def _over_ranks(
    cfg: RunConfig,
    fed: Federation,
    algorithm: str,
    ranks: Ranks,
    nodes: list[ClientNode],
    owners: dict[str, int],
    run_id: str,
    on_round: Callable[[RoundRecord], None] | None,
    on_clients: Callable[[int], None] | None,
    checkpoint_path: Path | None,
) -> RunResult | None:
    """This rank's part of a run sharded over ranks: rank 0 coordinates (its result), the
    others serve their shard's phases (None). A rank's threads: its share of the machine's."""
    shard = ShardFleet(
        nodes,
        ranks,
        parallel=cfg.parallel or ranks.threads,
        threads=ranks.threads,
        **_local_options(cfg),
    )
    log.info("rank %d of %d (pid %d): clients %s", ranks.rank, ranks.world, os.getpid(),
             ", ".join(n.client_id for n in nodes))  # fmt: skip
    if ranks.rank != 0:
        serve(shard)
        return None
    fleet = RankFleet(shard, owners)
    fleet.finished = on_clients  # every rank's clients: rank 0's as they end, others' counted
    coordinator = build_coordinator(
        cfg,
        fleet,
        algorithm=algorithm,
        fed=fed,
        run_id=run_id,
        on_round=on_round,
        checkpoint_path=checkpoint_path,
    )
    return coordinator.run()


def _over_network(
    cfg: RunConfig,
    fed: Federation,
    algorithm: str,
    nodes: list[ClientNode],
    run_id: str,
    threads: int,
    parallel: int,
    on_round: Callable[[RoundRecord], None],
    client_cls: Mapping[str, type[EdgeClient]],
    on_clients: Callable[[int], None] | None = None,
) -> RunResult:
    """Every node an EdgeClient on its own thread and transport, the coordinator on another;
    `threads`: the CPU threads of the run, shared by the `parallel` clients training at once."""
    connect = transport_factory(cfg, run_id)
    transports = [connect(topics.COORDINATOR)]
    # Keys for this run only, in memory: every message is signed as in a deployment.
    keys = Keyring.ephemeral([topics.COORDINATOR, *(n.client_id for n in nodes)])
    fleet = NetworkFleet(
        transports[0], share_models=cfg.broadcast, keyring=keys[topics.COORDINATOR]
    )
    fleet.finished = on_clients
    coordinator = build_coordinator(
        cfg, fleet, algorithm=algorithm, fed=fed, run_id=run_id, on_round=on_round
    )
    # Clients train on their own threads: give each an equal share of the cores instead of
    # letting every one spawn a full intra-op pool. Restored when the run ends.
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // parallel))
    clients: list[EdgeClient] = []
    try:
        coordinator.open()
        for node in nodes:
            transports.append(connect(node.client_id))
            cls = client_cls.get(node.client_id, EdgeClient)
            client = cls(
                node, transports[-1], fp16_upload=cfg.fp16_upload, keyring=keys[node.client_id]
            )
            clients.append(client.start())
        return coordinator.run()
    finally:
        for c in clients:
            c.stop()
        for t in transports:
            t.close()
        torch.set_num_threads(saved)


def _federico_budget(cfg: RunConfig, fed: Federation) -> None:
    """FedeRiCo takes one step of one batch per round, whatever the epochs: say what the run's
    rounds give its largest client against local training's epochs, and the rounds that would
    give it as many passes in a run of its own (in one run, the baselines share its rounds).
    A warning when they make less than one pass over that client's data."""
    if cfg.algorithm != "federico" or not fed.client_data:
        return
    own = cfg.algorithm_config()
    assert isinstance(own, FedeRiCoConfig)
    batch, n = own.batch_size, max(d.n_train for d in fed.client_data)
    if n == 0:
        return
    step = min(batch, n)  # a batch holds at most the client's samples
    passes = cfg.rounds * step / n
    alone = cfg.rounds * getattr(cfg.algorithm_config("local"), "local_epochs", 1)
    log.log(
        logging.WARNING if passes < 1 else logging.INFO,
        "federico takes one step of %d samples a round: %d rounds are %.2g passes over the "
        "largest client's %d training samples (local training: %d). For as many passes as "
        "local training's %d, run federico on its own with --rounds %d",
        batch,
        cfg.rounds,
        passes,
        n,
        alone,
        alone,
        math.ceil(alone * n / step),
    )


def _batch_budget(cfg: RunConfig, fed: Federation) -> None:
    """Warn when the run's batches hold as many samples as most clients have: an epoch is then
    one step (as FML's paper batch of 128 makes it on the default split's 76-155 samples a
    client), and a short run barely trains. Names a batch size that gives the median client
    several steps an epoch."""
    sizes = sorted(d.n_train for d in fed.client_data)
    if not sizes:
        return
    median = sizes[len(sizes) // 2]
    suggest = max(1, 2 ** math.floor(math.log2(max(1, median // 5))))
    by_batch: dict[int, list[str]] = {}
    for name in cfg.runs:
        own = cfg.algorithm_config(name)
        batch, epochs = getattr(own, "batch_size", None), getattr(own, "local_epochs", None)
        if isinstance(batch, int) and epochs and batch >= median:
            by_batch.setdefault(batch, []).append(name)
    for batch, names in by_batch.items():
        one_step = sum(n <= batch for n in sizes)
        log.warning(
            "%s: batches of %d samples on clients of %d-%d training samples (median %d) make "
            "an epoch one step for %d of %d clients; --batch-size %d gives the median client %d "
            "steps an epoch",
            ", ".join(names),
            batch,
            sizes[0],
            sizes[-1],
            median,
            one_step,
            len(sizes),
            suggest,
            math.ceil(median / suggest),
        )


# A population this large, and this many times a round's cohort, is evaluated whole only on
# request (`_population_budget`).
_POPULATION_SAID = 1_000
_POPULATION_COHORTS_SAID = 10


def _population_budget(cfg: RunConfig, fed: Federation) -> None:
    """Warn where every evaluation and the finalize reach a population far larger than a round's
    cohort: with 10,000 clients and 100 a round, evaluating and personalizing everyone is most
    of the run's work. Names the settings that evaluate a sample, or less often."""
    n, per_round = len(fed.client_ids), cfg.clients_per_round
    if cfg.round.eval_clients is not None or per_round is None:
        return
    if n < _POPULATION_SAID or n < _POPULATION_COHORTS_SAID * per_round:
        return
    log.warning(
        "%d clients, %d trained a round: every evaluating round evaluates all %d and the "
        "finalize personalizes all %d, most of the run's work; --set round.eval_clients=%d "
        "evaluates and finalizes a sample (every architecture in proportion, the same in each "
        "round and baseline), --set round.eval_every=N evaluates every N rounds",
        n,
        per_round,
        n,
        n,
        min(n, 2 * per_round),
    )


# The most samples one of the guard's students learns on before the simulator says so
# (`_student_budget`); the benchmarks' devices, of 24 to 147 images, stay below 56,000.
_STUDENT_SAMPLES_SAID = 100_000


def _student_budget(cfg: RunConfig, fed: Federation) -> None:
    """Warn where the guard's students of the largest client (up to two a client, after the
    last round) would learn on more than `_STUDENT_SAMPLES_SAID` samples each: their epochs and
    views were measured on devices of a few dozen to a few hundred images, and on thousands the
    finalize takes many times the rounds. Names `guard_distill_samples`, which bounds them."""
    own = cfg.algorithm_config(cfg.algorithm)
    if not isinstance(own, GuardConfig) or not own.guard_distill_epochs:
        return
    largest = max(fed.client_data, key=lambda d: d.n_train, default=None)
    if largest is None or own.guard_distill_samples:
        return
    views = Trainer(torch.device("cpu")).views_per_epoch(
        largest.x_train, own.guard_distill_shift, own.guard_distill_views, own.guard_distill_mix
    )
    samples = own.guard_distill_epochs * views * largest.n_train
    if samples <= _STUDENT_SAMPLES_SAID:
        return
    log.warning(
        "%s: each of the guard's students on the largest client learns on %s samples (%d epochs "
        "of %d views of %d), up to two a client after the last round: the finalize can take "
        "many times the rounds. --set %s.guard_distill_samples=64000 bounds each student (on "
        "clients of about 1,000 images, a finalize 2.3-3.0 times faster for 0.2-0.8 points of "
        "accuracy: docs/algorithms.md)",
        cfg.algorithm,
        f"{samples:,}",
        own.guard_distill_epochs,
        views,
        largest.n_train,
        cfg.algorithm,
    )


def simulate(
    cfg: RunConfig,
    *,
    progress: bool = True,
) -> Results:
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
    _federico_budget(cfg, fed)
    _batch_budget(cfg, fed)
    _student_budget(cfg, fed)
    _population_budget(cfg, fed)
    finished = _finished_runs(cfg)
    ranks = distributed.current()
    if ranks is not None:  # the other ranks skip what is finished too
        from_rank0(ranks, sorted(finished), "the finished runs")
    runs: dict[str, RunResult] = dict(finished)
    for name in cfg.runs:
        if name in runs:
            log.info("%s: finished before (%s); not run again", name, _finished_path(cfg, name))
            continue
        bar = _RunBar(
            tqdm(total=cfg.rounds, desc=name, unit="round", disable=not progress, leave=True),
            cfg.rounds,
            min(len(fed.client_ids), cfg.round.eval_clients or len(fed.client_ids)),
        )
        models, export_dir = _run_args(cfg, name)
        runs[name] = run_federation(
            cfg,
            fed,
            name,
            models=models,
            export_dir=export_dir,
            on_round=bar.round_done,
            on_clients=bar.clients_done,
        )
        bar.close()
        if (path := _finished_path(cfg, name)) is not None:
            write_atomic(path, json.dumps(runs[name].to_dict()))
    devices = ranks.devices if ranks is not None else ()
    results = build_results(cfg, runs, device=device_record(choose_device(cfg.device), devices))
    results.split = split_record(fed)
    if out is not None:
        write_results(results, out)
        write_split(fed, out)
    return results


class _RunBar:
    """A run's progress bar: a step per round, the last mean personalized accuracy and, after
    the last round, the finalize (what follows it can outlast the rounds) with how many of the
    clients have finalized, where the fleet says so (`on_clients` of `run_federation`)."""

    def __init__(self, bar: Any, rounds: int, clients: int) -> None:
        self.bar, self.rounds, self.clients = bar, rounds, clients
        self.shown: dict[str, str] = {}  # the bar's postfix
        self.finalized: int | None = None  # None: the rounds go on
        self._lock = threading.Lock()  # (jobs end on the fleet's worker threads)

    def round_done(self, rec: RoundRecord) -> None:
        with self._lock:
            self.bar.update(1)
            if rec.mean_personal_acc is not None:
                self.shown["personal"] = f"{rec.mean_personal_acc:.3f}"
            if rec.round == self.rounds:
                self.shown["now"] = FINALIZING
                self.finalized = 0
            self.bar.set_postfix(self.shown)

    def clients_done(self, n: int) -> None:
        with self._lock:
            if self.finalized is None:
                return
            self.finalized += n
            self.shown["now"] = f"{FINALIZING}, {self.finalized} of {self.clients}"
            self.bar.set_postfix(self.shown)

    def close(self) -> None:
        if self.shown.pop("now", None) is not None:
            self.bar.set_postfix(self.shown)
        self.bar.close()


def _run_args(cfg: RunConfig, name: str) -> tuple[list[str] | None, Path | None]:
    """The architectures of run `name` (None: the config's; a baseline that takes one
    architecture: the global one) and where its clients export ONNX (the main run's, if asked)."""
    is_main = name == cfg.algorithm
    one_arch = strategy_class(name).one_architecture
    models = [cfg.global_family] if (one_arch and not is_main) else None
    out = Path(cfg.out) if cfg.out else None
    export_dir = out / "onnx" if (out and cfg.export_onnx and is_main) else None
    return models, export_dir


def checkpoint_dir(cfg: RunConfig) -> Path | None:
    """Where a simulation keeps its checkpoint (`checkpoint = true`): OUT/checkpoint."""
    if not cfg.checkpoint:
        return None
    if not cfg.out:
        raise ConfigError("checkpoint = true keeps the checkpoint in OUT/checkpoint: set --out")
    return Path(cfg.out) / "checkpoint"


def _finished_path(cfg: RunConfig, name: str) -> Path | None:
    kept = checkpoint_dir(cfg)
    return kept / f"{name}.finished.json" if kept else None


def _unrun_sections(cfg: RunConfig) -> set[str]:
    """The config sections of the algorithms `cfg` does not run (neither its algorithm nor a
    baseline): nothing of the run depends on them."""
    from edge_sdk.algorithms import algorithm_names

    return set(algorithm_names()) - set(cfg.runs)


def _finished_runs(cfg: RunConfig) -> dict[str, RunResult]:
    """The runs (the algorithm, baselines) an earlier start of this simulation finished, read
    back from its checkpoint; none without one. A checkpoint of other settings is refused,
    naming them. What an edgefl of another version adds is no difference: the sections of
    algorithms the run does not run are not compared, and a setting the checkpoint lacks is
    taken at its default (logged)."""
    kept = checkpoint_dir(cfg)
    if kept is None:
        return {}
    kept.mkdir(parents=True, exist_ok=True)
    settings = kept / "settings.json"
    local = set(distributed.LOCAL_SETTINGS)
    ours = cfg.model_dump_json(exclude=local)
    if settings.exists():
        try:
            theirs = json.loads(settings.read_text())
        except ValueError as exc:
            raise ConfigError(f"{settings} is not the JSON a simulation writes ({exc})") from exc
        defaults = json.loads(load_config(environ=False).model_dump_json(exclude=local))
        differ, lacked = settings_differences(
            theirs, json.loads(ours), defaults, skip=_unrun_sections(cfg)
        )
        if differ:
            raise ConfigError(
                f"{kept} was written by a simulation with other settings ({', '.join(differ[:5])}"
                f"{', …' if len(differ) > 5 else ''}): remove it (or choose another --out) to "
                "start over, or run with the settings that wrote it"
            )
        if lacked:
            log.warning(
                "%s was written without the settings %s (an edgefl of another version): "
                "continuing with their defaults",
                kept,
                ", ".join(lacked),
            )
    write_atomic(settings, ours)
    done = {}
    for name in cfg.runs:
        path = _finished_path(cfg, name)
        if path is not None and path.exists():
            done[name] = RunResult.from_dict(json.loads(path.read_text()))
    return done


def settings_differences(
    theirs: Any, ours: Any, defaults: Any, at: str = "", *, skip: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """The settings (dotted) in which a checkpoint's `theirs` and this run's `ours` differ, and
    those `theirs` lacks where `ours` holds the default (`defaults`). A setting `theirs` holds
    and `ours` lacks differs: this edgefl no longer has it. `skip`: top-level settings not
    compared (the sections of algorithms a run does not run). (Also how benchmarks/ tell
    whether a run they kept ran the config they would run.)"""
    if not (isinstance(theirs, dict) and isinstance(ours, dict)):
        return ([at] if theirs != ours else []), []
    differ: list[str] = []
    lacked: list[str] = []
    base = defaults if isinstance(defaults, dict) else {}
    for key in sorted((theirs.keys() | ours.keys()) - set(skip)):
        name = f"{at}.{key}" if at else key
        if key not in theirs:
            (lacked if key in base and ours[key] == base[key] else differ).append(name)
        elif key not in ours:
            differ.append(name)
        else:
            d, lk = settings_differences(theirs[key], ours[key], base.get(key), name)
            differ += d
            lacked += lk
    return differ, lacked


def serve_runs(cfg: RunConfig) -> None:
    """A rank other than 0 of a simulation over ranks: its shard of every run `simulate` makes
    on rank 0, in the same order (rank 0 writes the results), less those it finished before."""
    fed = prepare_federation(cfg)
    ranks = distributed.current()
    finished = from_rank0(ranks, None, "the finished runs") if ranks is not None else []
    for name in cfg.runs:
        if name in finished:
            continue
        models, export_dir = _run_args(cfg, name)
        _run(cfg, fed, name, models, export_dir, None, None)  # this rank's shard
