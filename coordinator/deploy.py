"""Deployment entry points: the coordinator daemon and a client process, both over a real broker.

`run_coordinator(cfg)` is `edgefl coordinator`: it waits for its clients on the broker, runs the
rounds, appends one JSON line per completed round to `OUT/rounds.jsonl` (follow it with
`tail -f`), serves Prometheus metrics when `metrics_port` is set, and writes `results.json`,
`report.md` and the plots with the simulator's own writer. They describe the federation as its
clients registered it (architectures, data set, devices), not the daemon's own config defaults.

`run_client(cfg)` is `edgefl client`: one process holding client `index` of the same split the
simulator would make (same data, ids and seeds), registering, training when asked and exporting
its personalized model as a verified ONNX file into its state dir after the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from coordinator.config import ConfigError
from coordinator.federation import build_coordinator, build_node, prepare_federation
from coordinator.fleet import NetworkFleet
from coordinator.results import (
    ClientResult,
    RoundRecord,
    RunResult,
    build_results,
    write_results,
)
from coordinator.results_model import Results
from coordinator.run_config import RunConfig
from coordinator.server import Coordinator
from coordinator.strategies import strategy_class
from edge_sdk import topics
from edge_sdk.auth import Keyring
from edge_sdk.client import EdgeClient, TaskOutcome
from edge_sdk.transport.mqtt import MqttTransport
from model_zoo.files import atomic_open, write_atomic

__all__ = [
    "RUN_RECORD",
    "RoundsLog",
    "checkpoint_path",
    "metrics_collector",
    "read_run",
    "run_client",
    "run_coordinator",
    "run_device",
]

log = logging.getLogger(__name__)


def _require_broker(cfg: RunConfig) -> None:
    if cfg.broker.url is None:
        raise ConfigError("no broker: pass --broker mqtt://host:port (or set broker.url)")


def _require_unlabeled_file(cfg: RunConfig) -> None:
    """Before any device registers: the unlabeled inputs the algorithm needs (FedMe's, the
    guard's students' `guard_distill_unlabeled`) come from a file in a deployment, which has no
    dataset to hold them out of as a simulation does."""
    algo = cfg.algorithm_config()
    needed = strategy_class(cfg.algorithm).unlabeled_holdout(algo)
    if needed:
        preset = getattr(algo, "preset", None)
        by = f" (preset {preset!r})" if preset == "trusted" else ""
        raise ConfigError(
            f"{cfg.algorithm}{by} needs {needed} unlabeled inputs the coordinator holds, and a "
            "deployment reads them from a file: name a .npy or .safetensors file of inputs in "
            f"{cfg.algorithm}.unlabeled_path"
        )


class RoundsLog:
    """`rounds.jsonl`: one line per completed round, flushed and fsynced as it happens."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def keep(self, records: list[RoundRecord]) -> None:
        """Make the file list exactly these rounds, in order, each once (atomically): a round's
        line already there is kept as written (whole, where the record may be compact); one
        that is missing (the coordinator stopped between its checkpoint and its line) is
        written from its record; lines of rounds the records lack are dropped."""
        wanted = {rec.round for rec in records}
        done: set[int] = set()
        with atomic_open(self.path, text=True) as out:
            for line in self._lines():  # streamed: a large fleet's lines are long
                try:
                    round_ = json.loads(line)["round"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash
                if round_ in wanted and round_ not in done:
                    out.write(line if line.endswith("\n") else line + "\n")
                    done.add(round_)
            for rec in records:
                if rec.round not in done:
                    out.write(json.dumps(_line(rec)) + "\n")

    def _lines(self) -> Iterator[str]:
        if self.path.exists():
            with self.path.open() as f:
                yield from f

    def append(self, rec: RoundRecord) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(_line(rec)) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _line(rec: RoundRecord) -> dict[str, Any]:
    return {
        "round": rec.round,
        "seconds": round(rec.seconds, 4),
        "mean_personal_acc": rec.mean_personal_acc,
        "global_acc": rec.global_acc,
        "failed": rec.failed,
        "trained": rec.trained,
        "replied": rec.replied,
        "n_trained": rec.n_trained,
        "n_replied": rec.n_replied,
        "online": rec.online,
        "offline": rec.offline,
        "client_acc": rec.client_acc,  # each client's personalized accuracy after the round
        "acc_spread": rec.acc_spread,
        "flagged": rec.flagged,
        "rolled_back": rec.rolled_back,
        "suspects": rec.suspects,
    }


def metrics_collector(coordinator: Coordinator) -> Any:
    """A Prometheus collector reading the coordinator's live state at scrape time."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        SummaryMetricFamily,
    )

    class _Collector:
        def collect(self) -> Iterator[Any]:
            c, stats, fleet = coordinator, coordinator.stats, coordinator.fleet
            yield CounterMetricFamily(
                "edgefl_rounds_completed", "Rounds aggregated", value=stats.rounds_completed
            )
            yield CounterMetricFamily(
                "edgefl_rounds_failed", "Rounds that missed quorum", value=stats.rounds_failed
            )
            yield GaugeMetricFamily("edgefl_round", "The current round", value=c._round)
            yield GaugeMetricFamily(
                "edgefl_clients_registered", "Clients registered", value=len(c.clients)
            )
            yield GaugeMetricFamily(
                "edgefl_clients_online",
                "Registered clients online",
                value=len(fleet.known_online()),
            )
            yield SummaryMetricFamily(
                "edgefl_round_seconds",
                "Wall time of each round",
                count_value=len(stats.round_seconds),
                sum_value=sum(stats.round_seconds),
            )
            yield CounterMetricFamily(
                "edgefl_bytes_out", "Payload bytes sent", value=fleet.bytes_out
            )
            yield CounterMetricFamily(
                "edgefl_bytes_in", "Payload bytes received", value=fleet.bytes_in
            )
            rejected = CounterMetricFamily(
                "edgefl_rejected_messages", "Messages dropped, by reason", labels=["reason"]
            )
            for reason, n in sorted(fleet.rejections().items()):
                rejected.add_metric([reason], n)
            yield rejected

    return _Collector()


def checkpoint_path(cfg: RunConfig) -> Path:
    """Where the daemon keeps the checkpoint of run `cfg.run_id` (in its output directory)."""
    return Path(cfg.out or f"runs/{cfg.run_id}") / f"checkpoint-{cfg.run_id}.state"


@contextlib.contextmanager
def _on_signals(handler: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT call `handler` (when we own the main thread) while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda *_: handler())
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# Config sections the daemon does not use: each client picks its data and its model.
_CLIENT_SIDE = frozenset({"data", "models", "client"})


def run_coordinator(
    cfg: RunConfig,
    *,
    fresh: bool = False,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_resume: Callable[[int], None] | None = None,
    on_clients: Callable[[int], None] | None = None,
) -> Results:
    """The coordinator daemon: run `cfg.algorithm` with the clients that come over the broker.
    `on_clients`: told as clients answer a phase's tasks (`Fleet.finished`).

    After every round the whole state goes to `checkpoint_path(cfg)`; a daemon that finds it
    resumes at the next round (`fresh` deletes it and starts over). SIGTERM/SIGINT abandon the
    round in progress and raise `Interrupted` (every completed round is in the checkpoint).
    """
    _require_broker(cfg)
    _require_unlabeled_file(cfg)
    keyring = Keyring.load(cfg.auth, topics.COORDINATOR)
    if keyring is None:
        log.warning("auth.open: messages are not signed; anyone on the broker can forge them")
    out = Path(cfg.out or f"runs/{cfg.run_id}")
    out.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint_path(cfg)
    if fresh and ckpt.exists():
        ckpt.unlink()
        log.warning("--fresh: removed %s; run %s starts over", ckpt, cfg.run_id)
    if cfg.baselines:
        log.warning(
            "baselines %s are simulator-only; the daemon runs %s", cfg.baselines, cfg.algorithm
        )
    rounds_log = RoundsLog(out / "rounds.jsonl")

    def record(rec: RoundRecord) -> None:
        rounds_log.append(rec)
        if on_round is not None:
            on_round(rec)

    transport = MqttTransport(cfg.broker, f"edgefl-{cfg.run_id}-{topics.COORDINATOR}")
    fleet = NetworkFleet(transport, share_models=cfg.broadcast, keyring=keyring)
    fleet.finished = on_clients
    coordinator = build_coordinator(cfg, fleet, on_round=record, checkpoint_path=ckpt)
    # The checkpoint is the truth: rounds.jsonl lists its rounds, each exactly once.
    resumed = coordinator.restore()
    rounds_log.keep(coordinator.records)
    if resumed and on_resume is not None:
        on_resume(len(coordinator.records))
    server = None
    if cfg.metrics_port is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(metrics_collector(coordinator))
        server, _ = start_http_server(cfg.metrics_port, registry=registry)
        log.info("Prometheus metrics on port %d", server.server_port)
    finished = False
    try:
        with _on_signals(coordinator.stop):
            result = coordinator.run()
        finished = True
    finally:
        if finished:
            transport.close()
        else:  # keep the session: what clients send meanwhile waits for the restart
            transport.disconnect()
        if server is not None:
            server.shutdown()
    no_baselines = cfg.model_copy(update={"baselines": []})
    results = build_results(no_baselines, {cfg.algorithm: result})
    # The data and the models are the clients' choice, not the daemon's: the results describe
    # the federation from the clients' registrations (each client's arch, dataset and device),
    # never from the daemon's unused defaults for them.
    results.config = {k: v for k, v in results.config.items() if k not in _CLIENT_SIDE}
    write_results(results, out)
    write_atomic(out / RUN_RECORD, json.dumps(result.to_dict(), indent=1))
    return results


RUN_RECORD = "run.json"  # the coordinator's whole RunResult, for tools that add to its results


def read_run(path: Path) -> RunResult:
    """The RunResult a coordinator daemon left in `OUT/run.json` (see `run_coordinator`)."""
    raw = json.loads(Path(path).read_text())
    return RunResult(
        **{
            **raw,
            "rounds": [RoundRecord(**r) for r in raw["rounds"]],
            "clients": [ClientResult(**c) for c in raw["clients"]],
        }
    )


def run_client(
    cfg: RunConfig,
    *,
    on_task: Callable[[TaskOutcome], None] | None = None,
    on_start: Callable[[EdgeClient], None] | None = None,
) -> EdgeClient:
    """One client process: client `cfg.client.index` of the configured split, over the broker.

    It persists its algorithm state in `cfg.client.state_dir` after every task and resumes from
    it when restarted; SIGTERM/SIGINT stop it after the task in progress, leaving cleanly.
    """
    _require_broker(cfg)
    i = cfg.client.index
    if i is None:  # two devices left on a default would both be client 0, and collide
        raise ConfigError(
            "which client is this? pass --index I (the client of the split whose data it holds; "
            "client.index in a config) and, optionally, --id NAME (default c<I>)"
        )
    fed = prepare_federation(cfg)
    if i >= len(fed.client_ids):
        raise ConfigError(f"client index {i} is out of range for {len(fed.client_ids)} clients")
    cid = cfg.client.id or fed.client_ids[i]
    keyring = Keyring.load(cfg.auth, cid)  # None (auth.open): the client warns of it
    state_dir = Path(cfg.client.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    node = build_node(
        cfg,
        fed,
        i,
        family=cfg.client.model,
        client_id=cid,
        onnx_path=state_dir / f"{cid}.onnx",
        state_dir=state_dir,
    )
    # Over its own MQTT connection, named after the run and the client (a restart resumes it).
    client = EdgeClient(
        node, cfg.broker, keyring=keyring, on_task=on_task, fp16_upload=cfg.fp16_upload
    )
    if cfg.client.late:
        result = client.join_late(timeout=cfg.round.register_timeout_s)
        log.info("%s: personalized from the archive: %s", cid, result.details)
        client.transport.close()
        return client
    with _on_signals(client.request_stop):
        client.start()
        if on_start is not None:
            on_start(client)
        client.run()
    return client


def run_device(cfg: RunConfig, **kwargs: Any) -> EdgeClient:
    """Deprecated: `run_client` (the vocabulary: a client is the participant; a device is where
    tensors compute)."""
    warnings.warn(
        "coordinator.deploy.run_device is deprecated: use run_client", DeprecationWarning, 2
    )
    return run_client(cfg, **kwargs)
