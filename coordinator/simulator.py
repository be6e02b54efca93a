"""The simulator: one Coordinator and N EdgeClients over the in-memory transport (the runner).

The data side lives in `coordinator.federation`, the results in `coordinator.results`.

Nothing here calls client code directly: the simulator loads and partitions the data, gives each
EdgeClient its own split (as a device app brings its own data), starts the clients and the
coordinator on one in-memory broker, and reads the results back from the coordinator. Baselines
run the same way on the same split, and their per-client accuracies feed the QoI metrics.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from coordinator.config import RunConfig
from coordinator.federation import (
    Federation,
    client_seed,
    client_spec,
    prepare_federation,
    split_record,
    write_split,
)
from coordinator.results import RoundRecord, RunResult, build_results, write_results
from coordinator.server import Coordinator
from coordinator.strategies import GlobalModelStrategy, strategy_class
from edge_sdk import topics
from edge_sdk.client import EdgeClient
from edge_sdk.cohort import Cohort
from edge_sdk.device import resolve_device
from edge_sdk.malloc import M_ARENA_MAX, glibc
from edge_sdk.transport import InMemoryBroker, Transport
from edge_sdk.transport.mqtt import MqttTransport

__all__ = ["run_federation", "simulate", "transport_factory"]

log = logging.getLogger(__name__)

# Algorithms whose clients all train the global architecture (baselines in a mixed federation).
_ONE_ARCH = {"fedavg", "fedprox", "fedavg_ft"}


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
    cores = cfg.threads or os.cpu_count() or 1  # the CPU threads this run may use
    parallel = cfg.parallel or cores
    gate = threading.Semaphore(parallel)
    # Clients train on their own threads: give each an equal share of the cores instead of
    # letting every one spawn a full intra-op pool (measured 1.7× faster on 2 cores). Set
    # before the client threads start, restored when the run ends.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, cores // parallel))
    release = _lean_heap(parallel)
    # With exports, each client's state is kept in OUT/state for `edgefl export`; a simulation
    # starts from scratch, never from what an earlier run with the same OUT left there.
    state_dir = export_dir.parent / "state" if export_dir else None
    if state_dir is not None:
        shutil.rmtree(state_dir, ignore_errors=True)
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
                    state_dir=state_dir,
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
